"""The native core (emulator/native/*.c) decides as the Python implementations it replaced
(reference_models.py): random operation sequences, pins included, drive both and every answer and the
whole frame state are compared after each step. Also: the batch entry points against the per-access
calls, the plug-in path, the op table of a policy on its own, the prefetch engine, write admission, and
the C core under AddressSanitizer/UBSan."""

from __future__ import annotations

import errno
import random
import shutil
import subprocess
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import require_oracle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emulator import native, native_build
from emulator.errors import ChmError
from emulator.frame_table import FrameTable, LruOrder
from emulator.policies.clock import ClockOrder
from emulator.policies.fifo import FifoOrder
from emulator.policies.s3fifo import S3FifoOrder
from emulator.policies.sieve import SieveOrder
from emulator.prefetch import PrefetchEngine
from emulator.write_buffer import WriteAdmission

from . import reference_models as model

S3FIFO = SimpleNamespace(small_size_ratio=0.1, ghost_size_ratio=0.9, move_to_main_threshold=2)
POLICIES = {  # name: (native class, Python model class, params)
    "lru": (LruOrder, model.LruOrder, None),
    "fifo": (FifoOrder, model.FifoOrder, None),
    "clock": (ClockOrder, model.ClockOrder, SimpleNamespace(n_bit_counter=1)),
    "clock-3bit": (ClockOrder, model.ClockOrder, SimpleNamespace(n_bit_counter=3)),
    "sieve": (SieveOrder, model.SieveOrder, None),
    "s3fifo": (S3FifoOrder, model.S3FifoOrder, S3FIFO),
    "s3fifo-tuned": (S3FifoOrder, model.S3FifoOrder,
                     SimpleNamespace(small_size_ratio=0.3, ghost_size_ratio=2.0, move_to_main_threshold=1)),
    "s3fifo-no-ghost": (S3FifoOrder, model.S3FifoOrder,
                        SimpleNamespace(small_size_ratio=0.25, ghost_size_ratio=0.0, move_to_main_threshold=3)),
}
GEOMETRIES = [(8, 8), (16, 4), (8, 2), (20, 20), (24, 8), (1, 1)]  # (frames, ways)
FRAME_OPS = ("access", "access", "access", "lookup", "victim", "touch", "invalidate", "pin", "pin", "unpin",
             "unpin", "mark_dirty", "clear_dirty")
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def step(t, op: str, page: int, frame: int):
    """One operation, legal in the state both tables share (as the controller and the RTL bench use them)."""
    if op == "access":  # the device's way: lookup, touch on a hit, insert on a miss
        found = t.lookup(page)
        if found is not None:
            t.touch(found)
            return "hit", found
        return "miss", t.insert(page)
    if op == "lookup":
        return t.lookup(page)
    if op == "victim":
        return t.victim(page)
    if op == "pin":
        return t.pin(frame)  # an empty frame too: its next page arrives pinned
    if op == "mark_dirty":
        return t.mark_dirty(frame)
    if op == "clear_dirty":
        return t.clear_dirty(frame)
    resident, pins = t.page_of[frame] is not None, t.pins[frame]
    if op == "touch" and resident:
        return t.touch(frame)
    if op == "invalidate" and resident and not pins:
        return t.invalidate(frame)
    if op == "unpin" and pins:
        return t.unpin(frame)
    return "skipped"


def frame_state(t) -> tuple:
    return list(t.page_of), bytes(t.dirty), list(t.pins), len(t)


@st.composite
def frame_runs(draw):
    name = draw(st.sampled_from(sorted(POLICIES)))
    frames, ways = draw(st.sampled_from(GEOMETRIES))
    ops = draw(st.lists(st.tuples(st.sampled_from(FRAME_OPS), st.integers(0, 3 * frames),
                                  st.integers(0, frames - 1)), min_size=100, max_size=300))
    return name, frames, ways, ops


def run_against_model(table: FrameTable, name: str, frames: int, ways: int, ops) -> list:
    """Drive ``table`` and the Python model with ``ops``; every answer and the state after each must agree.
    Returns the answers."""
    _, model_cls, params = POLICIES[name]
    reference = model.FrameTableModel(frames, ways, eviction=lambda capacity: model_cls(capacity, params))
    answers = []
    for i, (op, page, frame) in enumerate(ops):
        where = f"{name}, {frames} frames of {ways} ways, step {i}: {op} page={page} frame={frame}"
        answer = step(table, op, page, frame)
        assert answer == step(reference, op, page, frame), where
        assert frame_state(table) == frame_state(reference), where
        table.check()
        answers.append((op, answer))
    return answers


