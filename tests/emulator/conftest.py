import pytest

from emulator import Device

KiB = 1 << 10

# A device small enough to reason about: 4 KiB pages, 8 KiB stripes over two
# 256 KiB SSDs (512 KiB capacity), 16 DRAM frames (4 of them write buffer).
TINY = {
    "device.page_size_bytes": 4 * KiB,
    "ssd.stripe_bytes": 8 * KiB,
    "ssd.capacity_bytes": 256 * KiB,
    "dram.size_bytes": 64 * KiB,
    "policy.write_buffer_fraction": 0.25,
    "policy.prefetch_window_bytes": 16 * KiB,
    "policy.prefetch_max_handles": 4,
    "policy.flush_batch_bytes": 8 * KiB,
    "emulation.io_queue_depth": 8,
}


@pytest.fixture
def tiny(media_dir):
    """Open a tiny device: tiny(policy, {"dotted.field": value, ...})."""
    opened = []

    def make(policy="hymcache", more=None):
        dev = Device.open("small", media_dir, policy=policy, overrides={**TINY, **(more or {})})
        opened.append(dev)
        return dev

    yield make
    for dev in opened:
        dev.close()


@pytest.fixture
def native_hits_served(monkeypatch) -> list[int]:
    """The pages each call of the native DRAM-hit read served (0: it declined), in call order."""
    from emulator import controller as controller_mod

    served = []
    read_hit = controller_mod._read_hit

    def counting_read_hit(*args):
        pages = read_hit(*args)
        served.append(pages)
        return pages

    monkeypatch.setattr(controller_mod, "_read_hit", counting_read_hit)
    return served
