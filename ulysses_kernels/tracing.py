"""Whether the running Python is being traced by ``torch.compile`` or ``torch.export``.

``in_trace()`` is ``torch.compiler.is_dynamo_compiling()`` (False when the code runs; Dynamo folds it
to True while it traces the code) or ``torch.compiler.is_exporting()``. Not
``torch.compiler.is_compiling()``: in torch 2.14 that reads one process-wide flag held for a whole
compile session, so a thread running eagerly reads True while another thread compiles. FlexAttention's
eager call compiles its operator (with the "eager" backend), so thread ranks saw each other's compiles:
a packed-documents rank then refused FlexAttention as "inside torch.compile's trace", and a traced
branch would have skipped the cross-rank checks its peers ran (tests/test_tracing.py shows the race).
"""

from __future__ import annotations

import torch

__all__ = ["in_trace"]


def in_trace() -> bool:
    """True while this code is traced by torch.compile (Dynamo) or torch.export; False when it runs."""
    return torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting()
