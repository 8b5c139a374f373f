"""Two [[disks]] entries on one device: a startup warning, not an error (docs_internal/l3_store.md,
"Two [[disks]] on one device"). The device resolution follows sysfs: partitions to their disk,
single-member dm/md devices to the member, loop devices to their backing file's disk
(test/integration/test_l3_two_disks.py runs it on real loop devices)."""

import logging
import os

import pytest

from l3_helpers import config_doc
from sglang_cp.l3 import config as cfgmod
from sglang_cp.l3 import parse_l3_config
from sglang_cp.l3.devices import disk_chain, shared_device


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(cfgmod, "_warned_shared", set())


def _shared_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "rank_to_disk maps to them" in r.getMessage()]


def test_two_disks_on_one_filesystem_warn_once(l3_root, caplog):
    doc = config_doc(l3_root, two_disks=True)
    with caplog.at_level(logging.WARNING, logger="sglang_cp.l3.config"):
        parse_l3_config(doc)
        parse_l3_config(doc)  # a second load in the same process says nothing new
    msgs = _shared_warnings(caplog)
    assert len(msgs) == 1, caplog.text
    d0, d1 = (os.path.join(l3_root, d) for d in ("d0", "d1"))
    assert f"disks[0].path '{d0}'" in msgs[0] and f"disks[1].path '{d1}'" in msgs[0], msgs[0]
    assert "the same filesystem (device " in msgs[0] and "one [[disks]] entry per device" in msgs[0], msgs[0]


def test_one_disk_does_not_warn(l3_root, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_cp.l3.config"):
        parse_l3_config(config_doc(l3_root))
    assert not _shared_warnings(caplog), caplog.text


def test_distinct_devices_do_not_warn(l3_root, caplog):
    other = "/dev/shm"  # tmpfs: another st_dev and no block device under it
    if not (os.path.isdir(other) and os.access(other, os.W_OK)) or os.stat(other).st_dev == os.stat(l3_root).st_dev:
        pytest.skip("no writable directory on another device than the test dir")
    doc = config_doc(l3_root, two_disks=True)
    doc["disks"][1]["path"] = other
    with caplog.at_level(logging.WARNING, logger="sglang_cp.l3.config"):
        parse_l3_config(doc)
    assert not _shared_warnings(caplog), caplog.text
    assert shared_device(l3_root, other) is None


def test_real_disk_chain_ends_at_a_block_device(l3_root):
    chain = disk_chain(l3_root)
    if not chain:
        pytest.skip(f"sysfs does not name the block device under {l3_root} (overlay, tmpfs, no /sys)")
    assert os.path.isdir(os.path.join("/sys/block", chain[-1])), chain


def _fake_node(sys_root, dev_t, node):
    link = sys_root / "dev" / "block" / f"{os.major(dev_t)}:{os.minor(dev_t)}"
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(node, link)


def test_chain_through_partition_and_single_member_dm(tmp_path):
    """sysfs-shaped tree for the parsing: a dm device whose one member is partition nvme9n1p2."""
    target = tmp_path / "t"
    target.mkdir()
    sys_root = tmp_path / "sys"
    disk = sys_root / "devices" / "nvme9n1"
    part = disk / "nvme9n1p2"
    part.mkdir(parents=True)
    (part / "partition").write_text("2\n")
    dm = sys_root / "devices" / "virtual" / "dm-7"
    (dm / "slaves").mkdir(parents=True)
    os.symlink(part, dm / "slaves" / "nvme9n1p2")
    _fake_node(sys_root, os.stat(target).st_dev, dm)
    assert disk_chain(str(target), sys_root=str(sys_root)) == ("dm-7", "nvme9n1")


def test_chain_of_a_path_sysfs_does_not_know_is_empty(tmp_path):
    assert disk_chain(str(tmp_path), sys_root=str(tmp_path / "nosys")) == ()
    assert disk_chain(str(tmp_path / "missing")) == ()
