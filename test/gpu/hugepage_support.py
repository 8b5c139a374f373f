"""2 MiB hugepages for the real-server tests with a hugetlbfs-backed host pool (the ``hugetlbfs``
fixture in this directory's conftest.py, and the tests that resize the pool themselves). Imports
nothing GPU-specific: the fixture is collected on every machine and skips where it cannot run."""

from __future__ import annotations

NR = "/proc/sys/vm/nr_hugepages"
SYSFS = "/sys/kernel/mm/hugepages/hugepages-2048kB"
HOST_POOL_GB = 4  # the largest host pool a test server puts on the mount (--hicache-size of l3_flags)


def read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def write_int(path: str, v: int) -> None:
    with open(path, "w") as f:
        f.write(f"{v}\n")


def avail() -> int:
    """2 MiB hugepages neither in use nor reserved by a mapping."""
    return read_int(f"{SYSFS}/free_hugepages") - read_int(f"{SYSFS}/resv_hugepages")
