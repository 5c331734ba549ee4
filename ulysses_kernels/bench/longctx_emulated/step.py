"""The model and one measured training step of rank 0: the model sizes (``MODELS``), the
long-context pieces (``PIECES``), the proxy attention, the model built in its dtype on the
device, rank 0's share of a batch, and one step's bytes and seconds."""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass

import torch

from ... import longctx
from ...backends import SDPABackend
from ...traffic import LiveBytes

# Real sizes (config.json of each model); ``tiny``, ``tiny-qwen2`` (Qwen2.5-14B's 40/8 heads) for the CPU.
MODELS = {
    "llama3-8b": {"family": "llama", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256},
    "qwen2.5-14b": {"family": "qwen2", "layers": 48, "hidden": 5120, "heads": 40, "kv_heads": 8, "intermediate": 13824, "vocab": 152064},
    "tiny": {"family": "llama", "layers": 4, "hidden": 64, "heads": 8, "kv_heads": 4, "intermediate": 160, "vocab": 256},
    "tiny-qwen2": {"family": "qwen2", "layers": 4, "hidden": 160, "heads": 40, "kv_heads": 8, "intermediate": 96, "vocab": 256},
}


# The long-context pieces, each on and off (bench.longctx's rows too).
PIECES = {
    "none": {},
    "loss": {"tiled_loss": True},
    "mlp": {"tiled_mlp": True},
    "norms": {"tiled_norms": True},
    "offload": {"offload_activations": True},
    "all": {"tiled_loss": True, "tiled_mlp": True, "tiled_norms": True, "offload_activations": True},
}


class ProxyAttention(SDPABackend):
    """SDPA on the sequence cut into blocks of ``block`` tokens, as a batch (causal inside each):
    the kernel, its inputs, outputs, log-sum-exp, gradients and workspaces have the sizes of the
    whole-sequence call (per token), its FLOPs are linear in the sequence. A memory stand-in for
    long rows, never a model of attention's values."""

    name = "sdpa-proxy"

    def __init__(self, block: int):
        self.block = block

    def attend(self, q, k, v, causal, scale, docs=None):
        if docs is not None:
            raise ValueError("ProxyAttention: packed documents are not emulated")
        B, S = q.shape[:2]
        b = math.gcd(S, self.block)
        blocks = lambda x: x.unflatten(1, (S // b, b)).flatten(0, 1)  # noqa: E731  [B*S/b, b, h, D] views
        out = super().attend(blocks(q), blocks(k), blocks(v), causal, scale)
        return out.unflatten(0, (B, S // b)).flatten(1, 2)


@dataclass(frozen=True)
class Config:
    """One model at one group size: ``sizes`` from ``MODELS`` (``layers`` there: the real count)."""

    name: str
    sp: int
    sizes: dict

    @property
    def key(self) -> str:
        return f"{self.name}@{self.sp}"

    @property
    def real_layers(self) -> int:
        return self.sizes["layers"]


def parse_models(spec: str, default_sp: int) -> list[Config]:
    out = []
    for item in spec.split(","):
        name, _, sp = item.partition("@")
        if name not in MODELS:
            raise SystemExit(f"bench.longctx: --model expected names of {', '.join(MODELS)} (optionally @sp), got {name!r}")
        out.append(Config(name, int(sp) if sp else default_sp, dict(MODELS[name])))
    return out


def build_model(cfg: Config, layers: int, device, dtype, seed: int):
    import transformers

    s = cfg.sizes
    cls = {"llama": "Llama", "qwen2": "Qwen2"}[s["family"]]
    conf = getattr(transformers, f"{cls}Config")(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=layers,
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=1 << 25,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the model's dtype, on the device: no float32 copy on the host
    try:
        with torch.device(device):
            model = getattr(transformers, f"{cls}ForCausalLM")(conf)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(device=device, dtype=dtype).train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def apply_pieces(model, comm, pieces: str, attention: str, block: int):
    from ...integrations import hf

    kw = {k: longctx.ActivationOffload() if k == "offload_activations" else True for k in PIECES[pieces]}
    kw = {"tiled_loss": False, "tiled_mlp": False, "tiled_norms": False, "offload_activations": False, **kw}
    attn_fn = ProxyAttention(block) if attention == "proxy" else None
    return hf.apply(model, None, comm=comm, check="never", attn_fn=attn_fn, **kw)


def shard(model, seq: int, comm, device):
    """Rank ``comm.rank``'s share of a random global batch of ``seq`` tokens."""
    from ...integrations import hf

    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)
    return hf.shard_batch(ids, comm=comm, check=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_step(model, batch, device, fresh: bool = True) -> dict:
    """One training step: seconds, bytes before it, forward end and peak above them, reserved
    peak, offload host bytes. Each parameter gradient is dropped once accumulated (CUDA: freed;
    CPU: ``LiveBytes.forget``). ``fresh``: the allocator's cache emptied first (the reserved
    peak is this step's); a timed step keeps it (as a training loop's later steps do)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    tracker = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if fresh:
            torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        reset_host = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
        if reset_host is not None:
            reset_host()

        def drop(p):
            p.grad = None
    else:
        # LiveBytes counts what the step allocates; what was there before: parameters and buffers
        before = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        tracker = LiveBytes(host_sites=("offload._host_copy",))

        def drop(p):
            tracker.forget(p.grad)

    hooks = [p.register_post_accumulate_grad_hook(drop) for p in model.parameters()]
    try:
        t0 = time.perf_counter()
        if tracker is not None:
            tracker.__enter__()
        try:
            out = model(**batch.model_inputs())
            forward_end = torch.cuda.memory_allocated(device) - before if tracker is None else tracker.current
            with torch.utils.checkpoint.GraphExecGroup():
                out.loss.backward()
            loss = float(out.loss.detach())
            del out
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    state = longctx.state(model)
    host = state.offload.stats()["host_peak"] if state is not None and state.offload is not None else 0
    rec = {"loss": loss, "step_s": seconds, "before": before, "forward_end": forward_end, "host_peak": host}
    if tracker is None:
        rec.update(peak=torch.cuda.max_memory_allocated(device) - before, reserved_peak=torch.cuda.max_memory_reserved(device))
        stats = getattr(torch.cuda, "host_memory_stats", None)
        if stats is not None:
            with contextlib.suppress(RuntimeError):
                rec["pinned_host"] = {k: v for k, v in stats().items() if "bytes" in k and ("peak" in k or "current" in k)}
    else:
        rec.update(peak=tracker.peak, reserved_peak=None)
        rec["host_peak"] = tracker.host_peak
    return rec


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
