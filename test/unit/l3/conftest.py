"""Fixtures for the L3 store tests: real files on a real disk (O_DIRECT), real LMDB."""

import os

import pytest

import l3_helpers
from l3_helpers import config_doc, fs_type
from sglang_cp.l3 import L3Store, parse_l3_config

# Modules whose every test runs once per io.read_engine: the read path's guarantees (a bad page is one
# miss with its counter, bounds on a hung disk, nothing written to the caller's memory after its bound)
# must hold for every engine.
READ_PATH_MODULES = {"test_l3_corruption", "test_l3_faults", "test_l3_bounds", "test_l3_payload_counters",
                     "test_l3_stale_readers", "test_l3_store"}


def pytest_generate_tests(metafunc):
    if metafunc.module.__name__.rpartition(".")[2] in READ_PATH_MODULES:
        metafunc.parametrize("read_engine", ["python", "native", "uring"], indirect=True)


@pytest.fixture(autouse=True)
def read_engine(request):
    """io.read_engine for config_doc in this test (parametrized in READ_PATH_MODULES, else "python")."""
    engine = getattr(request, "param", "python")
    l3_helpers.READ_ENGINE["engine"] = engine
    yield engine
    l3_helpers.READ_ENGINE["engine"] = "python"


@pytest.fixture
def l3_root(tmp_path_factory):
    """A directory on a filesystem that supports O_DIRECT (tmpfs does not)."""
    d = tmp_path_factory.mktemp("l3")
    if fs_type(str(d)) == "tmpfs":
        base = "/var/tmp/sglang-cp-l3-tests"
        os.makedirs(base, exist_ok=True)
        import tempfile
        d = tempfile.mkdtemp(dir=base)
    for sub in ("idx", "d0", "d1"):
        os.makedirs(os.path.join(str(d), sub), exist_ok=True)
    return str(d)


@pytest.fixture
def make_store(l3_root):
    """Factory: make_store(payloads=..., cold_start=..., **config sections) -> L3Store (closed at teardown)."""
    stores = []

    def factory(payloads=None, cold_start="clear", rank=0, ranks_per_node=1, fault_injector=None,
                capacity_gb=0.02, two_disks=False, **sections):
        cfg = parse_l3_config(config_doc(l3_root, capacity_gb=capacity_gb, two_disks=two_disks, **sections))
        s = L3Store(cfg, rank=rank, ranks_per_node=ranks_per_node, payloads=payloads or {"kv": 16384},
                    cold_start=cold_start, fault_injector=fault_injector)
        stores.append(s)
        return s

    factory.root = l3_root
    yield factory
    for s in stores:
        s.close()
