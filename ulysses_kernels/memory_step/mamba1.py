"""Jamba's Mamba1 mixer in the replay, as ``hf.apply`` runs it (``layers/mixers/__init__.py``,
``_mamba1_forward``): three exchanges and one back, transformers' recurrent
``mamba_selective_scan`` (its torch path: one ``[B, c, Ns]`` state per token, all kept).

One layer on a rank with ``n`` local tokens and ``N`` of the whole sequence, ``I`` channels (one
a head) of which the rank holds ``c``, ``Ns`` the state, ``R`` dt's rank, ``K`` the conv width::

    local:  in_proj -> [n, 2 I] (x | gate; goes once the gate is sent)
    send    x [n, I]                  -> recv [N, c]          the conv's input, kept
    conv:   its output [N + B (K - 1), c] kept (silu's input); silu's output copied and sent back
    back    [n, I] kept (x_proj's input); x_proj's output [n, R + 2 Ns] kept (the three norms'
            input), their float32 normalized [n, R + 2 Ns] and rsqrt [n] x 3, dt's norm output
            [n, R] (dt_proj's input)
    send    x | dt | gate [n, 3 I], B | C [n, 2 Ns] -> recv [N, 3 c + 2 Ns], kept (views the scan saves)
    scan:   float32 dt + bias and softplus [N, c]; exp(A dt) and dt B [N, c, Ns]; the N + B states
            [c, Ns]; the output plus D x and silu(gate) [N, c]
    out     [N, c] -> one all-to-all back -> [n, I] kept (out_proj's input)

State passing (``mixer_parallel="state"``, ``mamba1_state_stages``): no exchange; every tensor
above over the rank's ``n`` tokens and all ``I`` channels (``N -> n``, ``c -> I``), the conv's
input and output after its halo (``W = n + B halo`` tokens), the scan with no gate, then
``state_passing.selective``'s closed form: dt + bias and its running sum ``[n, I]`` float32,
``exp(A sum)`` and ``J`` (that times C) ``[n, I, Ns]`` float32, the fold
(``MixerReplay._fold``); the corrected output and silu(gate) ``[n, I]`` kept, their product
out_proj's input.
"""

from __future__ import annotations

__all__ = ["mamba1_parameters", "mamba1_stages", "mamba1_state_stages"]


def mamba1_parameters(m, hidden: int) -> int:
    """in_proj, conv (its bias), x_proj, dt_proj (weight, bias), A_log, D, the three norms, out_proj."""
    i, ns, r = m.heads, m.key_dim, m.dt_rank
    return hidden * 2 * i + i * (m.conv + (1 if m.conv_bias else 0)) + i * (r + 2 * ns) + r * i + i + i * ns + i + r + 2 * ns + i * hidden


def mamba1_stages(m, n: int, N: int, c: int, batch: int, e: int, one: bool) -> list[tuple[str, str, int]]:
    """The forward, in order, as ``(action, name, bytes)``: ``new`` kept for the backward,
    ``tmp`` made and freed at the next ``free`` naming it, ``free``."""
    i, ns, r, k = m.heads, m.key_dim, m.dt_rank, m.conv
    w = max(e, 4)  # the scan computes in float32
    return [
        ("tmp", "proj", n * 2 * i * e),
        ("tmp", "send1", 0 if one else n * i * e),
        ("new", "conv_in", N * c * e),  # the first exchange's receive is the conv's input
        ("free", "send1", 0),
        ("new", "conv_w", c * (k * e + 8)),  # the rank's weight rows and bias, their index
        ("new", "conv_out", (N + batch * (k - 1)) * c * e),
        ("tmp", "silu", 2 * N * c * e),  # its output and the copy sent back
        ("new", "x", n * i * e),
        ("free", "silu", 0),
        ("new", "xproj", n * (r + 2 * ns) * e),
        ("new", "norms", n * (r + 2 * ns) * 4 + 3 * n * 4 + n * r * e),
        ("tmp", "send3", (n * (3 * i + 2 * ns) * e) * (1 if one else 2)),  # dt, the stack (and the send)
        ("free", "proj", 0),
        ("new", "recv", N * (3 * c + 2 * ns) * e),
        ("free", "send3", 0),
        ("new", "dt", 2 * N * c * w + 2 * c * ns * 4),  # dt + bias, softplus; exp(A_log) and -A
        ("new", "discrete", 2 * N * c * ns * 4),  # exp(A dt), dt B
        ("tmp", "deltaB_u", N * c * ns * 4),
        ("new", "states", N * c * ns * 4 + batch * c * ns * e),
        ("tmp", "steps", N * c * e),  # each token's output, until the stack
        ("free", "deltaB_u", 0),
        ("new", "kernel", 2 * N * c * w),  # the output plus D x, silu(gate)
        ("free", "steps", 0),
    ]


def mamba1_state_stages(m, n: int, batch: int, e: int, window: int, fold: int) -> list[tuple[str, str, int]]:
    """``mamba1_stages`` under state passing (the module docstring): ``window`` the conv's input
    tokens (the shard after its halo, batch x), ``fold`` the fold's kept bytes."""
    i, ns, r, k = m.heads, m.key_dim, m.dt_rank, m.conv
    w = max(e, 4)
    conv_out = (window + batch * (k - 1)) * i * e
    return [
        ("tmp", "proj", n * 2 * i * e),  # x | gate, until the stack
        ("new", "conv_in", window * i * e),
        ("new", "conv_w", i * (k * e + 8)),
        ("new", "conv_out", conv_out),
        ("tmp", "silu", conv_out),
        ("new", "x", n * i * e),  # silu's output, contiguous (x_proj's input)
        ("free", "silu", 0),
        ("new", "xproj", n * (r + 2 * ns) * e),
        ("new", "norms", n * (r + 2 * ns) * 4 + 3 * n * 4 + n * r * e),
        ("tmp", "dt_proj", n * i * e),
        ("new", "recv", n * (3 * i + 2 * ns) * e),  # x | dt | gate and B | C, stacked: the scan's inputs
        ("free", "dt_proj", 0),
        ("free", "proj", 0),
        ("new", "dt", 2 * n * i * w + 2 * i * ns * 4),
        ("new", "discrete", 2 * n * i * ns * 4),
        ("tmp", "deltaB_u", n * i * ns * 4),
        ("new", "states", n * i * ns * 4 + batch * i * ns * e),
        ("tmp", "steps", n * i * e),
        ("free", "deltaB_u", 0),
        ("free", "steps", 0),
        ("new", "closed", 2 * n * i * 4 + 2 * n * i * ns * 4),  # dt + bias, its running sum; exp(A sum), J
        ("new", "fold", fold),
        ("new", "kernel", 2 * n * i * w),  # the corrected output, silu(gate)
    ]
