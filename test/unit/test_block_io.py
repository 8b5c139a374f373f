"""benchmark/support/block_io.py against the kernel's counters: an O_DIRECT read of a file on a real
disk shows up as the device's reads; a path on a filesystem without a block device says so."""

from __future__ import annotations

import mmap
import os

import pytest

from benchmark.support import block_io

MB = 1 << 20


def test_an_odirect_read_is_counted_as_the_devices_reads(disk_tmp):
    p = str(disk_tmp / "blob")
    if block_io.counters(p if os.path.exists(p) else str(disk_tmp)) is None:
        pytest.skip("no block-device counters for this filesystem")
    buf = mmap.mmap(-1, 16 * MB)
    buf.write(os.urandom(16 * MB))
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        pytest.skip(f"O_DIRECT refused here: {e}")
    try:
        os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    before = block_io.counters(p)
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.readv(fd, [buf]) == 16 * MB
    finally:
        os.close(fd)
    got = block_io.delta(before, block_io.counters(p))
    assert got["read"] >= 16 * MB  # the whole file came from the device (and whatever else read it meanwhile)
    assert before["written"] >= 16 * MB


def test_no_block_device_no_counters(tmp_path):
    assert block_io.counters("/proc/self/status") is None  # procfs: major 0
    assert block_io.counters(str(tmp_path / "absent")) is None
    assert block_io.delta(None, {"read": 1, "written": 2}) is None
