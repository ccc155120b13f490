"""chm hybridgen eval at the paper's settings: deterministic rows, the pinned accuracy row, the scheduled row."""

import json

import pytest

from emulator.cli import UsageError
from host_runtime.hybridgen import cli
from host_runtime.hybridgen.engine import EngineOptions
from host_runtime.hybridgen.evaluate import TIMING_FIELDS, EvalSettings, paper_k_min_ratio, row_options

from .test_hybridgen_model import load_smol, smol  # noqa: F401 -- the fixture and its loader


@pytest.fixture
def loaded(smol, monkeypatch):  # noqa: F811
    monkeypatch.setattr(cli, "_load", load_smol)
    return smol


def run_eval(capsys, *extra):
    args = cli.build_parser_for_tests().parse_args(["eval", "--json", *extra])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_k_is_the_papers_k_min_ratio_of_the_context():
    assert paper_k_min_ratio() == 128 / 2048
    assert EvalSettings(context_tokens=1024).k == 64 and EvalSettings(context_tokens=2048).k == 128
    assert EvalSettings(context_tokens=1024, budget_ratio=0.25).k == 256
    assert EvalSettings(context_tokens=1024, k_min=10).k == 10


def test_rows_pin_what_they_say():
    base, settings = EngineOptions(resident_budget=32), EvalSettings(context_tokens=1024)
    acc = row_options("hybridgen", base, settings)
    assert (acc.method, acc.strategy, acc.k_min, acc.k_max, acc.layer_ahead) == ("hybridgen", "post", 64, 64, False)
    sched = row_options("hybridgen-scheduled", base, settings)
    assert (sched.strategy, sched.timing, sched.k_min) == ("auto", "model", 64)
    assert row_options("streamingllm", base, settings).window == 64 + 32 - base.sinks  # the same budget
    with pytest.raises(ValueError, match="row='nope'"):
        row_options("nope", base, settings)


def test_two_runs_give_identical_rows(loaded, capsys):
    """Seeds, one thread and no branch taken from wall-clock timing: only the timing field may differ."""
    extra = ["--methods", "full,hybridgen,hybridgen-scheduled,keyformer,infinigen", "--context-tokens", "160",
             "--scored-tokens", "12", "--passkey-tokens", "96", "--passkey-depths", "0.5", "--resident-budget", "8",
             "--k-min", "10", "--k-max", "64", "--k-step", "8"]
    runs = [run_eval(capsys, *extra) for _ in range(2)]
    strip = [[{k: v for k, v in row.items() if k not in TIMING_FIELDS} for row in rows] for rows in runs]
    assert strip[0] == strip[1]
    rows = {r["method"]: r for r in runs[0]}
    assert rows["hybridgen"]["post_qkt_fraction"] == 1.0 and rows["hybridgen"]["k_range"] == [10, 10]
    sched = rows["hybridgen-scheduled"]
    assert 0 <= sched["post_qkt_fraction"] <= 1 and sched["k_range"][0] >= 10 and sched["k_range"][1] <= 64


def test_accuracy_row_at_the_papers_ratio_is_within_5_percent_of_full(loaded, capsys):
    """1K-token context, K = 6.25 % of it (64) plus 32 resident tokens, post-QKᵀ pinned."""
    rows = {r["method"]: r for r in run_eval(capsys, "--methods", "full,hybridgen", "--context-tokens", "1024",
                                             "--scored-tokens", "64", "--passkey-tokens", "64",
                                             "--passkey-depths", "0.5")}
    hg = rows["hybridgen"]
    assert hg["post_qkt_fraction"] == 1.0 and hg["k_range"] == [64, 64] < [hg["offloaded"]] * 2
    assert hg["perplexity"] <= 1.05 * rows["full"]["perplexity"], rows


def test_eval_rejects_bad_budgets():
    parse = cli.build_parser_for_tests().parse_args
    with pytest.raises(UsageError, match=r"--budget-ratio: 0 must be in \(0, 1\]"):
        parse(["eval", "--budget-ratio", "0"])
    with pytest.raises(UsageError, match="not allowed with argument"):
        parse(["eval", "--budget-ratio", "0.1", "--k-min", "5"])
    with pytest.raises(UsageError, match="--methods: .*nope.*allowed: .*hybridgen-scheduled"):
        parse(["eval", "--methods", "full,nope"])
