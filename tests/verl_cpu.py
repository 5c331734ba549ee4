"""verl 0.9.1 on the CPU, for tests/test_verl*.py (not a test module itself).

* ``CPUPlatform`` / ``use_cpu_platform()``: verl's device helpers (``verl.utils.device``:
  ``get_device_name``, ``get_device_id``, ``get_nccl_backend``, ...) answer "cpu" and "gloo"
  instead of probing for CUDA, through verl's own platform registry
  (``verl.plugin.platform.platform_manager.set_platform``).
* ``flash_standin``: a CPU stand-in for the flash-attn varlen kernel as verl's own Ulysses
  reaches it. verl's ``_ulysses_flash_attention_forward`` gathers the position ids and calls
  transformers' ``_flash_attention_forward`` (imported by name into
  ``verl.models.transformers.monkey_patch``), which on a GPU turns restarting position ids
  into ``cu_seqlens`` and calls ``flash_attn_varlen_func``. The stand-in takes that call's
  arguments and runs SDPA on each packed document (a document starts where the position
  is 0: the rule transformers applies), causal inside it.
* ``as_flash_model(model)``: mark a model built with ``sdpa`` as a ``flash_attention_2``
  model, as verl builds it on a GPU (transformers refuses the name without flash-attn
  installed; its dispatch only reads the config), so that verl's path runs through its hook
  into the stand-in.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class _CPUDeviceModule:
    """What verl calls on ``get_torch_device()`` (``torch.cuda``'s memory and cache helpers),
    answered for the CPU: no cache to empty, no device memory to report."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name.startswith(("max_memory", "memory_")) or name == "mem_get_info":
            return lambda *a, **k: 0 if name != "mem_get_info" else (0, 0)
        if name in ("empty_cache", "reset_peak_memory_stats", "set_device", "manual_seed", "manual_seed_all", "ipc_collect"):
            return lambda *a, **k: None
        raise AttributeError(f"verl_cpu: the CPU stand-in for torch.cuda has no {name!r}")


_CPU_DEVICE_MODULE = _CPUDeviceModule()


def _platform_class():
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUPlatform(PlatformBase):
        """verl's device helpers on the CPU (gloo for collectives)."""

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: _CPU_DEVICE_MODULE)

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return "cpu"  # verl uses it as a device: tensor.to(get_device_id())

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

        def nvtx_range(self, msg: str):
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

    return CPUPlatform


def use_cpu_platform() -> None:
    """Point verl's device helpers at the CPU in this process (before verl asks for them)."""
    from verl.plugin.platform import platform_manager

    if getattr(platform_manager._current_platform, "device_name", None) != "cpu":
        platform_manager.set_platform(_platform_class()())


def _starts(position_ids: torch.Tensor) -> list[int]:
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten().tolist()
    return starts if starts and starts[0] == 0 else [0] + starts


def flash_standin(query_states, key_states, value_states, attention_mask, query_length, *args, position_ids=None,
                  is_causal=True, dropout=0.0, softmax_scale=None, sliding_window=None, softcap=None, **kwargs):  # fmt: skip
    """transformers' ``_flash_attention_forward`` on the CPU: ``[B, S, Hq, D]`` q and
    ``[B, S, Hkv, D]`` k/v -> ``[B, S, Hq, D]``, SDPA per packed document (batch 1 when
    the position ids restart), GQA by grouping (flash-attn's convention)."""
    assert attention_mask is None, "the stand-in covers verl's remove-padding path (no mask)"
    assert not dropout and sliding_window is None and softcap is None, "plain causal attention only"
    seq = query_states.shape[1]
    bounds = _starts(position_ids) + [seq] if position_ids is not None else [0, seq]
    assert position_ids is None or query_states.shape[0] == 1 or len(bounds) == 2
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[:, a:b].transpose(1, 2) for t in (query_states, key_states, value_states))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=softmax_scale, enable_gqa=True)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


def install_flash_standin() -> None:
    """Make verl's Ulysses hook call ``flash_standin`` where it calls transformers' flash path."""
    import verl.models.transformers.monkey_patch as mp

    mp._flash_attention_forward = flash_standin


def as_flash_model(model):
    """Mark ``model`` (built with ``sdpa``) as verl's ``flash_attention_2`` model (see the module docstring)."""
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config._attn_implementation = "flash_attention_2"
    return model
