"""Rank 0 of an N-way sequence-parallel job on one device: measured memory and time against the calculator.

    python -m ulysses_kernels.bench.longctx --emulate-rank0-of 4 --model tiny            # CPU: a code-path check
    python bench/bench_longctx.py --emulate-rank0-of 8 --model llama3-8b,qwen2.5-14b@16 \\
        --layers 2,4 --seqs 256K,1M,2M,4M --max-seq --gpu-gb 80 --time-budget 110       # one GPU (docs/longctx.md)

One process runs rank 0's share of the sequence through the model (``hf.apply`` with
``comm.EmulatedPeers``: rank 0's halves of the exchanges, on the buffers an N-way group
gives rank 0, the peers' blocks stand-ins), so that the device holds what rank 0 of the
job holds, except:

* parameters: held in full in the model's dtype (measured: the allocated bytes before the
  step), gradients freed as each is accumulated (as ZeRO reduces and frees them; each one
  counted while it exists), no optimizer step (ZeRO-3 with optimizer offload keeps it on
  the host). ZeRO-3's own state on the rank (parameters / N, gradients / N, the largest
  gathered module) is the calculator's, *modeled*, never measured here;
* layers: ``--layers`` (e.g. 2 and 4, not 32): with activation checkpointing and the
  offload, what a layer adds on the device is measured as the slope between two layer counts
  and the 32-layer (48-layer) figure is *modeled* from it;
* attention: ``proxy`` rows run the same SDPA kernel on the same buffers in blocks of
  ``--proxy-block`` tokens (the sequence as a batch of blocks, causal in each): the kernel's
  tensors and workspaces have the same sizes (all are per token), its FLOPs grow as S x block
  instead of S^2 / 2, so that a 4M-token step takes seconds; ``causal`` rows run the real
  kernel (the time rows, and one memory row that checks the proxy against it);
* no byte crosses a link: the step time has no communication, no NCCL buffer exists.

Each row says what was measured (``layers``, ``seq``, ``pieces``, ``attention``) and holds
the calculator's replay (``memory_step``) of the same setup, term by term: parameters held,
the forward's end, the step's activation peak (``max_memory_allocated`` less the bytes before
the step), the allocator's reserved peak (``max_memory_reserved``: no calculator term), the
offload's host bytes (and the pinned host allocator's); ``model_*`` fields are extrapolations
and say from what. ``--max-seq`` probes the longest sequence by measurement under a cap on the
allocator (``torch.cuda.set_per_process_memory_fraction``): 80 GB less the modeled ZeRO-3
state and the modeled layers beyond the measured ones, plus the parameters held here.
``--time-budget`` stops starting rows that its estimate says will not finish in time, and
records them as skipped. On the CPU, memory is ``traffic.LiveBytes`` and times are a code-path
check, not a claim.
"""

from .step import MODELS, PIECES, ProxyAttention
from .sweep import run

__all__ = ["MODELS", "PIECES", "ProxyAttention", "run"]
