"""The attention layer's benchmark: forward, backward and forward+backward time, TFLOP/s and
peak memory of ``ulysses_attention`` against the compute floor, the permute chain and peers.

    python -m ulysses_kernels.bench.attention --help   # the methods, the columns, the flags

The pieces, one job each: ``methods`` (what each ``--methods`` name runs: ``Method``,
``build_method``, ``method_names``), ``inputs`` (the random inputs any rank rebuilds, the
documents of the packed rows, the sequence lengths), ``check`` (every row against a float32
reference on sampled rows; layout rows bit for bit), ``run`` (the sweep: build, time, check,
rows), ``report`` (the tables, the ratios, the breakdown and its chart) and ``cli`` (the
command line; its docstring is the ``--help`` text).
"""

from .check import TOLERANCE, check_method, count_method_wrong, count_wrong, reference_rows, sample_rows
from .cli import main, parse_args
from .inputs import Inputs, equal_documents, make_inputs, packed_documents, seq_lengths
from .methods import (
    COMM_METHODS,
    Method,
    Skip,
    build_method,
    chain_layout_method,
    layout_method,
    local_method,
    method_names,
    packed_hybrid_method,
    packed_method,
    peer_method,
)
from .report import plot, print_header, report
from .run import Group, hybrid_groups, make_group, run_bench, run_group, run_method, time_method

__all__ = [
    "COMM_METHODS",
    "TOLERANCE",
    "Group",
    "Inputs",
    "Method",
    "Skip",
    "build_method",
    "chain_layout_method",
    "check_method",
    "count_method_wrong",
    "count_wrong",
    "equal_documents",
    "hybrid_groups",
    "layout_method",
    "local_method",
    "main",
    "make_group",
    "make_inputs",
    "method_names",
    "packed_documents",
    "packed_hybrid_method",
    "packed_method",
    "parse_args",
    "peer_method",
    "plot",
    "print_header",
    "reference_rows",
    "report",
    "run_bench",
    "run_group",
    "run_method",
    "sample_rows",
    "seq_lengths",
    "time_method",
]
