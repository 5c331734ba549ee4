"""The benchmarks, runnable from any directory once the package is installed:

    torchrun --nproc-per-node 8 -m ulysses_kernels.bench.alltoall -b 1K -e 1G -f 2
    python -m ulysses_kernels.bench.<name> --spawn 2 ...      # gloo ranks on the CPU

Modules: ``alltoall`` (all-to-all bandwidth, nccl-tests style), ``attention`` (the layer
against the compute floor, the permute chain and peers), ``overlap`` (the chunked
pipeline), ``pack`` (pack/unpack against a copy), ``perf_model`` (the model of
docs/performance.md), ``summary`` (a few lines for a first run). What they share:
``harness`` (``Skip``, the shared flags, ``launch`` on torchrun or spawned gloo ranks,
``finish``, ``Progress``), ``timing`` (``time_iters``, medians, spreads, reductions over the
ranks), ``record`` (the environment record, the table, the result files, plot labels),
``patterns`` (data with a known answer, bit-exact counts) and ``sizes`` (``-b -e -f`` sizes,
dtypes, head sets). Each has ``main(argv=None)``; results go to
``--out-dir`` (default ``./bench_results``). In a checkout, ``bench/bench_<name>.py`` runs
the same ``main`` with results in ``bench/results/`` (see ``bench/README.md``).
"""
