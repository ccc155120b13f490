"""A native policy is its own C file: the file registers itself with the core (policy.h's CHM_POLICY), so
a core built with one more ``policy_*.c`` finds the new policy by name, with nothing else edited."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from emulator import native_build
from emulator.frame_table import NativeOrder
from emulator.native import lib
from emulator.policies import policy_class

from .test_policy_registry import CACHES

NEW_NAME = "fifo_twin"
# A program over the core: the new policy's kind, and FIFO's decisions when a frame table runs it.
PROGRAM = r"""
#include <stdio.h>
#include "chm_core.h"

int main(void)
{
    int64_t kind = chm_policy_kind("%(name)s");
    printf("kind %%lld\n", (long long)kind);
    if (kind < 0)
        return 1;
    struct chm_policy_params params = {.kind = (uint32_t)kind};
    struct chm_ft *ft;
    struct chm_access access;
    if (chm_ft_new(4, 4, &params, &ft))
        return 2;
    for (uint64_t page = 1; page <= 4; page++)
        chm_ft_insert(ft, page, &access);
    chm_ft_touch(ft, (uint32_t)chm_ft_lookup(ft, 1));  /* FIFO: a hit changes nothing */
    int rc = chm_ft_insert(ft, 5, &access);
    printf("insert %%d victim %%llu check %%d\n", rc, (unsigned long long)access.victim_page, chm_ft_check(ft));
    chm_ft_free(ft);
    return 0;
}
"""


def test_a_new_policy_c_file_is_found_by_name_in_a_core_built_with_it(tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc is not None, "no C compiler: `make setup` installs gcc (the Makefile's APT_PACKAGES)"
    native = tmp_path / "native"
    shutil.copytree(native_build.NATIVE, native, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    fifo = (native / "policy_fifo.c").read_text()
    twin = fifo.replace("chm_policy_fifo", "chm_policy_fifo_twin").replace('.name = "fifo"', f'.name = "{NEW_NAME}"')
    twin = twin.replace("CHM_POLICY_NUMBERED(chm_policy_fifo_twin, CHM_POLICY_FIFO)", "CHM_POLICY(chm_policy_fifo_twin)")
    assert twin.count(NEW_NAME) == 3 and "CHM_POLICY_FIFO" not in twin  # the copy registered itself, unnumbered
    (native / f"policy_{NEW_NAME}.c").write_text(twin)
    (tmp_path / "main.c").write_text(PROGRAM % {"name": NEW_NAME})
    sources = sorted(str(p) for p in native.glob("*.c"))
    build = subprocess.run([cc, *native_build.CFLAGS, f"-I{native}", str(tmp_path / "main.c"), *sources,
                            "-o", str(tmp_path / "core")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(tmp_path / "core")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    kind = int(run.stdout.split()[1])
    assert kind not in {policy_class(name).eviction.kind for name in CACHES} | {lib.CHM_POLICY_EXTERNAL}
    assert f"insert {lib.CHM_OK} victim 1 check 0" in run.stdout  # the oldest page goes, though page 1 was hit


@pytest.mark.parametrize("name", CACHES)
def test_each_native_policy_is_found_by_its_native_name(name):
    order = policy_class(name).eviction
    assert lib.chm_policy_kind(order.native_name.encode()) == order.kind >= 0
    assert f'.name = "{order.native_name}"' in (native_build.NATIVE / f"policy_{name}.c").read_text()


def test_the_built_ins_keep_their_numbers_and_kinds_are_distinct():
    kinds = {name: policy_class(name).eviction.kind for name in CACHES}
    assert kinds == {"lru": lib.CHM_POLICY_LRU, "fifo": lib.CHM_POLICY_FIFO, "clock": lib.CHM_POLICY_CLOCK,
                     "sieve": lib.CHM_POLICY_SIEVE, "s3fifo": lib.CHM_POLICY_S3FIFO}
    assert lib.chm_policy_kind(b"external") == NativeOrder.kind == lib.CHM_POLICY_EXTERNAL
    assert lib.chm_policy_kind(b"nonesuch") == -1


def test_a_native_name_the_core_lacks_is_refused_when_the_class_is_made():
    with pytest.raises(ValueError, match="the native core has no policy named 'nonesuch'"):
        type("Nonesuch", (NativeOrder,), {"native_name": "nonesuch"})
