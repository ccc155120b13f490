import pytest


@pytest.fixture
def media_dir(tmp_path):
    """A media directory on a real disk (O_DIRECT works there)."""
    path = tmp_path / "media"
    path.mkdir()
    return path
