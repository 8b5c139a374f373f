"""Fixtures of the real-server GPU tests. Imports nothing GPU-specific (collected everywhere; the
test modules themselves skip without CUDA)."""

from __future__ import annotations

import os
import subprocess

import pytest

from hugepage_support import HOST_POOL_GB, NR, avail, read_int, write_int


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
