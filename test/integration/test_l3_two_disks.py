"""rank_to_disk on two real block devices: two loop devices (losetup, each on an image file) with an
ext4 filesystem each, CP=2 with KV sharding through upstream's storage path. The map is crossed on
purpose (rank 0 -> d1, rank 1 -> d0), so the default rank % disks placement would put both ranks on
the wrong device. Checked: every slab file's st_dev, each filesystem's used bytes, each loop device's
own I/O counters over a restart and cold read, and the one shared index naming the right disk per
entry. Needs root, losetup, mkfs.ext4, mount and umount; skipped (with the reason) otherwise. The
fixture detaches what it attached on every exit path, each step bounded."""

import logging
import os
import shutil
import subprocess

import pytest

from benchmark.support.cp_harness import run_ranks
from cp_scenarios import roundtrip

CONFIG = """\
[index]
dir = "{root}/index"
map_size_gb = 0.05

[durability]
plp_policy = "ignore"

[[disks]]
name = "d0"
path = "{d0}"
capacity_gb = 0.04

[[disks]]
name = "d1"
path = "{d1}"
capacity_gb = 0.03

[rank_to_disk]
"0" = "d1"
"1" = "d0"
"""
DISK_OF_RANK = {0: "d1", 1: "d0"}
TOOLS = ("losetup", "mkfs.ext4", "mount", "umount")
STEP_S = 60  # bound on every losetup/mkfs/mount/umount call


def _run(cmd, timeout=STEP_S):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _detach(mounts, loops):
    """Unmount, then detach; lazy unmount if a straggler still holds a file. Returns what is left."""
    left = []
    for m in reversed(mounts):
        try:
            if _run(["umount", m]).returncode != 0:
                _run(["umount", "-l", m])
        except subprocess.TimeoutExpired:
            _run(["umount", "-l", m])
        if os.path.ismount(m):
            left.append(f"mount {m}")
    for dev in reversed(loops):
        try:
            _run(["losetup", "-d", dev])  # a still-busy device is set to autoclear by the kernel
        except subprocess.TimeoutExpired:
            pass
        if os.path.exists(f"/sys/block/{os.path.basename(dev)}/loop/backing_file") and \
                _read(f"/sys/block/{os.path.basename(dev)}/loop/autoclear") != "1":
            left.append(f"loop device {dev}")
    return left


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@pytest.fixture
def two_devices(disk_tmp):
    """[(mount dir, loop device name)] x 2: two ext4 filesystems on two loop devices."""
    missing = [t for t in TOOLS if not shutil.which(t)]
    if os.geteuid() != 0 or missing:
        pytest.skip(f"needs root and {', '.join(TOOLS)} (two loop devices with a filesystem each); "
                    f"euid {os.geteuid()}, missing: {', '.join(missing) or 'none'}")
    loops, mounts = [], []
    try:
        for i in range(2):
            img, mnt = disk_tmp / f"dev{i}.img", disk_tmp / f"mnt{i}"
            with open(img, "wb") as f:
                f.truncate(96 << 20)
            p = _run(["losetup", "--find", "--show", "--direct-io=on", str(img)])
            if p.returncode != 0:
                pytest.skip(f"losetup cannot attach a loop device here: {p.stderr.strip()}")
            loops.append(p.stdout.strip())
            p = _run(["mkfs.ext4", "-q", "-F", loops[-1]])
            if p.returncode != 0:
                pytest.skip(f"mkfs.ext4 failed on {loops[-1]}: {p.stderr.strip()}")
            mnt.mkdir()
            p = _run(["mount", "-o", "nosuid,nodev,noexec", loops[-1], str(mnt)])
            if p.returncode != 0:
                pytest.skip(f"cannot mount {loops[-1]} here: {p.stderr.strip()}")
            mounts.append(str(mnt))
        yield [(m, os.path.basename(dev)) for m, dev in zip(mounts, loops)]
    finally:
        left = _detach(mounts, loops)
        assert not left, f"could not clean up: {left}"


def _io(dev):
    """(bytes read, bytes written) by the device, cumulative over its life (/sys/block/<dev>/stat): use deltas."""
    f = _read(f"/sys/block/{dev}/stat").split()
    return int(f[2]) * 512, int(f[6]) * 512


def _used(mount):
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _slabs(mount):
    """{file name: (st_dev, allocated bytes)} of the store's files on a mount."""
    d = os.path.join(mount, "sglang-cp-l3")
    out = {}
    for f in sorted(os.listdir(d)):
        st = os.lstat(os.path.join(d, f))
        out[f] = (st.st_dev, st.st_blocks * 512)
    return out


