"""``python -m fxq``: the command line (see :mod:`fxq.cli`)."""
import sys

from fxq.cli import main

if __name__ == "__main__":
    sys.exit(main())
