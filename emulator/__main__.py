"""``python -m emulator`` is ``chm``."""

import sys

from .cli import main

sys.exit(main())
