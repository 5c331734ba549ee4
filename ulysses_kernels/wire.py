"""FP8 on the wire: the formats, which exchanges use them, and the wire layout in bytes.

``ulysses_attention(..., wire_dtype="fp8")`` sends each exchange's tensors as FP8 with one
float32 scale per (token, head), quantized in the pack and dequantized in the unpack, in the
same collective as today (one send and one receive buffer, of bytes):

* forward activations (q/k/v to heads, the output back): ``E4M3`` (``torch.float8_e4m3fn``,
  3 mantissa bits, largest finite 448);
* gradients (``d_out`` to heads, dq/dk/dv back): ``E5M2`` (``torch.float8_e5m2``, 2 mantissa
  bits, largest finite 57344), whose range suits gradients.

``WireSpec`` names the format of each of the four exchanges (``None``: that exchange moves the
attention dtype as today); ``wire_spec("fp8")`` is all four as above.

The wire format of one (token, head) row of ``D`` elements is ``D + 4`` bytes::

    | q[0] q[1] ... q[D-1] | scale (float32, little-endian) |
      D bytes of FP8         4 bytes

so a head of ``D`` elements is a head of ``D + 4`` bytes, and every buffer and block of
``layout`` (splits, views, pieces per peer and batch element, head slices of a block) is the
same buffer of ``wire_layout(layout, fmt)``, whose head dims are ``D + 4`` and ``Dv + 4`` and
whose element is one byte. Nothing else of the layout changes: the fp8 payload and its scales
travel in the same collective, each peer's block in one piece.

Quantization (the definition every kernel set matches bit for bit, ``torch_kernels``)::

    amax  = max(max_i |x_i| (in float32), 2**-100)   # the floor keeps an all-zero row finite
    inv   = FMT_MAX / amax                            # float32, correctly rounded
    q_i   = fp8(clamp(x_i * inv, -FMT_MAX, FMT_MAX))  # round to nearest even
    scale = amax / FMT_MAX                            # float32, on the wire
    x'_i  = dtype(float32(q_i) * scale)               # the unpack, in the attention dtype

Replicated KV heads' gradients (summed in rank order) are dequantized block by block and
added in the attention dtype, as ``add_`` adds. Error per element (``error_bound``): the
format's relative rounding (2^-4 for e4m3, 2^-3 for e5m2) for values in the format's normal
range after scaling, and half the smallest subnormal step (times ``scale``) below it.

Bytes on the wire: ``(D + 4) / (D * itemsize)`` of today's: 0.5 * (1 + 4 / D) for bf16
(0.53125 at D = 64, 0.515625 at D = 128), 0.25 * (1 + 4 / D) for float32.

With one rank nothing goes on a wire: ``resolve_wire`` gives ``None`` (the op is bit for bit
the one without ``wire_dtype``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .layout import QKV, Layout, Routes

__all__ = ["Fp8Format", "E4M3", "E5M2", "WireSpec", "SCALE_BYTES", "row_extra", "wire_spec", "call_routes", "wire_layout", "error_bound", "wire_bytes_ratio"]

SCALE_BYTES = 4  # one float32 scale per (token, head) row
AMAX_FLOOR = 2.0**-100  # the smallest amax: an all-zero row quantizes to zeros with a finite scale


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format: ``name``, the torch dtype, the largest finite value, the mantissa bits
    and the exponent of the smallest subnormal (for ``error_bound``)."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_subnormal_exp: int

    def __repr__(self) -> str:
        return self.name.upper()


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, -9)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, -16)
_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


@dataclass(frozen=True)
class WireSpec:
    """The format of each exchange (``None``: the attention dtype, as without a wire spec).

    ``qkv``: q, k, v to heads (forward); ``out``: the output back (forward); ``dout``: the
    output's gradient to heads (backward); ``grads``: dq, dk, dv back (backward). Formats are
    ``E4M3``/``E5M2`` or their names."""

    qkv: Fp8Format | None = E4M3
    out: Fp8Format | None = E4M3
    dout: Fp8Format | None = E5M2
    grads: Fp8Format | None = E5M2

    def __post_init__(self):
        for name in ("qkv", "out", "dout", "grads"):
            f = getattr(self, name)
            if isinstance(f, str):
                if f not in _FORMATS:
                    raise ValueError(f"WireSpec: {name}={f!r}; expected None or one of {list(_FORMATS)}")
                object.__setattr__(self, name, _FORMATS[f])
            elif f is not None and not isinstance(f, Fp8Format):
                raise ValueError(f"WireSpec: {name}={f!r}; expected None, E4M3, E5M2, 'e4m3' or 'e5m2'")

    @property
    def empty(self) -> bool:
        return self.qkv is None and self.out is None and self.dout is None and self.grads is None


FP8_ALL = WireSpec()  # wire_dtype="fp8": e4m3 forward, e5m2 backward


def wire_spec(wire_dtype, who: str = "ulysses_attention", error: type[ValueError] = ValueError) -> WireSpec | None:
    """``wire_dtype`` as a ``WireSpec``: ``None`` (today), ``"fp8"`` (all four exchanges:
    e4m3 forward, e5m2 backward), or a ``WireSpec``; a spec that names no format is ``None``.
    ``who``: the entry point named in the error (``hf.apply``, verl's ``apply``, ...);
    ``error``: the ``ValueError`` subclass raised (the integration's own error class)."""
    if wire_dtype is None:
        return None
    if isinstance(wire_dtype, WireSpec):
        return None if wire_dtype.empty else wire_dtype
    if wire_dtype == "fp8":
        return FP8_ALL  # one object: inside torch.compile a global constant, which dynamo reads (it cannot build one)
    raise error(f"{who}: wire_dtype={wire_dtype!r}; expected None, 'fp8' or a ulysses_kernels.wire.WireSpec")


def resolve_wire(wire_dtype, kernels, world_size: int) -> WireSpec | None:
    """The call's ``WireSpec`` (``None`` with one rank: nothing goes on a wire), after
    refusing by name a kernel set without the quantizing pack (``quant_pack_s2h``). Eager and
    inside ``torch.compile`` alike (the traced movers quantize, move bytes and dequantize as
    the eager ones do)."""
    spec = wire_spec(wire_dtype)
    if spec is None or world_size == 1:
        return None
    missing = [m for m in ("quant_pack_s2h", "quant_pack_h2s", "dequant_s2h", "dequant_unpack_h2s") if not hasattr(kernels, m)]
    if missing:
        raise ValueError(
            f"ulysses_attention: wire_dtype={wire_dtype!r} needs a kernel set with the quantizing pack; "
            f"kernels={getattr(kernels, 'name', kernels)!r} lacks {', '.join(missing)} (kernels='torch' has it)"
        )
    return spec


def row_extra(fmt: Fp8Format | None) -> int:
    """How much longer a head's row is on the wire in format ``fmt``: the scale's bytes, or 0
    without a format (the ``extra`` of ``Layout.s2h_route``/``h2s_route``)."""
    return 0 if fmt is None else SCALE_BYTES


def call_routes(layout: Layout, spec: WireSpec | None, roles=QKV, out: bool = True) -> Routes:
    """The routes of a call's exchanges (``Layout.routes``), each in the units of its wire:
    buffer elements, or bytes for an exchange ``spec`` gives a format (rows ``SCALE_BYTES``
    longer). ``roles``: what goes to heads (``QKV``; the public ``seq_to_head``'s; none for
    ``head_to_seq``); ``out``: the call moves the attention output (role ``OUT``) back."""
    if spec is None:
        return layout.routes(roles, out)
    return layout.routes(roles, out, tuple(row_extra(f) for f in (spec.qkv, spec.out, spec.dout, spec.grads)))


def wire_layout(layout: Layout, fmt: Fp8Format) -> Layout:
    """``layout`` in wire bytes: head dims ``D + 4`` and ``Dv + 4`` (see the module docstring),
    kept on the layout (one per layout; the format does not change the byte count)."""
    return layout.padded_rows(SCALE_BYTES)


def wire_bytes_ratio(head_dim: int, itemsize: int) -> float:
    """Bytes on the wire with FP8 over bytes without: ``(D + 4) / (D * itemsize)``."""
    return (head_dim + SCALE_BYTES) / (head_dim * itemsize)


@functools.cache
def _unit(fmt: Fp8Format) -> tuple[float, float]:
    return 2.0 ** -(fmt.mantissa_bits + 1), 2.0 ** (fmt.min_subnormal_exp - 1)


def error_bound(x: torch.Tensor, fmt: Fp8Format, out_dtype: torch.dtype) -> torch.Tensor:
    """Per element of ``x`` (``[..., D]``, rows of one scale): the largest ``|x' - x|`` the
    quantize-dequantize may make, in float64: the format's relative rounding ``2^-(m+1) |x|``
    (e4m3: 2^-4, e5m2: 2^-3), or below the format's normal range half its smallest
    subnormal step times the scale, whichever is larger, plus the rounding of the result to
    ``out_dtype`` (half its last place; half its smallest subnormal) and of the float32 scale
    (a few units of float32's last place)."""
    rel, sub = _unit(fmt)
    xd = x.double()
    amax = xd.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    scale = amax / fmt.max
    info = torch.finfo(out_dtype)
    bound = torch.maximum(rel * xd.abs(), sub * scale)
    # The result's rounding to out_dtype: half its last place, or half its smallest subnormal.
    return bound * (1 + 4 * 2.0**-24) + info.eps / 2 * (xd.abs() + bound) + info.smallest_normal * info.eps / 2
