"""``python -m ulysses_kernels.bench.attention``: the command line is ``cli.main``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m ulysses_kernels.bench.attention"))
