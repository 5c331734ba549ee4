"""The accuracy study of FP8 on the wire in training (docs/fp8_wire.md).

A small Llama-style model (transformers' ``LlamaForCausalLM`` from a tiny config, no
download; float32 master weights, attention in bf16) trained on synthetic but learnable data
three ways, from the same initial weights on the same batches:

* ``one_process``: the whole sequence in one process (no exchange);
* ``bf16_wire``: Ulysses over 2 gloo ranks, the attention's bf16 tensors on the wire;
* ``fp8_wire``: the same with ``wire_dtype="fp8"`` (e4m3 forward, e5m2 backward).

Data: sequences of ``seq`` tokens whose first half follows a fixed random bigram chain and
whose second half repeats the first (learnable locally, and across the sequence: the copy
needs attention between the halves, which lie on different ranks).

Recorded: the loss of every step of each run, the final loss (mean of the last 20 steps),
and at checkpoints along the bf16-wire run the gradient of each layer with the FP8 wire,
the bf16 wire and in one process on the same weights and batch (cosine similarity per
layer). Writes ``fp8_study.json``, ``fp8_study.png`` and a README to ``--out``.

    python -m ulysses_kernels.bench.fp8_study --steps 300 --out bench/results/<date>_cpu_fp8_study
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.distributed as dist

from .record import git_sha

VOCAB, HALF = 64, None


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip


def _chain() -> torch.Tensor:
    """The bigram chain: each token's next-token distribution (4 likely successors)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 0.5
    top = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    logits.scatter_add_(1, top, torch.full((VOCAB, 4), 4.0))
    return torch.softmax(logits, -1)


def batch(step: int, bsz: int, seq: int) -> torch.Tensor:
    """``[bsz, seq]`` token ids of ``step`` (the same on every rank and in every run)."""
    g = torch.Generator().manual_seed(10_000 + step)
    probs, half = _chain(), seq // 2
    ids = torch.empty(bsz, half, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (bsz,), generator=g)
    for t in range(1, half):
        ids[:, t] = torch.multinomial(probs[ids[:, t - 1]], 1, generator=g).squeeze(1)
    return torch.cat([ids, ids], 1)


def _attention(wire_dtype, group):
    """An attention function for transformers' ``AttentionInterface``: the model's q/k/v
    ``[B, H, s, D]`` in bf16 through ``ulysses_attention`` (causal over the global sequence)."""
    import ulysses_kernels as uk

    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q, k, v = (x.transpose(1, 2).to(torch.bfloat16) for x in (query, key, value))
        out = uk.ulysses_attention(q, k, v, group=group, causal=True, softmax_scale=scaling, attn_fn="sdpa", kernels="torch",
                                   wire_dtype=wire_dtype, check=False)  # fmt: skip
        return out.to(query.dtype), None

    return fn


def _model(name: str, fn):
    from transformers import AttentionInterface, LlamaForCausalLM

    AttentionInterface.register(name, fn)
    torch.manual_seed(0)
    cfg = _config()
    cfg._attn_implementation = name
    return LlamaForCausalLM(cfg)


def _loss_and_grads(model, ids: torch.Tensor, rank: int, world: int):
    """This rank's shard's loss summed, over all tokens' count; backward; grads summed across ranks."""
    bsz, seq = ids.shape
    s = seq // world
    labels = torch.cat([ids[:, 1:], torch.full((bsz, 1), -100)], 1)
    sl = slice(rank * s, (rank + 1) * s)
    pos = torch.arange(rank * s, (rank + 1) * s).expand(bsz, s)
    logits = model(input_ids=ids[:, sl], position_ids=pos).logits.float()
    lab = labels[:, sl]
    n_total = (labels != -100).sum()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), lab.reshape(-1), ignore_index=-100, reduction="sum") / n_total
    loss.backward()
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
    return loss.item()


