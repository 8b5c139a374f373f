"""rank_to_disk on two real devices: two loop-mounted ext4 filesystems, CP=2 with KV sharding through
upstream's storage path. Each rank's slab and I/O must land on the device the map names (crossed on
purpose, so the default rank % disks placement would put both on the wrong one). Needs root, losetup
and mkfs.ext4; skipped otherwise."""

import os
import shutil
import subprocess

import pytest

from cp_harness import PAGE, run_ranks
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
capacity_gb = 0.04

[rank_to_disk]
"0" = "d1"
"1" = "d0"
"""


@pytest.fixture
def two_devices(disk_tmp):
    if os.geteuid() != 0 or not (shutil.which("losetup") and shutil.which("mkfs.ext4") and shutil.which("mount")):
        pytest.skip("needs root with losetup, mkfs.ext4 and mount (two loop-mounted filesystems)")
    mounts = []
    try:
        for i in range(2):
            img, mnt = disk_tmp / f"dev{i}.img", disk_tmp / f"mnt{i}"
            with open(img, "wb") as f:
                f.truncate(96 << 20)
            subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, timeout=60)
            mnt.mkdir()
            proc = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True,
                                  timeout=60)
            if proc.returncode != 0:
                pytest.skip(f"cannot loop-mount here: {proc.stderr.strip()}")
            mounts.append(str(mnt))
        yield mounts
    finally:
        for m in mounts:
            subprocess.run(["umount", m], timeout=60)


def test_ranks_use_the_devices_rank_to_disk_names(disk_tmp, two_devices):
    d0, d1 = two_devices
    dev = {os.stat(d0).st_dev: "d0", os.stat(d1).st_dev: "d1"}
    assert len(dev) == 2 and os.stat(disk_tmp).st_dev not in dev, "the two mounts must be distinct devices"
    (disk_tmp / "l3" / "index").mkdir(parents=True)
    cfg = disk_tmp / "l3" / "l3.toml"
    cfg.write_text(CONFIG.format(root=disk_tmp / "l3", d0=d0, d1=d1))
    n_pages = 6
    res = run_ranks(2, roundtrip, (str(cfg), True, n_pages, 0))
    for r in res:
        assert r["hit"] == r["completed"] == n_pages * PAGE and r["equal"] == r["checked"] > 0, r
        assert r["stats"]["spill_pages"] == n_pages // 2, r
    # Rank 0's slab on d1 and rank 1's on d0, each on its own device; nothing on the wrong one.
    where = {}
    for m in (d0, d1):
        for f in os.listdir(os.path.join(m, "sglang-cp-l3")):
            where[f.split(".")[0]] = dev[os.stat(os.path.join(m, "sglang-cp-l3", f)).st_dev]
    assert where == {"r0": "d1", "r1": "d0"}, where
