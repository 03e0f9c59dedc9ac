"""``python -m lightning_dp ...`` is ``lightning-dp ...``."""

import sys

from lightning_dp.cli import main

if __name__ == "__main__":
    sys.exit(main())
