import os

# Triton kernels run under the interpreter on machines without a GPU; this must be set
# before any module with @triton.jit is imported.
try:
    import torch

    _has_gpu = torch.cuda.is_available()
except Exception:  # noqa: BLE001 - torch missing is reported by the tests themselves
    _has_gpu = False
if not _has_gpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
