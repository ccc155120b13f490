"""``make bench``: run every ``bench/bench_*.py`` (or those named) in turn.

Each module has ``main(argv) -> int`` and prints its figures side by side
with the peer or physical limit it is compared against.
"""

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> int:
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name.startswith("bench_"))
    parser = argparse.ArgumentParser(prog="python -m bench", description="Run the benchmarks.")
    parser.add_argument("only", nargs="*", help=f"benchmarks to run (default: all): {', '.join(names)}")
    args = parser.parse_args()
    unknown = [n for n in args.only if n not in names]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(names)}")
    status = 0
    for name in args.only or names:
        print(f"== {name} ==", flush=True)
        status |= importlib.import_module(f"bench.{name}").main([]) or 0
    return status


if __name__ == "__main__":
    sys.exit(main())
