"""``python -m emulator.native``: build the native core for the current sources (importing it does) and remove the modules built from earlier ones; prints the module's
path."""

from .. import native_build
from . import _module

for old in native_build.stale_modules():
    old.unlink()
print(_module.__file__)
