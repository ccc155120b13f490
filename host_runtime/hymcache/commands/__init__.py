"""The ``chm hymcache`` subcommands' bodies, one module per command (cli.py holds the parsers)."""
