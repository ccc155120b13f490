import importlib
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.fixture
def media_dir(tmp_path):
    """A media directory on a real disk (O_DIRECT works there)."""
    path = tmp_path / "media"
    path.mkdir()
    return path


def install_hint(distribution: str) -> str:
    """``pip install '<its requirement>'``, as pyproject.toml's extras pin it (``make setup`` installs them)."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    pinned = [r for reqs in extras.values() for r in reqs if Requirement(r).name == distribution]
    return f"pip install '{pinned[0] if pinned else distribution}' (or `make setup`)"


def require_oracle(module: str, distribution: str | None = None):
    """The module a test checks against (a pip-installable oracle: libcachesim, vLLM), imported; missing, the
    test fails naming how to install it. It does not skip: the test extras install it, so its absence is a
    broken setup, not a feature this machine lacks. ``distribution``: the pip name, when not ``module``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"the oracle {module!r} is missing ({exc}): {install_hint(distribution or module)}",
                    pytrace=False)
