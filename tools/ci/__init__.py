"""CI gates that `make test` runs before the suite: ``cwarn`` (the hand-written C compiles without a warning)
and ``sanitize`` (libchm, the server loop and the native core under ASan and UBSan). Ruff, the third gate,
runs straight from the Makefile (ruff.toml)."""