@PROPERTY
@given(frame_runs())
def test_the_native_frame_table_decides_as_the_python_model(run):
    name, frames, ways, ops = run
    native_cls, _, params = POLICIES[name]
    table = FrameTable(frames, ways, eviction=lambda capacity: native_cls(capacity, params))
    assert not table.plugin  # the built-ins run in C
    run_against_model(table, name, frames, ways, ops)


@PROPERTY
@given(frame_runs())
def test_a_python_plugin_drives_the_native_table_as_the_model(run):
    """The plug-in path: the former Python policies as plug-ins of the C table decide as before."""
    name, frames, ways, ops = run
    _, model_cls, params = POLICIES[name]
    table = FrameTable(frames, ways, eviction=lambda capacity: model_cls(capacity, params))
    assert table.plugin
    run_against_model(table, name, frames, ways, ops)


@pytest.mark.parametrize("frames,ways", [(24, 8), (20, 20)])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_long_runs_reach_every_decision_as_the_model(name, frames, ways):
    """Thousands of steps (where the random sequences above are short): hits, clean and dirty evictions,
    victim predictions and sets with every way pinned, all as the model decides."""
    rng = random.Random(f"{name}-{frames}")
    ops = []
    for burst in range(6):  # random steps, then every frame pinned for a while
        ops += [(rng.choice(FRAME_OPS), rng.randrange(3 * frames), rng.randrange(frames)) for _ in range(500)]
        ops += [("pin", 0, f) for f in range(frames)] + [("access", rng.randrange(3 * frames), 0)] * 5
        ops += [("unpin", 0, f) for f in range(frames) if rng.random() < 0.8]
    native_cls, _, params = POLICIES[name]
    table = FrameTable(frames, ways, eviction=lambda capacity: native_cls(capacity, params))
    answers = run_against_model(table, name, frames, ways, ops)
    inserts = [answer[1] for op, answer in answers if op == "access" and answer[0] == "miss"]
    reached = {"hit": any(op == "access" and answer[0] == "hit" for op, answer in answers),
               "clean eviction": any(i and i.victim_page is not None and not i.victim_dirty for i in inserts),
               "dirty eviction": any(i and i.victim_dirty for i in inserts),
               "every way pinned": None in inserts,
               "victim predicted": any(op == "victim" and answer is not None for op, answer in answers)}
    assert all(reached.values()), reached


@st.composite
def order_runs(draw):
    name = draw(st.sampled_from(sorted(POLICIES)))
    capacity = draw(st.sampled_from((1, 4, 10, 20)))
    ops = draw(st.lists(st.tuples(st.sampled_from(("insert", "insert", "find", "hit", "evict", "to_evict", "remove")),
                                  st.integers(0, 3 * capacity), st.frozensets(st.integers(0, 3 * capacity))),
                        min_size=30, max_size=150))
    return name, capacity, ops


@PROPERTY
@given(order_runs())
def test_a_policy_on_its_own_keeps_the_op_table(run):
    """A native policy outside a frame table (e.g. the inherited operations of a subclass): the op table with
    any ``pinned`` predicate answers as the Python model."""
    name, capacity, ops = run
    native_cls, model_cls, params = POLICIES[name]
    mine, theirs = native_cls(capacity, params), model_cls(capacity, params)
    resident: set[int] = set()
    for i, (op, page, pinned_pages) in enumerate(ops):
        pinned = pinned_pages.__contains__
        where = f"{name}({capacity}), step {i}: {op} page={page} pinned={sorted(pinned_pages)}"
        if op == "insert" and page not in resident and len(resident) < capacity:
            mine.insert(page), theirs.insert(page)
            resident.add(page)
        elif op in ("find", "hit"):
            assert mine.find(page, op == "hit") == theirs.find(page, op == "hit"), where
        elif op in ("evict", "to_evict") and resident - pinned_pages:
            incoming = page if page not in resident else None
            got = mine.evict(pinned, incoming) if op == "evict" else mine.to_evict(pinned)
            want = theirs.evict(pinned, incoming) if op == "evict" else theirs.to_evict(pinned)
            assert got == want, where
            if op == "evict":
                resident.discard(got)
        elif op == "remove" and page in resident:
            mine.remove(page), theirs.remove(page)
            resident.discard(page)


