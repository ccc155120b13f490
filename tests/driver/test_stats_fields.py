"""The device's statistics fields are one list (driver/include/chm_stats.h): the wire struct, libchm's
public struct, the emulator's counters and what a C program reads through chm_get_stats all follow it."""

import subprocess

from driver import wire
from driver.wire import STATS_COUNTERS, STATS_FIELDS
from emulator import Device

from tests.emulator.serve.serving import Server, compile_c

READER = r"""
#include <stdio.h>
#include "chm.h"

int main(int argc, char **argv)
{
    chm_dev *dev;
    struct chm_stats st;
    char buf[4096] = "hello";
    if (chm_open(argv[1], &dev) < 0 || chm_write(dev, 0, buf, sizeof buf) < 0 || chm_read(dev, 0, buf, sizeof buf) < 0
        || chm_get_stats(dev, &st) < 0)
        return 1;
#define PRINT(f) printf(#f " %llu\n", (unsigned long long)st.f);
    CHM_STATS_FIELDS(PRINT)
    chm_close(dev);
    return 0;
}
"""


def test_wire_public_struct_and_emulator_counters_are_the_one_list():
    from libchm import _chm

    fields = STATS_FIELDS
    assert len(fields) == len(set(fields)) and {"page_hits", "lost_pages", "clock_ns", "map_faults"} <= set(fields)
    assert tuple(name for name, _ in wire.ffi.typeof("struct chm_wire_stats").fields) == fields
    assert tuple(name for name, _ in _chm.ffi.typeof("struct chm_stats").fields) == fields
    with Device.open(profile="small") as dev:
        counters = {k for k, v in dev.stats().items() if isinstance(v, int)}
    assert set(STATS_COUNTERS) <= counters


def test_a_c_program_reads_every_field_through_chm_get_stats(tmp_path):
    src = tmp_path / "stats.c"
    src.write_text(READER)
    exe = compile_c(src, tmp_path / "stats")
    with Server(tmp_path / "media") as srv:
        out = subprocess.run([str(exe), srv.node], capture_output=True, text=True, check=True).stdout
    got = dict(line.split() for line in out.splitlines())
    assert tuple(got) == STATS_FIELDS
    assert int(got["writes"]) == 1 and int(got["reads"]) == 1 and int(got["write_bytes"]) == 4096
    assert int(got["clients"]) == 1 and int(got["clock_ns"]) > 0
