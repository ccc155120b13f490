"""Loaded by every Python process of the sanitizer job (tools/ci/sanitize.py puts this folder on PYTHONPATH):
native modules built with the sanitizers are imported from ``$CHM_SANITIZED_MODULES`` instead of the tree.

A file there is named by the full name of the module it stands in for
(``emulator.serve._srv_<digest>.cpython-311-x86_64-linux-gnu.so``): the name the tree's build modules give it,
so the importer (``emulator.native``, ``emulator.serve.server``) needs no change, and the tree's own build of
it is neither used nor touched."""

import importlib.machinery
import importlib.util
import os
import sys

SANITIZED = os.environ.get("CHM_SANITIZED_MODULES")


class SanitizedModules:
    """A meta path finder: a module whose file is in ``SANITIZED`` is loaded from there."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if not fullname.rpartition(".")[2].startswith("_"):  # the native modules' names all start with one
            return None
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = os.path.join(SANITIZED, fullname + suffix)
            if os.path.exists(candidate):
                loader = importlib.machinery.ExtensionFileLoader(fullname, candidate)
                return importlib.util.spec_from_file_location(fullname, candidate, loader=loader)
        return None


if SANITIZED:
    sys.meta_path.insert(0, SanitizedModules())