def test_ranks_use_the_devices_rank_to_disk_names(disk_tmp, two_devices):
    (m0, loop0), (m1, loop1) = two_devices
    mount = {"d0": m0, "d1": m1}
    loop = {"d0": loop0, "d1": loop1}
    dev = {os.stat(m0).st_dev: "d0", os.stat(m1).st_dev: "d1"}
    assert len(dev) == 2 and os.stat(disk_tmp).st_dev not in dev, "the two mounts must be distinct devices"
    root = disk_tmp / "l3"
    (root / "index").mkdir(parents=True)
    cfg = root / "l3.toml"
    cfg.write_text(CONFIG.format(root=root, d0=m0, d1=m1))
    used_before = {d: _used(m) for d, m in mount.items()}

    n_pages = 7  # odd: the ranks own 4 and 3 pages, so each device's I/O tells which rank did it
    first = run_ranks(2, roundtrip, (str(cfg), True, n_pages, 0))
    io_mid = {d: _io(x) for d, x in loop.items()}
    # A restart (cold start "load" reads this rank's headers) and a read of every page from its slot.
    again = run_ranks(2, roundtrip, (str(cfg), True, n_pages, 0, "load", False))
    io_end = {d: _io(x) for d, x in loop.items()}
    owned = {}
    for res in (first, again):
        for r in res:
            assert r["hit"] == r["completed"] == n_pages * 64 and r["equal"] == r["checked"] > 0, r
            owned[r["rank"]] = r["owners"].count(r["rank"])
            assert r["checked"] == owned[r["rank"]], r
    assert sorted(owned.values()) == [3, 4], owned

    # Each rank's files are on the device the map names, and only there.
    slot_sum, entries_per_page = {}, {}
    for d, m in mount.items():
        files = _slabs(m)
        rank = next(r for r, x in DISK_OF_RANK.items() if x == d)
        assert files and all(f.startswith(f"r{rank}.") for f in files), (d, files)
        assert all(dev[st_dev] == d for st_dev, _ in files.values()), (d, files)
        slabs = [f for f in files if f.endswith(".slab")]
        slot_sum[rank] = sum(int(f.rsplit(".", 2)[1][1:]) for f in slabs)  # r<rank>.<payload>.s<slot>.slab
        entries_per_page[rank] = len(slabs)
        # Per-disk used bytes: the growth of each filesystem is this rank's files (slabs preallocated to
        # the disk's capacity_gb), give or take a few metadata blocks; the other rank's slab is not there.
        alloc = sum(b for _, b in files.values())
        cap = {"d0": 0.04e9, "d1": 0.03e9}[d]
        assert cap - slot_sum[rank] < alloc <= cap + (1 << 20), (d, alloc, files)
        assert alloc <= _used(m) - used_before[d] <= alloc + (1 << 20), (d, alloc, _used(m) - used_before[d])

    # Each device's own I/O: the cold read after the restart read exactly this rank's pages (whole slot
    # extents, O_DIRECT) plus at most the 4 KiB header blocks the cold start read, plus a little
    # filesystem metadata; never the other rank's pages (4 vs 3 pages of slot_sum bytes apart).
    for d, x in loop.items():
        rank = next(r for r, y in DISK_OF_RANK.items() if y == d)
        pages_b = owned[rank] * slot_sum[rank]
        headers_b = owned[rank] * entries_per_page[rank] * 4096
        read_b = io_end[d][0] - io_mid[d][0]
        assert pages_b <= read_b <= pages_b + headers_b + (64 << 10), (d, rank, read_b, pages_b, headers_b)
        assert io_mid[d][1] >= pages_b, (d, rank, io_mid[d][1], pages_b)  # the first run wrote them there

    # One index for both ranks, on index.dir (not on either device), each entry naming its rank's disk.
    import lmdb

    from sglang_cp.l3.format.index import IndexEntry, key_prefix

    assert not any(os.path.exists(os.path.join(m, "data.mdb")) for m in mount.values())
    env = lmdb.open(str(root / "index"), readonly=True, lock=False, subdir=True)
    try:
        with env.begin() as txn:
            for rank, disk in DISK_OF_RANK.items():
                n = 0
                cur = txn.cursor()
                if cur.set_range(key_prefix(rank)):
                    for k, v in cur:
                        if not k.startswith(key_prefix(rank)):
                            break
                        e = IndexEntry.unpack(v)
                        assert (e.rank, e.disk) == (rank, int(disk[1])), (rank, e)
                        n += 1
                assert n == owned[rank] * entries_per_page[rank], (rank, n, owned)
    finally:
        env.close()


def test_two_loop_devices_on_one_disk_warn_that_they_share_it(disk_tmp, two_devices, caplog, monkeypatch):
    """Both image files sit on the disk under the test dir: the config loader resolves each loop device
    to its backing file's disk and says that rank_to_disk spreads no I/O here. Distinct st_dev alone
    would not show it."""
    from sglang_cp.l3 import config as cfgmod
    from sglang_cp.l3 import load_l3_config
    from sglang_cp.l3.devices import disk_chain

    (m0, loop0), (m1, loop1) = two_devices
    under = disk_chain(str(disk_tmp))
    if not under:
        pytest.skip(f"sysfs does not name the block device under {disk_tmp}")
    assert disk_chain(m0) == (loop0, under[-1]) and disk_chain(m1) == (loop1, under[-1])
    (disk_tmp / "index").mkdir()
    cfg = disk_tmp / "l3.toml"
    cfg.write_text(CONFIG.format(root=disk_tmp, d0=m0, d1=m1))
    monkeypatch.setattr(cfgmod, "_warned_shared", set())
    with caplog.at_level(logging.WARNING, logger="sglang_cp.l3.config"):
        load_l3_config(str(cfg))
    msgs = [r.getMessage() for r in caplog.records if "rank_to_disk maps to them" in r.getMessage()]
    assert len(msgs) == 1 and f"the same disk {under[-1]} (through {loop0} -> {under[-1]} and {loop1}" in msgs[0], \
        caplog.text
