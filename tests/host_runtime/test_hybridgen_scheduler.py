"""Algorithm 1 as a runtime controller: branch by branch, warm-up, dead band, smoothing, and both switches."""

import random

import pytest

from host_runtime.hybridgen import perfmodel as pm
from host_runtime.hybridgen.scheduler import POST, PRE, FeedbackScheduler


def plain(**kw):
    """No warm-up, no smoothing, no dead band: the paper's rule as written, one step at a time."""
    return FeedbackScheduler(**{"k_min": 16, "k_max": 64, "k_step": 8, "warmup_steps": 0, "smoothing": 1.0,
                                "hysteresis": 0.0, **kw})


def test_starts_at_kmin_with_post_selection():
    s = FeedbackScheduler(k_min=16, k_max=64, k_step=8)
    assert (s.k, s.strategy) == (16, POST)


def test_increase_when_cpu_and_transfer_hide_under_gpu():
    d = plain().update(t_cpu=1.0, t_tx=1.0, t_gpu=2.0)  # without a dead band equality counts as hidden
    assert (d.k, d.strategy, d.branch) == (24, POST, "increase")


def test_increase_is_capped_at_kmax():
    s = plain(k_max=20)
    assert s.update(0, 0, 1).k == 20
    d = s.update(0, 0, 1)
    assert (d.k, d.branch) == (20, "hold")


def test_decrease_when_cpu_is_the_bottleneck_but_never_below_kmin():
    s = plain(k=28)
    assert s.update(3, 0, 1).branch == "decrease" and s.k == 20
    d = s.update(3, 0, 1)
    assert (d.k, d.branch, d.strategy) == (16, "decrease", POST)


def test_switch_to_pre_selection_at_kmin():
    s = plain()
    d = s.update(t_cpu=2.0, t_tx=0.5, t_gpu=2.0)
    assert (d.k, d.strategy, d.branch) == (16, PRE, "switch-to-pre")
    d = s.update(2.0, 0.5, 2.0)  # pre-QKᵀ at K_min and no scan rate learnt: nothing left to give
    assert (d.k, d.strategy, d.branch) == (16, PRE, "hold")


def test_warmup_step_steers_nothing():
    """The cold first step (the issue's 45 ms against 44.5 ms) must not send the scheduler to pre-QKᵀ."""
    s = FeedbackScheduler(k_min=16, k_max=64, k_step=8, warmup_steps=1)
    assert s.update(t_cpu=16.1, t_tx=28.9, t_gpu=44.5).branch == "warmup"
    assert (s.k, s.strategy) == (16, POST)
    assert s.update(t_cpu=3.0, t_tx=2.0, t_gpu=44.5).branch == "increase"


def test_dead_band_holds():
    s = FeedbackScheduler(k_min=16, k_max=64, k_step=8, k=32, warmup_steps=0, smoothing=1.0, hysteresis=0.1)
    assert s.update(9.5, 0.0, 10.0).branch == "hold"      # inside (0.9, 1.0] of T_gpu: neither up nor down
    assert s.update(8.9, 0.0, 10.0).branch == "increase"
    assert s.update(10.1, 0.0, 10.0).branch == "decrease"


def test_one_slow_step_is_smoothed_away():
    s = FeedbackScheduler(k_min=16, k_max=64, k_step=8, warmup_steps=0, smoothing=0.25, hysteresis=0.1)
    for _ in range(5):
        s.update(2.0, 1.0, 10.0)
    k = s.k
    assert s.update(20.0, 1.0, 10.0).branch != "switch-to-pre"  # smoothed: 0.25*21 + 0.75*3 < 10
    assert s.strategy == POST and s.k == k + 8


def test_switch_back_to_post_uses_the_learnt_scan_rate():
    s = plain(hysteresis=0.1)
    s.update(t_cpu=10.0, t_tx=1.0, t_gpu=10.0, scan_bytes=1000.0)  # post at K_min, over: 100 bytes/s learnt
    assert s.strategy == PRE
    # 900 bytes would take 9 s to scan: 9 + 1 > 0.9 * 10, stay pre-QKᵀ (and grow K: pre is cheap)
    assert s.update(t_cpu=0.5, t_tx=1.0, t_gpu=10.0, scan_bytes=900.0).branch == "increase"
    # 700 bytes: 7 + 1 <= 9, back to post-QKᵀ
    d = s.update(t_cpu=0.5, t_tx=1.0, t_gpu=10.0, scan_bytes=700.0)
    assert (d.strategy, d.branch) == (POST, "switch-to-post")


