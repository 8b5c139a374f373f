"""`--enable-cp-shared-physical-l2-hicache` on a real server: hugetlbfs-backed host pool.

Needs root (to reserve 2 MiB hugepages and mount a hugetlbfs); skips otherwise. The host
pool of the server comes from slab files on the mount, at most 1 GiB each; a prompt then
hits the device, and after ``/flush_cache`` comes back from L3 through that host pool with
identical output ids. With too few hugepages the server stops at startup with the fix.
"""

from __future__ import annotations

import os
import stat

import pytest
from hugepage_support import HOST_POOL_GB, NR, avail as _avail, read_int as _read, write_int as _write
from server_support import base_dir, l3_flags, pages_of, prompt, server, write_l3_config

# Both tests change vm.nr_hugepages: under pytest-xdist they share one worker. The hugetlbfs
# fixture is in conftest.py (the soak test uses it too).
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("hugepages")]


def _l2_flags(mnt):
    return ["--enable-cp-shared-physical-l2-hicache", "--cp-shared-l2-hugetlbfs-dir", mnt,
            "--cp-hicache-max-slab-gb", "1"]


def test_hugepage_l2_serves_and_reloads(hugetlbfs, tmp_path_factory):
    root = base_dir(tmp_path_factory, "l2")
    cfg = write_l3_config(root)
    P = prompt(4096, 11)
    avail0 = _avail()
    with server("mla", l3_flags(cfg, "clear") + _l2_flags(hugetlbfs), root, "l2") as s:
        files = [os.path.join(hugetlbfs, f) for f in os.listdir(hugetlbfs)]
        assert files, "no slab files on the hugetlbfs mount"
        for f in files:
            st = os.lstat(f)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, (f, oct(st.st_mode))
            assert st.st_size <= (1 << 30), (f, st.st_size)
        assert sum(os.lstat(f).st_size for f in files) >= HOST_POOL_GB * 10**9 * 0.9
        assert avail0 - _avail() >= HOST_POOL_GB * 10**9 * 0.9 / (2 << 20), "host pool not on hugepages"
        a = s.generate(P)
        b = s.generate(P)
        assert b.device_tokens == pages_of(4096) * 64, b.meta_info
        s.wait_metric("sglang:cp_l3_spill_pages_total", lambda v: v >= pages_of(4096), 60)
        s.flush_cache()
        c = s.generate(P)
        assert c.storage_tokens == pages_of(4096) * 64, c.meta_info
    assert a.output_ids == b.output_ids == c.output_ids


def test_hugepage_l2_refuses_to_start_when_hugepages_are_short(hugetlbfs, tmp_path_factory):
    root = base_dir(tmp_path_factory, "l2short")
    cfg = write_l3_config(root)
    before = _read(NR)
    _write(NR, max(0, before - _avail() + 16))  # leave 16 free pages (32 MiB)
    try:
        srv = server("mla", l3_flags(cfg, "clear") + _l2_flags(hugetlbfs), root, "l2short")
        srv.spawn()
        rc = srv.wait_exit(400)
        srv.stop()
        log = srv.log_text()
        assert rc not in (None, 0), "the server started on too few hugepages"
        assert "InsufficientHugepagesError" in log and "vm.nr_hugepages" in log, srv.log_tail(30)
    finally:
        _write(NR, before)
