"""Activation checkpoint offload: the inputs a checkpointed layer keeps, in host memory.

    offload = ActivationOffload()
    with offload.hooks():                      # around the checkpointed call (its forward)
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    ...
    loss.backward()                            # x comes back for the layer's recompute
    offload.stats()                            # host bytes now, at the peak, tensors moved

With activation checkpointing a layer keeps only its inputs for the backward (saved through
autograd's saved tensors: ``torch.utils.checkpoint`` saves them before it enters its own
hooks), ``layers x batch x seq_local x hidden`` elements in all: at 1M tokens over 8 ranks
4.3 GB per layer for Llama-3-8B in bf16. ``hooks()`` is a ``saved_tensors_hooks`` context:
every tensor saved while it is active (for a checkpointed call: its inputs; inside the
checkpointed region the checkpoint's own hooks take over) is copied to host memory (pinned
on CUDA) and the device tensor is dropped; in the backward the first unpack brings it back.

On CUDA the copies run on a stream of their own: device-to-host after the compute stream's
work that made the tensor (the device memory is released to the allocator for reuse once
the copy has run: ``record_stream``), host-to-device before the compute stream reads it
(an event). When the backward unpacks the input of layer ``i`` it also starts bringing
back the input saved before it (layer ``i - 1``'s), so that copy overlaps layer ``i``'s
recompute and backward; so during a layer's backward two layer inputs are on the device.
On the CPU the same schedule runs with plain copies (the "host" copy is a second CPU
tensor): memory then behaves as on a GPU, which is how the tests measure it.

What is not offloaded: tensors smaller than ``min_bytes``, parameters, and tensors that do
not own their memory's start (views into a bigger storage would drag it along; they stay).
The host side needs ``layers x batch x seq_local x hidden x element size`` bytes per rank
(``stats()["host_peak"]``; the calculator's host row).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["ActivationOffload"]


class _Offloaded:
    """One saved tensor in host memory (and, brought back ahead of its unpack, on the device).
    The host buffer lives as long as autograd keeps the handle (until the backward has passed
    the layer)."""

    __slots__ = ("host", "device_tensor", "ready", "device", "nbytes", "index", "unpacked", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, index: int):
        self.host = host
        self.device_tensor: torch.Tensor | None = None
        self.ready = None  # CUDA event: the host-to-device copy has run
        self.device = device
        self.nbytes = host.numel() * host.element_size()
        self.index = index
        self.unpacked = False


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host tensor with ``t``'s contents (dense, pinned when asked). The copy is issued on
    the current stream (the caller picks the offload stream)."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t, non_blocking=pin)
    return host


def _device_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device tensor with ``host``'s contents (issued on the current stream)."""
    dev = torch.empty(host.shape, dtype=host.dtype, device=device)
    dev.copy_(host, non_blocking=host.is_pinned())
    return dev


class ActivationOffload:
    """Keeps the tensors saved under ``hooks()`` in host memory until the backward needs them.

    Args:
        min_bytes: smaller tensors stay where they are (default 1: only empty ones stay;
            under a checkpointed call's hooks only its inputs are saved, all worth moving).
        prefetch: when a tensor is brought back, also bring back the one saved before it
            (the previous layer's input), overlapped on CUDA; default on.
        pin_memory: host buffers in pinned memory (default: on CUDA devices).

    One object serves every layer of a model, step after step; it holds no tensor of a
    finished backward. ``stats()`` reports the host bytes (now and at the peak) and how many
    tensors went out and came back.
    """

    def __init__(self, *, min_bytes: int = 1, prefetch: bool = True, pin_memory: bool | None = None):
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._saved: list[weakref.ref] = []  # handles in the order they were saved
        self.host_bytes = 0
        self.host_peak = 0
        self.offloaded = 0
        self.restored = 0

    # ---- the context ---------------------------------------------------------------------
    def hooks(self):
        """The ``saved_tensors_hooks`` context: enter it around the checkpointed calls' forward."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def stats(self) -> dict[str, int]:
        """``host_bytes`` (now: 0 once the backward has passed every layer), ``host_peak`` (the
        most held at once), ``offloaded`` and ``restored`` (tensors moved out and back since the
        object was made)."""
        return {"host_bytes": self.host_bytes, "host_peak": self.host_peak, "offloaded": self.offloaded, "restored": self.restored}

    # ---- pack: device -> host ------------------------------------------------------------
    def _worth_moving(self, t: torch.Tensor) -> bool:
        if isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return False
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes:
            return False
        # A tensor that does not span its storage (a view of a bigger buffer) would keep the
        # buffer alive anyway; only whole storages are worth moving.
        return t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes and t.is_contiguous()

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _pack(self, t: torch.Tensor):
        if not self._worth_moving(t):
            return t
        pin = t.is_cuda if self.pin_memory is None else self.pin_memory
        if t.is_cuda:
            side = self._stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host = _host_copy(t.detach(), pin)
            t.record_stream(side)  # its memory returns to the allocator once the copy ran
        else:
            host = _host_copy(t.detach(), pin)
        handle = _Offloaded(host, t.device, len(self._saved))
        self._saved.append(weakref.ref(handle))
        weakref.finalize(handle, self._host_released, handle.nbytes)
        self.host_bytes += handle.nbytes
        self.host_peak = max(self.host_peak, self.host_bytes)
        self.offloaded += 1
        return handle

    # ---- unpack: host -> device ----------------------------------------------------------
    def _bring_back(self, handle: _Offloaded) -> None:
        """Start the host-to-device copy of ``handle`` (kept on the handle until unpacked)."""
        if handle.device_tensor is not None:
            return
        if handle.device.type == "cuda":
            side = self._stream(handle.device)
            with torch.cuda.stream(side):
                handle.device_tensor = _device_copy(handle.host, handle.device)
                handle.ready = side.record_event()
        else:
            handle.device_tensor = _device_copy(handle.host, handle.device)
        self.restored += 1

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        self._bring_back(packed)
        if self.prefetch:
            earlier = self._previous(packed.index)
            if earlier is not None:
                self._bring_back(earlier)
        # The handle lets the device tensor go: it lives as long as the recompute uses it, as
        # the original did (a second unpack, retain_graph, copies the host buffer again).
        t, packed.device_tensor = packed.device_tensor, None
        if packed.ready is not None:
            current = torch.cuda.current_stream(packed.device)
            current.wait_event(packed.ready)
            t.record_stream(current)  # made on the offload stream, used on this one
            packed.ready = None
        packed.unpacked = True
        return t

    def _previous(self, index: int) -> _Offloaded | None:
        """The live handle saved last before ``index`` that was never unpacked nor brought back."""
        for ref in reversed(self._saved[:index]):
            handle = ref()
            if handle is not None and not handle.unpacked and handle.device_tensor is None:
                return handle
        self._prune()
        return None

    def _host_released(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def _prune(self) -> None:
        """Forget handles autograd has freed (a finished backward)."""
        self._saved = [r for r in self._saved if r() is not None]
        for i, r in enumerate(self._saved):
            r().index = i
