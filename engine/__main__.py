"""python -m engine [serve] [flags] | config show [flags] | admin COMMAND [ARGS]."""

from __future__ import annotations

import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
