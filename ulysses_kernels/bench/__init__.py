"""Helpers shared by the scripts under ``bench/`` (see ``bench/README.md``).

``ulysses_kernels.bench.common`` holds the environment record, size parsing, timing,
the nccl-tests style table and the CSV/JSON/PNG writers; the scripts themselves live in
``bench/`` at the repository root and import from here.
"""
