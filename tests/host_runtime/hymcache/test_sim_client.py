"""``chm hymcache simulate``: the two clients (turn-barrier, AIPerf's per-session) and the HyMCache load path's
pipelining (the KV Manager's window staging several blocks while earlier ones are read), on small settings.

Each rule can fail: a conversation's turn k + 1 starts only after its turn k has finished (and the turn
delay), sessions do not wait for each other, the turn-barrier client does; with a window of W blocks, W
blocks stage on the device at once, and the device stages later blocks while the worker reads earlier ones.
"""

import pytest

from host_runtime.hymcache.sim.config import load_settings, preset_path
from host_runtime.hymcache.sim.events import Env
from host_runtime.hymcache.sim.run import device_config, simulate_tier
from host_runtime.hymcache.sim.tiers import HyMCacheTier, Host
from host_runtime.hymcache.sim.worker import Request, client, session_client
from host_runtime.hymcache.sim.workload import Turn

MiB, GiB = 1 << 20, 1 << 30
B_TOKENS = 128
BLOCK = 16 * MiB


class FakeWorker:
    """Serves a request in ``service[conversation]`` ns; records (conversation, turn, arrival, finish)."""

    def __init__(self, env: Env, service: dict[int, float]):
        self.env, self.service, self.log = env, service, []

    def submit(self, req: Request) -> None:
        req.arrival = self.env.now

        def done():
            req.finish = self.env.now
            self.log.append((req.conv, req.turn, req.arrival, req.finish))
            req.done.succeed(req)

        self.env.call_at(self.env.now + self.service[req.conv], done)


def turns_of(convs: int, turns: int) -> list[list[Turn]]:
    return [[Turn(c, t, t * 300, (t - 1) * 300) for c in range(convs)] for t in range(1, turns + 1)]


def drive(kind: str, service: dict[int, float], convs: int, turns: int, concurrency: int, delay_ns: float = 0.0):
    env = Env()
    w = FakeWorker(env, service)
    started = []
    kwargs = dict(concurrency=concurrency, tokens_per_block=B_TOKENS, max_tokens=1,
                  on_turn_start=lambda t, now: started.append((t, now)), on_done=lambda r: None)
    if kind == "per-session":
        gen = session_client(env, turns_of(convs, turns), w, turn_delay_ns=delay_ns, **kwargs)
    else:
        gen = client(env, turns_of(convs, turns), w, **kwargs)
    p = env.process(gen)
    env.run()
    assert p.done.fired
    return {(c, t): (a, f) for c, t, a, f in w.log}, started


# ---------------------------------------------------------------------------- the per-session client
def test_a_sessions_next_turn_waits_for_its_previous_turn_and_the_delay():
    log, started = drive("per-session", {0: 10.0, 1: 3.0}, convs=2, turns=3, concurrency=2, delay_ns=2.0)
    assert len(log) == 6
    for c in (0, 1):
        for t in (2, 3):
            assert log[(c, t)][0] == log[(c, t - 1)][1] + 2.0  # sent the turn delay after the previous answer
    assert [t for t, _ in started] == [1, 2, 3]  # a row per turn index, in order


def test_sessions_do_not_wait_for_each_other():
    # conversation 0 is slow (100 ns a turn), conversation 1 fast (1 ns): per-session, conversation 1 runs all
    # its turns while conversation 0's first turn is still in service; the turn barrier holds it back instead
    log, _ = drive("per-session", {0: 100.0, 1: 1.0}, convs=2, turns=3, concurrency=2)
    assert log[(1, 3)][1] == 3.0 < log[(0, 1)][1] == 100.0
    barrier, _ = drive("turn-barrier", {0: 100.0, 1: 1.0}, convs=2, turns=3, concurrency=2)
    assert barrier[(1, 2)][0] == barrier[(0, 1)][1] == 100.0  # turn 2 starts once every turn 1 is done


def test_a_finished_session_takes_the_next_conversation_and_concurrency_bounds_sessions():
    log, _ = drive("per-session", {0: 5.0, 1: 1.0, 2: 1.0}, convs=3, turns=2, concurrency=2)
    # sessions: conversation 0 (turns at 0 and 5) and 1 (at 0 and 1); conversation 2 starts when 1 ends, at 2
    assert log[(2, 1)][0] == log[(1, 2)][1] == 2.0
    in_flight = max(sum(1 for a, f in log.values() if a <= t < f) for t in range(12))
    assert in_flight == 2


