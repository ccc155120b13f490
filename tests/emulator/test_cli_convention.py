"""One error convention for every `chm` subcommand, applied in one place (emulator.cli.run):
`chm CMD: error: ...` on stderr; exit 2 for usage errors (after the usage line), 1 for runtime errors,
a traceback only for a bug."""

import argparse
import errno
import os
import subprocess
from pathlib import Path

import pytest

from emulator.cli import ChmArgumentParser, UsageError, build_parser, run

CHM = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "chm"
NO_NODE = f"chm-convention-absent-{os.getpid()}"


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "bad.toml").write_text("x = [\n")
    (d / "truncated.jsonl").write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1, "hash_')
    return d


# per subcommand: a usage error (exit 2) and a bad runtime input (exit 1); {d} is the folder of bad files
CASES = {
    "info": (["--profile"], ["--profile", "{d}/bad.toml"]),
    "demo": (["--objects", "0"], ["--objects", "2", "--media-dir", "{d}/no/such/dir"]),
    "serve": (["--policy", "nonesuch"], ["--profile", "{d}/bad.toml", "--node", NO_NODE]),
    "stats": ([NO_NODE, "extra"], [NO_NODE]),
    "replay": (["microbench", "--turns", "0"], ["{d}/truncated.jsonl", "--no-progress"]),
    "hybridgen": (["model-perf", "--kv-ratio", "2"], ["model-perf", "--platform", "{d}/bad.toml"]),
    "hymcache": (["up", "--nodes", "0"], ["manager", "--master", "tcp://127.0.0.1:1", "--node", "0", "--device", NO_NODE]),
}


def chm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHM), *args], capture_output=True, text=True, timeout=120)


def test_every_subcommand_has_a_case():
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(CASES)


@pytest.mark.parametrize("command", sorted(CASES))
def test_help(command):
    result = chm(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: chm {command} ") and result.stderr == ""


@pytest.mark.parametrize("command", sorted(CASES))
def test_usage_error_exits_2_after_the_usage_line(command, bad_files):
    result = chm(command, *(a.format(d=bad_files) for a in CASES[command][0]))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"usage: chm {command} ")
    assert lines[-1].startswith(f"chm {command}") and ": error: " in lines[-1], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", sorted(CASES))
def test_bad_runtime_input_exits_1_with_one_error_line(command, bad_files):
    result = chm(command, *(a.format(d=bad_files) for a in CASES[command][1]))
    assert result.returncode == 1, (result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(f"chm {command}"), result.stderr
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr


def test_hybridgen_errors_name_the_nested_subcommand(bad_files):
    result = chm("hybridgen", "model-perf", "--platform", "nowhere")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith("chm hybridgen model-perf: error: --platform 'nowhere'")


# ---- run() itself, with a subcommand added the way a future component would add one ----------
def _parser_with(func) -> argparse.ArgumentParser:
    parser = ChmArgumentParser(prog="chm")
    p = parser.add_subparsers(dest="command").add_parser("future")
    p.add_argument("--n", type=int, default=1)
    p.set_defaults(func=func)
    return parser


def _raise(exc):
    def func(args):
        raise exc
    return func


@pytest.mark.parametrize("exc, code, message", [
    (UsageError("--n and --m do not go together"), 2, "chm future: error: --n and --m do not go together"),
    (ValueError("trace x.jsonl:3: bad record"), 1, "chm future: error: trace x.jsonl:3: bad record"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/file"), 1,
     "chm future: error: /no/file: No such file or directory"),
    (PermissionError(errno.EACCES, "Permission denied", "/etc/shadow"), 1,
     "chm future: error: /etc/shadow: Permission denied"),
])
def test_run_turns_a_subcommand_error_into_the_convention(exc, code, message, capsys):
    assert run(_parser_with(_raise(exc)), ["future"]) == code
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == message
    assert err.startswith("usage: chm future") == (code == 2)


def test_argparse_errors_come_back_as_exit_2_not_sys_exit(capsys):
    assert run(_parser_with(lambda args: 0), ["future", "--n", "x"]) == 2
    assert run(_parser_with(lambda args: 0), ["future", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "chm future: error: argument --n: invalid int value: 'x'" in err
    assert "chm future: error: unrecognized arguments: --bogus" in err


def test_a_bug_keeps_its_traceback():
    with pytest.raises(ZeroDivisionError):
        run(_parser_with(lambda args: 1 / 0), ["future"])
