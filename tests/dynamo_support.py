"""What this torch's ``torch.compile`` does with an exception raised while tracing."""

import functools

import torch


@functools.cache
def keeps_messages() -> bool:
    """Whether a ``fullgraph=True`` compile re-raises with the exception's message in its
    text. torch 2.11 and 2.14 do; torch 2.8 shows only the source line of the ``raise``
    ("Observed exception"), so a computed message never reaches the user (measured)."""

    def f(x):
        raise ValueError(f"probe-{x.shape[0] + 6}")

    try:
        torch.compile(f, fullgraph=True, backend="eager")(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - any type: only its text is looked at
        return "probe-7" in str(e)
    return False


def traced_error(pattern: str) -> str:
    """``pattern`` for ``pytest.raises(match=)`` around a compiled call whose trace raises:
    itself where torch keeps the message, else dynamo's own words for a user exception."""
    return pattern if keeps_messages() else "Observed exception"
