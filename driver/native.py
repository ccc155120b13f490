"""Load a compiled cffi (API mode) module, building it first if it is missing.

``make setup`` builds every module ahead of time; a process that still finds
one missing builds it under a file lock, so concurrent first imports build it
once."""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable


CDEF_BEGIN, CDEF_END = "/* ---- cdef begin ---- */", "/* ---- cdef end ---- */"


def cdef_of(header: Path) -> str:
    """The cffi-parsable part of a header: the text between its cdef markers."""
    text = header.read_text()
    return text[text.index(CDEF_BEGIN) + len(CDEF_BEGIN): text.index(CDEF_END)]


def source_digest(sources, cflags) -> str:
    """12 hex digits of the sources' bytes and the compiler flags: the suffix of a module built from them, so a
    process never loads a module built from other sources."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(Path(path).read_bytes())
    digest.update(" ".join(cflags).encode())
    return digest.hexdigest()[:12]


def compile_into(ffi, folder: Path) -> Path:
    """Compile the cffi module ``ffi`` describes in a scratch folder and move it into ``folder`` (one rename: a
    concurrent import sees the whole module or none). Returns its path."""
    with tempfile.TemporaryDirectory(prefix="chm_build_") as scratch:
        built = Path(ffi.compile(tmpdir=scratch, verbose=False))
        target = folder / built.name
        staged = folder / f".{os.getpid()}.{built.name}"  # a *.so: ignored by git if left behind
        shutil.copyfile(built, staged)
        os.replace(staged, target)
    return target


def load_or_build(module: str, build: Callable[[], object], lock_path: Path) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return importlib.import_module(module)  # built by a concurrent process meanwhile
        except ImportError:
            build()
            importlib.invalidate_caches()
            return importlib.import_module(module)


def stale_modules(folder: Path, module: str) -> list[Path]:
    """Modules in ``folder`` built from earlier sources than ``module`` (``package._name_<digest>``): the same
    ``_name_``, another digest."""
    current = module.rsplit(".", 1)[1]
    stem = current.rsplit("_", 1)[0]
    return [p for p in folder.glob(f"{stem}_*.so") if not p.name.startswith(current)]


@dataclass(frozen=True)
class ApiModule:
    """A cffi (API mode) module built from C sources: the cdef cut out of ``header`` (its cdef markers), the
    name ``package._stem_<digest>`` of ``digested`` (every file it is built from) and ``cflags``, compiled into
    ``folder``; built on first load if missing (under ``lock``)."""

    package: str
    stem: str
    folder: Path
    header: Path
    c_sources: tuple[Path, ...]
    digested: tuple[Path, ...]
    include_dirs: tuple[Path, ...]
    cflags: tuple[str, ...]
    lock: Path
    libraries: tuple[str, ...] = ()

    def name(self) -> str:
        return f"{self.package}._{self.stem}_{source_digest(self.digested, list(self.cflags))}"

    def ffi(self):
        import cffi

        ffi = cffi.FFI()
        ffi.cdef(cdef_of(self.header))
        ffi.set_source(self.name(), f'#include "{self.header.name}"', sources=[str(p) for p in self.c_sources],
                       include_dirs=[str(p) for p in self.include_dirs], extra_compile_args=list(self.cflags),
                       libraries=list(self.libraries))
        return ffi

    def build(self) -> Path:
        return compile_into(self.ffi(), self.folder)

    def load(self) -> ModuleType:
        return load_or_build(self.name(), self.build, self.lock)

    def main(self) -> None:
        """Build for the current sources if missing, remove the modules built from earlier ones, print its path."""
        loaded = self.load()
        for old in stale_modules(self.folder, self.name()):
            old.unlink()
        print(loaded.__file__)
