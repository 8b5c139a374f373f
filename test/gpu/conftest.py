"""Fixtures of the real-server GPU tests. Imports nothing GPU-specific (collected everywhere; the
test modules themselves skip without CUDA)."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from hugepage_support import HOST_POOL_GB, NR, avail, read_int, write_int
from start_slots import read_starts, start_table

START_LOG = "SGLANG_CP_GPU_START_LOG"


def pytest_configure(config):
    """One start ledger for the run: set here, in the controller, before pytest-xdist spawns the workers,
    which inherit it (a worker finds it set and keeps it). A caller's own path is kept."""
    if not os.environ.get(START_LOG):
        config._sglang_cp_start_dir = tempfile.mkdtemp(prefix="sglang-cp-gpu-starts-")  # 0700
        os.environ[START_LOG] = os.path.join(config._sglang_cp_start_dir, "starts.jsonl")


def pytest_unconfigure(config):
    """A run that started no server (CI: no CUDA) leaves no ledger directory behind."""
    d = getattr(config, "_sglang_cp_start_dir", None)
    if d and not os.listdir(d):
        os.rmdir(d)


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    table = start_table(read_starts(os.environ.get(START_LOG, "")))
    if table:
        terminalreporter.write_sep("-", f"test server starts ({os.environ[START_LOG]})")
        terminalreporter.write_line(table)


@pytest.fixture
def hugetlbfs(tmp_path_factory):
    """A hugetlbfs mount with room for a HOST_POOL_GB host pool, vm.nr_hugepages restored after.
    Needs root; skips otherwise. Tests using it change vm.nr_hugepages: under pytest-xdist they share
    one worker (``xdist_group("hugepages")``)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to reserve hugepages and mount hugetlbfs")
    before = read_int(NR)
    want = HOST_POOL_GB * 512 + 256
    write_int(NR, before + max(0, want - avail()))
    if avail() < want:
        write_int(NR, before)
        pytest.skip(f"the kernel granted only {avail()} free 2 MiB hugepages, need {want}")
    mnt = str(tmp_path_factory.mktemp("hugetlbfs"))
    if subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", mnt]).returncode:
        write_int(NR, before)
        pytest.skip("cannot mount hugetlbfs")
    yield mnt
    subprocess.run(["umount", "-l", mnt], check=False)
    write_int(NR, before)
