"""``python -m shardsafe``: the ``shardsafe`` command (see docs/cli.md)."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