# ---- the batch entry points ----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(POLICIES))
def test_lookup_or_insert_and_access_many_equal_the_per_call_path(name):
    native_cls, _, params = POLICIES[name]
    rng = random.Random(name)
    pages = [rng.randrange(60) if rng.random() < 0.7 else rng.randrange(1000) for _ in range(3000)]
    writes = bytes(rng.random() < 0.2 for _ in pages)

    def make():
        return FrameTable(32, 8, eviction=lambda capacity: native_cls(capacity, params))

    per_call, one_by_one, batch = make(), make(), make()
    want_hits, counts = bytearray(), [0, 0, 0, 0]  # hits, misses, evictions, dirty evictions
    for page, write in zip(pages, writes):
        frame = per_call.lookup(page)
        want_hits.append(frame is not None)
        victim = (None, False)
        if frame is not None:
            per_call.touch(frame)
            counts[0] += 1
        else:
            ins = per_call.insert(page)
            frame, victim = ins.frame, (ins.victim_page, ins.victim_dirty)
            counts[1] += 1
            counts[2] += ins.victim_page is not None
            counts[3] += ins.victim_dirty
        if write:
            per_call.mark_dirty(frame)
        access = one_by_one.lookup_or_insert(page)
        assert access == (frame, bool(want_hits[-1]), *victim)
        if write:
            one_by_one.mark_dirty(access.frame)
    got_hits = bytearray(len(pages))
    got = batch.access_many(array("Q", pages), writes=writes, hits=got_hits)
    assert tuple(got) == tuple(counts)
    assert got_hits == want_hits
    for t in (one_by_one, batch):
        assert frame_state(t) == frame_state(per_call)
        t.check()


@pytest.mark.parametrize("name", ["lru", "fifo", "clock", "sieve", "s3fifo"])
def test_access_many_over_the_mooncake_trace_misses_as_libcachesim(name):
    """The sequential replay's setting in one call: every hash id of the trace, one page each, 1024 frames."""
    import json

    lcs = require_oracle("libcachesim")
    from emulator.policies import policy_class
    from emulator.shared_data import mooncake_conversation_trace

    with mooncake_conversation_trace().open() as f:
        ids = [h for line in f if line.strip() for h in json.loads(line)["hash_ids"]]
    cache = {"lru": lcs.LRU, "fifo": lcs.FIFO, "clock": lcs.Clock, "sieve": lcs.Sieve, "s3fifo": lcs.S3FIFO}[name](1024)
    request = lcs.Request()
    request.obj_size = 1
    want = 0
    for obj_id in ids:
        request.obj_id = obj_id
        want += not cache.get(request)
    got = FrameTable(1024, eviction=policy_class(name).eviction).access_many(array("Q", ids))
    assert (got.misses, got.hits) == (want, len(ids) - want)


def test_access_many_takes_any_sequence_of_page_numbers_and_stops_where_every_way_is_pinned():
    t = FrameTable(4, 2)
    assert t.access_many([0, 2, 0, 4]) == (1, 3, 1, 0)  # set 0: 0, 2, hit 0, then 4 evicts 2
    assert t.access_many(range(1, 8, 2)) == (0, 4, 2, 0)
    for frame in (0, 1):
        t.pin(frame)
    with pytest.raises(ChmError) as exc:
        t.access_many(array("Q", [0, 6]))  # a hit, then set 0 has no way to give
    assert exc.value.errno == errno.EBUSY and "access #1 (page 6)" in str(exc.value)
    assert t.lookup(0) is not None and t.lookup(6) is None


def test_a_plugin_table_runs_access_many_through_python():
    t = FrameTable(4, eviction=model.LruOrder)
    hits = bytearray(5)
    assert t.plugin and t.access_many([1, 2, 1, 3, 4], writes=b"\0\1\0\0\0", hits=hits) == (1, 4, 0, 0)
    assert list(hits) == [0, 0, 1, 0, 0] and t.dirty[t.lookup(2)] == 1


# ---- contract violations and introspection ---------------------------------------------------------

def test_a_call_that_breaks_the_contract_raises_and_changes_nothing():
    t = FrameTable(4, 2)
    t.insert(0)
    with pytest.raises(AssertionError, match="already in frame 0"):
        t.insert(0)
    with pytest.raises(AssertionError, match="frame 1 is empty"):
        t.touch(1)
    t.pin(0)
    with pytest.raises(AssertionError, match="frame 0 is pinned"):
        t.invalidate(0)
    with pytest.raises(AssertionError, match="frame 2 is not pinned"):
        t.unpin(2)
    with pytest.raises(IndexError, match="frame 4 is out of range"):
        t.mark_dirty(4)
    with pytest.raises(TypeError):
        t.page_of[0] = 5  # the per-frame state is read-only
    assert frame_state(t) == ([0, None, None, None], bytes(4), [1, 0, 0, 0], 1)
    t.check()


def test_policy_sizes_come_from_the_core():
    order = S3FifoOrder(50, SimpleNamespace(small_size_ratio=0.25, ghost_size_ratio=0.9, move_to_main_threshold=3))
    assert (order.small_capacity, order.main_capacity, order.ghost_capacity, order.threshold) == (12, 38, 45, 3)
    assert ClockOrder(8, SimpleNamespace(n_bit_counter=3)).max_freq == 7
    fifo = FifoOrder(3)
    for page in (5, 6, 7):
        fifo.insert(page)
    assert list(fifo.order) == [5, 6, 7] and fifo.order.popitem(last=False) == (5, None) and len(fifo.order) == 2


