"""Per-client prefetch share: one client cannot hold the whole prefetch window.

Profile ``small``: a window of 64 MiB = 1024 pages of 64 KiB, and 64 handles.
A client's share (attach field ``prefetch_share_ppm``, 0 = the device's
``policy.prefetch_client_share``) applies alike to the window's pages and to
the handles."""

import errno

import pytest

from driver.wire import lib, read_node
from tests.driver.rawclient import RawClient
from tests.emulator.serve.serving import Server

PAGE = 64 << 10
WINDOW_PAGES = 1024
HANDLES = 64


def prefetch(c: RawClient, addr: int, size: int, user_data: int = 1) -> int:
    c.push(user_data=user_data, opcode=lib.CHM_OP_PREFETCH, addr=addr, len=size)
    (_, res), = c.reap(1)
    return res


def release(c: RawClient, handle: int) -> None:
    c.push(user_data=2, opcode=lib.CHM_OP_RELEASE, handle=handle)
    assert c.reap(1) == [(2, 0)]


@pytest.fixture
def half_share_server(tmp_path):
    with Server(tmp_path / "media", None, "--set", "policy.prefetch_client_share=0.5") as srv:
        yield srv


@pytest.fixture
def server(tmp_path):
    with Server(tmp_path / "media") as srv:
        yield srv


def test_attach_checks_the_share_and_the_reserved_field(server):
    for fields in ({"prefetch_share_ppm": lib.CHM_PPM + 1}, {"prefetch_share_ppm": 2**32 - 1}, {"rsvd0": 1}):
        c = RawClient(server.node, **fields)
        assert c.status == -errno.EINVAL, fields
        c.sock.close()
    for ppm in (0, 1, lib.CHM_PPM):
        c = RawClient(server.node, prefetch_share_ppm=ppm)
        assert c.status == 0, ppm
        c.close()
    assert server.proc.poll() is None
    rc, _, err = server.stop()
    assert rc == 0
    # The device says which field was wrong, with its value and the allowed range.
    assert f"prefetch_share_ppm {lib.CHM_PPM + 1} is outside [0, {lib.CHM_PPM}]" in err


def test_a_client_holding_its_whole_share_leaves_handles_for_others(half_share_server):
    """The defect: one client took all 64 handles and never released them; everyone else got EBUSY."""
    hog, other = RawClient(half_share_server.node), RawClient(half_share_server.node)
    handles = []
    for i in range(HANDLES):
        res = prefetch(hog, i * PAGE, PAGE)
        if res < 0:
            break
        handles.append(res)
    assert res == -errno.EBUSY
    assert len(handles) == HANDLES // 2  # the device default share: half of every limit
    why = hog.stats_json()["last_error"]
    assert "this client's prefetch share" in why and f"{HANDLES // 2} of its {HANDLES // 2} handles" in why, why
    # The other client still gets the rest of the device's handles; then the device's own limit speaks.
    theirs = [prefetch(other, (100 + i) * PAGE, PAGE) for i in range(HANDLES // 2)]
    assert all(h > 0 for h in theirs), theirs
    assert prefetch(hog, 0, PAGE) == -errno.EBUSY
    other_full = prefetch(other, 0, PAGE)
    assert other_full == -errno.EBUSY
    why = other.stats_json()["last_error"]
    assert "this client's" in why  # other's share is also half: 32 of its 32
    # A release gives the hog its room back.
    release(hog, handles[0])
    assert prefetch(hog, 0, PAGE) > 0
    hog.close()
    other.close()


def test_the_share_bounds_pages_and_the_messages_name_the_limit(server):
    quarter = RawClient(server.node, prefetch_share_ppm=250_000)  # 256 pages, 16 handles
    obj = 128 * PAGE
    a, b = prefetch(quarter, 0, obj), prefetch(quarter, obj, obj)
    assert a > 0 and b > 0
    assert prefetch(quarter, 2 * obj, PAGE) == -errno.EBUSY
    stats = quarter.stats_json()
    why = stats["last_error"]
    assert "this client's prefetch share is full: it holds 256 of its 256 pages, 1 more requested" in why, why
    assert stats["prefetch"] == {"share_ppm": 250_000, "pages_held": 256, "pages_limit": 256,
                                 "handles_held": 2, "handles_limit": 16}
    # Larger than the whole share: it can never fit, so it is a bad argument, not a busy device.
    assert prefetch(quarter, 0, 257 * PAGE) == -errno.EINVAL
    assert "can never fit this client's prefetch share of 256 pages" in quarter.stats_json()["last_error"]
    release(quarter, a)
    assert prefetch(quarter, 2 * obj, PAGE) > 0

    # The device's own limits, hit by a client whose share is the whole window.
    full = RawClient(server.node)
    for i in range(WINDOW_PAGES // 128 - 1):  # 7 more objects of 128 pages: 896 + quarter's 129 > 1024
        res = prefetch(full, (16 + i) * obj, obj)
        if res < 0:
            break
    assert res == -errno.EBUSY
    why = full.stats_json()["last_error"]
    assert "the device's prefetch window is full" in why and f"of {WINDOW_PAGES} pages held" in why, why
    assert read_node(server.node)["prefetch_max_handles"] == HANDLES
    quarter.close()
    full.close()


def test_the_device_handle_limit_names_itself(server):
    a = RawClient(server.node)
    held = [prefetch(a, i * PAGE, PAGE) for i in range(HANDLES)]
    assert all(h > 0 for h in held)
    assert prefetch(a, 0, PAGE) == -errno.EBUSY
    why = a.stats_json()["last_error"]
    assert f"the device's prefetch handles are all in use: {HANDLES} of {HANDLES}" in why, why
    a.close()
