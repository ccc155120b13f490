"""Helpers every layer shares: argument and config checks (one wording for every error), the ``chm`` CLI's
argparse pieces, byte units and durable directory updates. This package imports nothing of the project's: it
sits below ``driver/`` and every layer above may use it."""
