"""``python -m ulysses_kernels.selftest`` (and ``torchrun ... -m ulysses_kernels.selftest``):
the self-test's command line, ``cli.main``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
