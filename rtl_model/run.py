"""Run one RTL bench (or lint a block) from the command line.

Examples:
  python -m rtl_model.run chm_frame_table                      # all tests, default size, Icarus
  python -m rtl_model.run chm_frame_table --size 2way --waves  # waves in the build folder
  python -m rtl_model.run chm_prefetch_engine --tests test_corners --sim verilator
  python -m rtl_model.run chm_write_admission --fault 1        # watch the lockstep check catch a fault
  python -m rtl_model.run chm_frame_table --tests test_corners --native-mutation LRU_RANK  # ... a native one
  python -m rtl_model.run chm_frame_table --lint
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rtl_model.sim import BLOCKS, REPO, lint, run_bench


def _param(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"--param {text!r}: expected NAME=INTEGER, e.g. FRAMES=32")
    return name, int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rtl_model.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("block", choices=list(BLOCKS), help="the RTL block")
    parser.add_argument("--size", help="a named parameter set (see rtl_model/sim.py BLOCKS; default: the first)")
    parser.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                        help="override one HDL parameter (repeatable)")
    parser.add_argument("--sim", choices=("icarus", "verilator"), help="simulator (default: $SIM or icarus)")
    parser.add_argument("--waves", action="store_true", help="dump waves (also WAVES=1): <build-dir>/<block>.fst (Icarus) or dump.vcd (Verilator)")
    parser.add_argument("--tests", help="regular expression over test names, e.g. test_corners")
    parser.add_argument("--fault", type=int, default=0, help="FAULT parameter: 0 none, 1 the block's injected fault")
    parser.add_argument("--native-mutation", metavar="NAME",
                        help="run the reference side on the native core built with CHM_MUTATION_NAME "
                             "(emulator/native/chm_core.h: LRU_RANK, PREFETCH_WINDOW, EXACT_FIT)")
    parser.add_argument("--build-dir", type=Path, help="build folder (default: build/rtl_model/<block>_<size>)")
    parser.add_argument("--lint", action="store_true", help="only run verilator --lint-only -Wall")
    args = parser.parse_args(argv)

    sizes = BLOCKS[args.block]
    size = args.size or next(iter(sizes))
    if size not in sizes:
        parser.error(f"--size {size!r} is not a parameter set of {args.block}; choose one of {', '.join(sizes)}")
    params = {**sizes[size], **dict(args.param)}
    if args.lint:
        done = lint(args.block, params)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        return done.returncode
    build_dir = args.build_dir or REPO / "build" / "rtl_model" / f"{args.block}_{size}"
    result = run_bench(args.block, params, build_dir, sim=args.sim, waves=args.waves, tests=args.tests,
                       fault=args.fault, native_mutation=args.native_mutation)
    for name, message in result.failures.items():
        print(f"FAIL {name}: {message.splitlines()[0] if message else ''}")
    print(f"{args.block} ({size}): {result.tests - len(result.failures)} of {result.tests} tests passed; "
          f"log {build_dir / 'sim.log'}")
    if result.cycles:
        print("cycles:", result.cycles["cycles"])
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
