"""``python -m emulator.serve ...``: ``chm serve`` without loading every other subcommand."""

import sys

from .cli import main

sys.exit(main())