def test_the_loaded_core_is_built_from_the_current_sources():
    assert native._module.__name__ == native_build.module_name()
    assert native.lib.chm_core_mutation() == native.lib.CHM_MUTATION_NONE


# ---- the prefetch engine and write admission -----------------------------------------------------

def outcome(call, *args):
    """What a call returned, or the error it raised (type, errno, message)."""
    try:
        result = call(*args)
    except (ChmError, KeyError, AssertionError) as exc:
        return type(exc).__name__, getattr(exc, "errno", None), str(exc)
    if isinstance(result, (model.Staging,)) or type(result).__name__ == "Staging":
        return result.handle, result.first_page, result.pages, result.arrived
    return result


@PROPERTY
@given(st.sampled_from(((4, 2), (8, 3), (16, 1))),
       st.lists(st.tuples(st.sampled_from(("issue", "issue", "fetch", "arrived", "arrived", "release", "get")),
                          st.integers(0, 5), st.integers(0, 17)), min_size=50, max_size=200))
def test_the_prefetch_engine_decides_as_the_python_model(size, ops):
    window, handles = size
    mine, theirs = PrefetchEngine(window, handles), model.PrefetchEngine(window, handles)
    live = {}  # views get() handed out follow arrivals until released
    for i, (op, handle, pages) in enumerate(ops):
        where = f"window {window}, {handles} handles, step {i}: {op} handle={handle} pages={pages}"
        if op == "issue":
            args = (handle, 1000 * handle + pages, pages)
            assert outcome(mine.issue, *args) == outcome(theirs.issue, *args), where
        elif op == "fetch":
            assert mine.next_fetch() == theirs.next_fetch(), where
        elif op == "arrived":
            assert outcome(mine.arrived, handle) == outcome(theirs.arrived, handle), where
        elif op == "get":
            got = outcome(mine.get, handle)
            assert got == outcome(theirs.get, handle), where
            if not isinstance(got[0], str):
                live[handle] = (mine.get(handle), theirs.get(handle))
        else:
            assert outcome(mine.release, handle) == outcome(theirs.release, handle), where
        assert (mine.pages_held, list(mine.objects)) == (theirs.pages_held, list(theirs.objects)), where
        for a, b in live.values():
            assert (a.arrived, a.ready) == (b.arrived, b.ready), where


def test_a_staging_view_follows_arrivals_and_is_fixed_by_release():
    e = PrefetchEngine(window_pages=4, max_handles=2)
    e.issue(7, first_page=10, pages=2)
    view = e.get(7)
    assert (view.arrived, view.ready) == (0, False) and 7 in e.objects and e.objects[7] is view
    e.arrived(7), e.arrived(7)
    assert view.ready and e.release(7) is view and view.arrived == 2
    assert 7 not in e.objects and view.arrived == 2 and e.pages_held == 0


@PROPERTY
@given(st.integers(0, 20), st.lists(st.tuples(st.booleans(), st.integers(0, 25)), max_size=100))
def test_write_admission_decides_as_the_python_model(capacity, ops):
    mine, theirs = WriteAdmission(capacity), model.WriteAdmission(capacity)
    for admit, pages in ops:
        if admit:
            assert mine.admit(pages) == theirs.admit(pages)
        else:
            assert (outcome(mine.release, pages) is None) == (outcome(theirs.release, pages) is None)
        assert (mine.used_pages, mine.free_pages, mine.capacity_pages) == \
            (theirs.used_pages, theirs.free_pages, theirs.capacity_pages)


# ---- the C core on its own, under the sanitizers ------------------------------------------------------

def test_the_core_survives_random_operations_under_asan_and_ubsan(tmp_path):
    """A C driver (native_core_stress.c) runs every call of the core with random arguments, legal or not,
    checking the table's invariants (chm_ft_check) after each; built with -fsanitize=address,undefined,
    any out-of-bounds access, leak or undefined behaviour fails it."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc is not None, "no C compiler: `make setup` installs gcc (the Makefile's APT_PACKAGES)"
    exe = tmp_path / "stress"
    warnings = [flag for flag in native_build.CFLAGS if flag.startswith("-W")]
    build = subprocess.run([cc, "-std=c11", "-O1", "-g", *warnings, "-fsanitize=address,undefined",
                            "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", f"-I{native_build.NATIVE}",
                            str(Path(__file__).with_name("native_core_stress.c")),
                            *map(str, native_build.SOURCES), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr  # missing libasan/libubsan: `make setup` installs gcc, which brings them
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all invariants held" in run.stdout
