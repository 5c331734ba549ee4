"""`python -m ulysses_kernels.bench.host` from the checkout, results in bench/results/ (see bench/README.md)."""

import sys
from pathlib import Path

from ulysses_kernels.bench.host import main

if __name__ == "__main__":
    sys.exit(main(default_out_dir=Path(__file__).resolve().parent / "results"))