def layer_grads(model) -> dict[str, torch.Tensor]:
    """Per layer (embedding, each decoder layer, final norm + head): its parameters' gradients, flat."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        key = "embed" if "embed_tokens" in name else f"layer{name.split('.')[2]}" if ".layers." in name else "head"
        groups.setdefault(key, []).append(p.grad.detach().reshape(-1).double())
    return {k: torch.cat(v) for k, v in groups.items()}


def _train(model, steps: int, bsz: int, seq: int, rank: int, world: int, probe=None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(steps):
        ids = batch(step, bsz, seq)
        if probe is not None:
            probe(step, model, ids)
        opt.zero_grad(set_to_none=True)
        losses.append(_loss_and_grads(model, ids, rank, world))
        opt.step()
    return losses


def _ranks(rank: int, world: int, steps: int, bsz: int, seq: int, checkpoints: list[int], out: str) -> None:
    torch.set_num_threads(1)
    group = dist.group.WORLD
    runs, probes = {}, {}
    fp8 = _model("uk_fp8_wire", _attention("fp8", group))
    bf16 = _model("uk_bf16_wire", _attention(None, group))

    def probe(step, model, ids):
        if step not in checkpoints:
            return
        fp8.load_state_dict(model.state_dict())
        grads = {}
        for name, m in (("bf16_wire", model), ("fp8_wire", fp8)):
            m.zero_grad(set_to_none=True)
            _loss_and_grads(m, ids, rank, world)
            grads[name] = layer_grads(m)
        model.zero_grad(set_to_none=True)
        probes[step] = {"state": {k: v.clone() for k, v in model.state_dict().items()}, "grads": grads}

    t0 = time.perf_counter()
    runs["bf16_wire"] = _train(bf16, steps, bsz, seq, rank, world, probe)
    fp8 = _model("uk_fp8_wire", _attention("fp8", group))  # fresh, the same initial weights
    runs["fp8_wire"] = _train(fp8, steps, bsz, seq, rank, world)
    if rank == 0:
        torch.save({"runs": runs, "probes": probes, "seconds": time.perf_counter() - t0}, os.path.join(out, "ranks.pt"))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a @ b / (a.norm() * b.norm())).item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    checkpoints = sorted({0, args.steps // 3, 2 * args.steps // 3, args.steps - 1})
    from ..testing import run_ranks

    t0 = time.perf_counter()
    run_ranks(_ranks, 2, args.steps, args.batch, args.seq, checkpoints, args.out, timeout_s=3600)
    got = torch.load(os.path.join(args.out, "ranks.pt"))
    os.remove(os.path.join(args.out, "ranks.pt"))
    # One process: the same model and batches, the whole sequence, no exchange.
    torch.set_num_threads(1)
    one = _model("uk_one_process", _attention(None, None))
    runs = dict(got["runs"])
    runs["one_process"] = _train(one, args.steps, args.batch, args.seq, 0, 1)
    cosines = {}
    for step, pr in got["probes"].items():
        one.load_state_dict(pr["state"])
        one.zero_grad(set_to_none=True)
        _loss_and_grads(one, batch(step, args.batch, args.seq), 0, 1)
        ref = layer_grads(one)
        g8, g16 = pr["grads"]["fp8_wire"], pr["grads"]["bf16_wire"]
        cosines[str(step)] = {
            layer: {
                "fp8_vs_bf16_wire": _cos(g8[layer], g16[layer]),
                "fp8_vs_one_process": _cos(g8[layer], ref[layer]),
                "bf16_wire_vs_one_process": _cos(g16[layer], ref[layer]),
            }  # fmt: skip
            for layer in ref
        }
    last = {k: sum(v[-20:]) / len(v[-20:]) for k, v in runs.items()}
    result = {
        "what": "FP8 on the wire in training: a tiny Llama (2 layers, hidden 64, 4/2 heads, head_dim 16), 2 gloo ranks, CPU",
        "steps": args.steps, "batch": args.batch, "seq": args.seq, "optimizer": "AdamW lr 3e-3",
        "final_loss_mean_last_20": last,
        "final_loss_rel_diff_fp8_vs_bf16_wire": (last["fp8_wire"] - last["bf16_wire"]) / last["bf16_wire"],
        "final_loss_rel_diff_bf16_wire_vs_one_process": (last["bf16_wire"] - last["one_process"]) / last["one_process"],
        "grad_cosine_per_layer": cosines,
        "losses": runs,
        "wall_seconds": time.perf_counter() - t0,
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
        "git_sha": git_sha(),
    }  # fmt: skip
    with open(os.path.join(args.out, "fp8_study.json"), "w") as f:
        json.dump(result, f, indent=1)
    _plot(result, os.path.join(args.out, "fp8_study.png"))
    print(json.dumps({k: result[k] for k in ("final_loss_mean_last_20", "final_loss_rel_diff_fp8_vs_bf16_wire", "wall_seconds")}, indent=1))
    for step, per in cosines.items():
        print(step, {k: round(v["fp8_vs_bf16_wire"], 5) for k, v in per.items()})


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, losses in result["losses"].items():
        a.plot(losses, label=name, lw=1)
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_yscale("log")
    a.set_title("training loss")
    a.legend()
    steps = sorted(result["grad_cosine_per_layer"], key=int)
    layers = list(result["grad_cosine_per_layer"][steps[0]])
    for layer in layers:
        b.plot([int(s) for s in steps], [1 - result["grad_cosine_per_layer"][s][layer]["fp8_vs_bf16_wire"] for s in steps], "o-", label=layer)
    b.set_yscale("log")
    b.set_xlabel("step (weights of the bf16-wire run)")
    b.set_ylabel("1 - cosine(grad fp8 wire, grad bf16 wire)")
    b.set_title("per-layer gradient agreement")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
