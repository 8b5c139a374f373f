import pytest

from suite_helpers import REPO, run_py  # noqa: F401  (kept importable from here)


@pytest.fixture
def disk_tmp(tmp_path_factory):
    """A temp dir on a real disk filesystem (O_DIRECT works there; tmpfs would not)."""
    return tmp_path_factory.mktemp("disk")
