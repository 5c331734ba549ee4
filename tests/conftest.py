import os

# Triton kernels run under the interpreter on machines without a GPU; this must be set
# before any module with @triton.jit is imported.
try:
    import torch

    _has_gpu = torch.cuda.is_available()
except Exception:  # noqa: BLE001 - torch missing is reported by the tests themselves
    torch, _has_gpu = None, False
if not _has_gpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"  # for the ranks and subprocesses the tests spawn
    # torch, imported above, has read the variable already (its OpenMP runtime at load):
    # set this process's intra-op threads too. The bit-for-bit CPU tests assume one thread
    # (see test_stream_safety._cpu_attention_rank), as scripts/test.sh gives them; the GPU
    # runbook (scripts/gpu_session.sh) runs pytest on a 16-core machine without the variable.
    if torch is not None:
        torch.set_num_threads(1)
