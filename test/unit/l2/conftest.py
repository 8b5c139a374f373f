"""Real hugetlbfs for the L2 tests, when this machine lets us make one.

As root we raise vm.nr_hugepages by what the tests need, mount a private hugetlbfs
(one unlimited, one with a size= limit) under a temp dir, and restore everything
afterwards. Without root or hugepage support those tests skip; the rest run on an
ordinary directory through HugetlbfsMount.for_testing_on.
"""

import os
import subprocess

import pytest

NR = "/proc/sys/vm/nr_hugepages"
HP_2M = 2 << 20
PAGES_FOR_TESTS = 48  # 96 MiB


def _read_nr() -> int:
    with open(NR) as f:
        return int(f.read())


def _free_2m() -> int:
    with open("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages") as f:
        free = int(f.read())
    with open("/sys/kernel/mm/hugepages/hugepages-2048kB/resv_hugepages") as f:
        return free - int(f.read())


@pytest.fixture(scope="session")
def hugepages_2m():
    """Ensure PAGES_FOR_TESTS free 2 MiB hugepages; yields nothing, restores on exit."""
    if os.geteuid() != 0 or not os.path.exists(NR):
        pytest.skip("needs root and /proc/sys/vm/nr_hugepages to reserve hugepages")
    before = _read_nr()
    try:
        with open(NR, "w") as f:
            f.write(str(before + max(0, PAGES_FOR_TESTS - _free_2m())))
    except OSError as e:
        pytest.skip(f"cannot raise vm.nr_hugepages: {e}")
    if _free_2m() < PAGES_FOR_TESTS:
        with open(NR, "w") as f:
            f.write(str(before))
        pytest.skip("the kernel did not grant the hugepages the tests need")
    yield
    with open(NR, "w") as f:
        f.write(str(before))


def _mount(target, options=None):
    cmd = ["mount", "-t", "hugetlbfs"] + (["-o", options] if options else []) + ["none", str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount hugetlbfs: {proc.stderr.strip()}")


@pytest.fixture
def hugetlbfs_dir(hugepages_2m, tmp_path):
    """An unlimited private hugetlbfs mount of 2 MiB pages."""
    target = tmp_path / "huge"
    target.mkdir()
    _mount(target, "pagesize=2M")
    yield str(target)
    subprocess.run(["umount", str(target)], check=False)


@pytest.fixture
def hugetlbfs_limited(hugepages_2m, tmp_path):
    """A hugetlbfs mount limited to 8 pages (16 MiB) by size=: statvfs counts them."""
    target = tmp_path / "huge8"
    target.mkdir()
    _mount(target, "pagesize=2M,size=16M")
    yield str(target)
    subprocess.run(["umount", str(target)], check=False)
