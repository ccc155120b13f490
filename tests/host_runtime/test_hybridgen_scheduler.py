"""Algorithm 1, branch by branch, and on a sequence that grows until the CPU is the bottleneck."""

import pytest

from host_runtime.hybridgen import perfmodel as pm
from host_runtime.hybridgen.scheduler import POST, PRE, FeedbackScheduler


def test_starts_at_kmin_with_post_selection():
    s = FeedbackScheduler(k_min=16, k_max=64, k_step=8)
    assert (s.k, s.strategy) == (16, POST)


def test_increase_when_cpu_and_transfer_hide_under_gpu():
    s = FeedbackScheduler(k_min=16, k_max=64, k_step=8)
    d = s.update(t_cpu=1.0, t_tx=1.0, t_gpu=2.0)  # equality counts as hidden
    assert (d.k, d.strategy, d.branch) == (24, POST, "increase")


def test_increase_is_capped_at_kmax():
    s = FeedbackScheduler(k_min=16, k_max=20, k_step=8)
    assert s.update(0, 0, 1).k == 20
    d = s.update(0, 0, 1)
    assert (d.k, d.branch) == (20, "hold")


def test_decrease_when_cpu_is_the_bottleneck_but_never_below_kmin():
    s = FeedbackScheduler(k_min=16, k_max=64, k_step=8, k=28)
    assert s.update(3, 0, 1).branch == "decrease" and s.k == 20
    d = s.update(3, 0, 1)
    assert (d.k, d.branch, d.strategy) == (16, "decrease", POST)


def test_switch_to_pre_selection_at_kmin():
    s = FeedbackScheduler(k_min=16, k_max=64, k_step=8)
    d = s.update(t_cpu=2.0, t_tx=0.5, t_gpu=2.0)
    assert (d.k, d.strategy, d.branch) == (16, PRE, "switch")
    d = s.update(2.0, 0.5, 2.0)  # already pre-QKᵀ at K_min: nothing left to give
    assert (d.k, d.strategy, d.branch) == (16, PRE, "hold")


def test_invalid_parameters_are_named():
    with pytest.raises(ValueError, match="k_min 0"):
        FeedbackScheduler(k_min=0, k_max=4)
    with pytest.raises(ValueError, match="k_max 2"):
        FeedbackScheduler(k_min=4, k_max=2)
    with pytest.raises(ValueError, match="k_step 0"):
        FeedbackScheduler(k_min=1, k_max=2, k_step=0)


def test_growing_sequence_rises_then_falls_to_kmin_then_switches():
    """Platform-A model, Llama-3.1-8B, 1024 tokens resident, the offloaded part growing each step."""
    model, plat = pm.load_models()["llama-3.1-8b"], pm.load_platform("A")
    trace = [d for _, d in pm.scheduler_trace(model, plat, resident=1024, start=256, growth=64, steps=120,
                                              k_min=64, k_max=2048, k_step=32)]
    branches = [d.branch for d in trace]
    first_dec, switch = branches.index("decrease"), branches.index("switch")
    peak = max(d.k for d in trace[:first_dec])
    assert branches[0] == "increase" and peak > 64            # K rises while the CPU is hidden
    assert first_dec < switch                                   # then falls ...
    assert trace[switch - 1].k == 64 and trace[switch].k == 64  # ... to K_min
    assert all(d.strategy == POST for d in trace[:switch])      # and only then pre-QKᵀ
    assert all(d.strategy == PRE for d in trace[switch:])
