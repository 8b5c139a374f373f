"""Stale hugepage slabs are reclaimed whatever the port of the server that left them.

On a real server, L2 slab files are named per --port (the namespace) and only a server on the same
port reclaimed them: a server restarted on another port left the dead one's files holding their
hugepages (3.9 GB) and then failed its own preflight. Now every dead owner's file on the mount is
reclaimed; a live owner is recognised by its pid and start time, and also by the flock it holds on
each file while mapped (which still works when its pid means nothing here: another pid namespace).
Real hugetlbfs (see conftest.py), real child processes.
"""

import fcntl
import os

from sglang_cp import doctor
from sglang_cp.l2.allocator import HugepageHostAllocator, HugepageL2Config
from sglang_cp.l2.slab_files import SlabFileName, scan, stale_files
from slab_owner import slab_owner as _child


def test_a_server_on_another_port_reclaims_a_dead_servers_slabs(hugetlbfs_dir):
    p = _child(hugetlbfs_dir, "p30000", "crash")
    assert p.stdout.readline().strip() == "ready"
    p.wait(timeout=60)
    (left,) = scan(hugetlbfs_dir)
    assert [s[0] for s in stale_files(hugetlbfs_dir)] == [left[0]]
    rows = {r.item: r for r in doctor._stale_l2_rows(hugetlbfs_dir)}
    assert "namespaces p30000" in rows[f"{hugetlbfs_dir}: stale L2 slabs"].detail
    alloc = HugepageHostAllocator(HugepageL2Config(hugetlbfs_dir, 480, "p30001", 0))
    assert alloc.reclaimed == [left[0]] and scan(hugetlbfs_dir) == []


def test_a_live_server_on_another_port_is_left_alone(hugetlbfs_dir):
    p = _child(hugetlbfs_dir, "p30000", "live")
    try:
        assert p.stdout.readline().strip() == "ready"
        alloc = HugepageHostAllocator(HugepageL2Config(hugetlbfs_dir, 480, "p30001", 0))
        assert alloc.reclaimed == [] and len(scan(hugetlbfs_dir)) == 1 and stale_files(hugetlbfs_dir) == []
    finally:
        p.kill()
        p.wait(timeout=60)


def test_a_locked_file_whose_pid_is_not_alive_here_is_left_alone(hugetlbfs_dir):
    # As a live server in another pid namespace looks from here: its pid/start time do not match
    # any process we can see, but it holds the owner lock of its file.
    name = SlabFileName("p30002", 0, "kv-mla", "layer_first-0", 0, 1, 2**22 - 1, 1).format()
    path = os.path.join(hugetlbfs_dir, name)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not SlabFileName.parse(name).owner_alive()
        alloc = HugepageHostAllocator(HugepageL2Config(hugetlbfs_dir, 480, "p30001", 0))
        assert alloc.reclaimed == [] and os.path.exists(path)
    finally:
        os.close(fd)  # the "owner" dies: its lock goes with it
    alloc2 = HugepageHostAllocator(HugepageL2Config(hugetlbfs_dir, 480, "p30003", 0))
    assert alloc2.reclaimed == [path] and not os.path.exists(path)
