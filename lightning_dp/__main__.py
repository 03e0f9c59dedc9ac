"""``python -m lightning_dp ...`` is ``lightning-dp ...``."""

import sys

from lightning_dp.cli import main

if __name__ == "__main__":
    sys.argv[0] = "lightning-dp"  # usage and error lines name the command, not __main__.py
    sys.exit(main())
