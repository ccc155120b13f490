"""HybridGen's calibration: the platform file it writes, the CXL line's fit, the command. The model against this
machine's wall clock is a bench (bench/bench_hybridgen_model.py), not a test."""

import pytest

from bench.bench_hybridgen_model import calibrated
from host_runtime.hybridgen import calibrate, cli, perfmodel

from .test_hybridgen_model import smol  # noqa: F401 -- the fixture


def test_calibrated_file_loads_as_a_platform(smol, tmp_path):  # noqa: F811
    p = perfmodel.load_platform(str(calibrated(smol[0], tmp_path / "here.toml")))
    assert p.cpu_bw > 0 and p.cpu_flops > 0 and p.has_cxl and p.element_bytes == 4
    assert p.cpu_task_overhead > 0 and p.pcie_lat > 0 and p.cxl_lat > 0 and p.cxl_request_overhead >= 0
    assert p.cxl_stage_bw >= 0


def test_the_cxl_line_separates_the_fixed_cost_from_the_cost_per_read():
    fixed, per_read, link, row, bw, staging = 200e-6, 5e-6, 50e-6, 768, 1e9, 30e-6
    runs = [{"cxl_reads": reads, "t_tx": link + staging + fixed + reads * per_read + k * row / bw}
            for reads, k in ((30, calibrate.IN_SITU_K), (10, calibrate.IN_SITU_K_FEW))]
    assert calibrate.cxl_line(*runs, link, row, bw, staging) == pytest.approx((fixed, per_read))
    runs[1]["t_tx"] = runs[0]["t_tx"] + 1e-3  # noise: fewer reads took longer; no negative cost per read
    assert calibrate.cxl_line(*runs, link, row, bw, staging)[1] == 0


def test_calibrate_command_writes_a_platform_file(smol, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr(cli, "_load", lambda: smol)
    monkeypatch.setattr(calibrate, "measure", lambda model: {
        "name": "stub", "gpu": {"memory_bandwidth_gbps": 1.0}, "cpu": {}, "link": {}, "cxl": {}, "scenario": {}})
    out = tmp_path / "p.toml"
    args = cli.build_parser_for_tests().parse_args(["calibrate", "--out", str(out)])
    assert args.func(args) == 0
    assert 'name = "stub"' in out.read_text() and "memory_bandwidth_gbps = 1" in out.read_text()
