"""`python -m ulysses_kernels.bench.perf_model` from the checkout (see bench/README.md)."""

import sys

from ulysses_kernels.bench.perf_model import main

if __name__ == "__main__":
    sys.exit(main())
