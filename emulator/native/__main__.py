"""``python -m emulator.native``: build the native core for the current sources (importing it does), remove the
modules built from earlier ones and bring the unity shim (``chm_core.c``, the replay's build) up to date; prints
the module's path."""

from .. import native_build
from . import _module

for old in native_build.stale_modules():
    old.unlink()
if native_build.write_unity_shim():
    print(f"rewrote {native_build.UNITY_SHIM}")
print(_module.__file__)