def test_per_session_end_to_end_reports_a_row_per_turn_index():
    s = load_settings(preset_path(10))
    assert s["workload.client"] == "per-session" and load_settings(preset_path(13))["workload.client"] == \
        "turn-barrier"
    s.update({"workload.conversations": 6, "workload.turns": 3, "workload.concurrency": 2,
              "workload.max_tokens": 4, "workload.input_tokens": 300.0, "topology.prefill_workers": 2,
              "tiers.dram": 1 * GiB, "gpu.gpu_memory_utilization": 0.79})
    out = simulate_tier("hymcache", s)
    assert [r["turn"] for r in out["rows"]] == [1, 2, 3]
    assert all(r["requests"] == 6 for r in out["rows"])
    assert out["rows"][2]["reuse_rate"] == pytest.approx(1.0)  # GPU hits + remote loads: every prefix reused
    barrier = simulate_tier("hymcache", {**s, "workload.client": "turn-barrier"})
    assert [r["requests"] for r in barrier["rows"]] == [6, 6, 6]
    # per-session, later conversations' first turns run while early ones are in turn 3: turn 1's span overlaps
    # turn 3's (under the barrier they are disjoint)
    r1, r3 = out["rows"][0], out["rows"][2]
    assert r1["turn_s"] > 0 and out["summary"]["makespan_s"] < r1["turn_s"] + r3["turn_s"] + out["rows"][1]["turn_s"]
    b = barrier["rows"]
    assert barrier["summary"]["makespan_s"] == pytest.approx(sum(r["turn_s"] for r in b), rel=1e-9)


# ---------------------------------------------------------------------------- HyMCache: the load pipeline
def _tier(env: Env, window_bytes: int) -> HyMCacheTier:
    cfg = device_config("paper", 1 * GiB, "hymcache")
    return HyMCacheTier(env, Host(env, 25.0, 10_000.0, 1 * GiB), BLOCK, cfg, window_bytes=window_bytes,
                        timeout_s=10.0)


def _request(env, turn, blocks, prev=0):
    return Request(Turn(0, turn, blocks * B_TOKENS + 1, prev * B_TOKENS + 1 if prev else 0), B_TOKENS, 1, env.event())


def _run(env, gen):
    p = env.process(gen)
    env.run()
    return p.done.value


def _pause(env, ns):
    yield env.now + ns


def _load_trace(window_bytes: int, n: int = 16):
    """Store n blocks, let them flush to the SSDs, then load them: each block's staging interval (prefetch
    issued -> staged) and read interval (read issued -> in the staging buffer)."""
    env = Env()
    tier = _tier(env, window_bytes)
    r1 = _request(env, 1, n)
    tier.reserve_store(r1)
    _run(env, tier.store(r1))
    _run(env, _pause(env, 1e9))
    ctl = tier.ctl
    issued, staged, reads = {}, {}, []
    prefetch, read = ctl.prefetch, ctl.read

    def traced_prefetch(addr, size, now):
        got = prefetch(addr, size, now)
        issued[got.handle] = now
        staged[got.handle] = ctl.staged[got.handle].ready_at
        return got

    def traced_read(addr, length, now, *a, **kw):
        done = read(addr, length, now, *a, **kw)
        reads.append((now, done.finish))
        return done

    ctl.prefetch, ctl.read = traced_prefetch, traced_read
    r2 = _request(env, 2, n, prev=n)
    assert tier.lookup(r2) == n
    in_flight_after_hint = len(ctl.staged)
    t0 = env.now
    assert _run(env, tier.load(r2, n)) == n
    assert tier.ctl.snapshot()["prefetch_staged_pages"] > 0  # from the SSDs, not DRAM-resident
    stages = [(issued[h], staged[h]) for h in sorted(issued)]
    return in_flight_after_hint, stages, reads, env.now - t0


def _max_overlap(spans) -> int:
    points = sorted([(a, 1) for a, b in spans] + [(b, -1) for a, b in spans], key=lambda p: (p[0], p[1]))
    best = cur = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best


def test_a_window_of_w_blocks_stages_w_blocks_at_once():
    in_flight, stages, _, _ = _load_trace(128 * MiB)  # 128 MiB / 16 MiB = 8 blocks
    assert in_flight == 8  # the hint issues the whole window before the first read
    assert _max_overlap(stages) == 8
    narrow, stages2, _, _ = _load_trace(2 * BLOCK)
    assert narrow == 2 and _max_overlap(stages2) == 2  # the window bounds it (the Manager's minimum, 2)


def test_later_blocks_stage_while_earlier_ones_are_read():
    _, stages, reads, load_ns = _load_trace(128 * MiB)
    assert len(reads) == 16
    # while block i is read over the host link, some later block is staging on the device
    overlapped = sum(1 for a, b in reads if any(s < b and e > a for s, e in stages[1:]))
    assert overlapped >= 8
    # and the load takes less than staging then reading each block in turn
    serial = sum(e - s for s, e in stages) + sum(b - a for a, b in reads)
    assert load_ns < 0.75 * serial
