"""The native core (``chm_core.h`` and the sources here, through cffi): ``ffi`` and ``lib``.

Built by ``make`` (``python -m emulator.native``, see ``emulator/native_build.py``);
a process that finds the module for the current sources missing builds it
(under a file lock).

``$CHM_CORE_MUTATION`` (tests only) loads a variant with one planted wrong
decision (a ``CHM_MUTATION_*`` name of the header, e.g. ``LRU_RANK``): the RTL
benches run against it to show they catch it (rtl_model.sim.run_bench).
"""

from __future__ import annotations

import os

from driver.native import load_or_build

from .. import native_build

_mutation = os.environ.get(native_build.MUTATION_ENV) or None
_module = load_or_build(native_build.module_name(_mutation), lambda: native_build.build(_mutation),
                        native_build.HERE / "native_build.lock")
ffi, lib = _module.ffi, _module.lib
if lib.chm_core_mutation() != (getattr(lib, f"CHM_MUTATION_{_mutation.upper()}") if _mutation else 0):
    raise ImportError(f"{_module.__file__} does not plant ${native_build.MUTATION_ENV}={_mutation!r}")