def test_synthetic_trace_crosses_the_threshold_both_ways_without_chattering():
    """A batch whose offloaded K grows (sequences get longer) and then shrinks (sequences finish).

    The simulated machine: the GPU takes 10 ms; a post-QKᵀ step scans every offloaded
    K byte at 1 GB/s; a pre-QKᵀ step touches K rows only; the transfer moves K rows.
    Times carry ±5 % noise. The scheduler leaves post-QKᵀ once the scan outgrows the
    GPU, comes back once it fits again, and switches exactly twice.
    """
    rng = random.Random(7)
    row_bytes, gpu, rate = 1024, 10e-3, 1e9
    offloaded = list(range(1000, 14000, 200)) + list(range(14000, 1000, -200))
    s = FeedbackScheduler(k_min=32, k_max=512, k_step=32)
    noisy = lambda t: t * rng.uniform(0.95, 1.05)  # noqa: E731
    trace = []
    for n in offloaded:
        scan = n * row_bytes
        k = min(s.k, n)
        t_cpu = noisy(scan / rate if s.strategy == POST else k * row_bytes / rate + 50e-6)
        t_tx = noisy(k * row_bytes / 25e9 + 10e-6)
        trace.append((n, s.strategy, s.update(t_cpu, t_tx, noisy(gpu), scan_bytes=scan)))
    branches = [d.branch for _, _, d in trace]
    assert branches.count("switch-to-pre") == 1 and branches.count("switch-to-post") == 1
    to_pre, to_post = branches.index("switch-to-pre"), branches.index("switch-to-post")
    assert to_pre < to_post
    # left post-QKᵀ only once a full scan exceeded the GPU's 10 ms (10 MB at 1 GB/s) ...
    assert offloaded[to_pre] * row_bytes > 0.95 * gpu * rate
    # ... and came back only once it fitted under the dead band again (0.9 x 10 ms, less the transfer)
    assert offloaded[to_post] * row_bytes < 0.9 * 1.05 * gpu * rate
    assert offloaded[to_post] < offloaded[to_pre]
    assert all(strategy == POST for _, strategy, _ in trace[:to_pre + 1])
    assert all(strategy == PRE for _, strategy, _ in trace[to_pre + 1:to_post + 1])
    assert all(strategy == POST for _, strategy, _ in trace[to_post + 1:])


def test_invalid_parameters_are_named():
    with pytest.raises(ValueError, match="k_min=0"):
        FeedbackScheduler(k_min=0, k_max=4)
    with pytest.raises(ValueError, match="k_max=2"):
        FeedbackScheduler(k_min=4, k_max=2)
    with pytest.raises(ValueError, match="k_step=0"):
        FeedbackScheduler(k_min=1, k_max=2, k_step=0)
    with pytest.raises(ValueError, match=r"smoothing=0 .*\(0, 1\]"):
        FeedbackScheduler(k_min=1, k_max=2, smoothing=0)
    with pytest.raises(ValueError, match=r"hysteresis=1 .*\[0, 1\)"):
        FeedbackScheduler(k_min=1, k_max=2, hysteresis=1)
    with pytest.raises(ValueError, match="t_gpu=-1"):
        FeedbackScheduler(k_min=1, k_max=2).update(0, 0, -1)


def test_growing_sequence_rises_then_falls_to_kmin_then_switches():
    """Platform-A model, Llama-3.1-8B, 1024 tokens resident, the offloaded part growing each step."""
    model, plat = pm.load_models()["llama-3.1-8b"], pm.load_platform("A")
    trace = [d for _, d in pm.scheduler_trace(model, plat, resident=1024, start=256, growth=64, steps=120,
                                              k_min=64, k_max=2048, k_step=32)]
    branches = [d.branch for d in trace]
    first_dec, switch = branches.index("decrease"), branches.index("switch-to-pre")
    peak = max(d.k for d in trace[:first_dec])
    assert "increase" in branches[:first_dec] and peak > 64     # K rises while the CPU is hidden
    assert first_dec < switch                                   # then falls ...
    assert trace[switch - 1].k == 64 and trace[switch].k == 64  # ... to K_min
    assert all(d.strategy == POST for d in trace[:switch])      # and only then pre-QKᵀ
    assert all(d.strategy == PRE for d in trace[switch:])
