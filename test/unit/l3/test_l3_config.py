"""Config schema + semantics: every error names the TOML field path and the fix."""

import logging
import os

import pytest

from l3_helpers import config_doc
from sglang_cp.l3 import L3ConfigError, load_l3_config, parse_l3_config
from sglang_cp.l3 import config as cfgmod
from sglang_cp.l3.plp import probe_write_cache


def write_toml(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def test_full_example_with_defaults(l3_root, tmp_path):
    p = write_toml(tmp_path / "l3.toml", f"""
[index]
dir = "{l3_root}/idx"
[durability]
plp_policy = "ignore"
[[disks]]
name = "nvme0"
path = "{l3_root}/d0"
capacity_gb = 2
[[disks]]
name = "nvme1"
path = "{l3_root}/d1"
capacity_gb = 1.5
[rank_to_disk]
"0" = "nvme1"
[slot_bytes]
target_kv = 3280896
""")
    c = load_l3_config(str(p))
    # Map sizes are rounded up to the 4 KiB page LMDB needs.
    assert c.index.map_size_bytes == 1000001536 and c.index.max_map_size_bytes == 16 * 10**9
    assert (c.gc.high_watermark, c.gc.low_watermark, c.gc.max_reclaim_per_iter) == (0.90, 0.85, 64)
    assert (c.io.threads, c.io.max_inflight_pages) == (4, 64)
    assert [d.capacity_bytes for d in c.disks] == [2 * 10**9, 1.5 * 10**9]
    assert c.disk_index_for_rank(0) == 1          # mapped explicitly
    assert c.disk_index_for_rank(1) == 1          # default r % len(disks)
    assert c.disk_index_for_rank(2) == 0
    assert c.slot_bytes == {"target_kv": 3280896}


def bad(l3_root, mutate):
    doc = config_doc(l3_root, two_disks=True)
    mutate(doc)
    with pytest.raises(L3ConfigError) as e:
        parse_l3_config(doc)
    return str(e.value)


@pytest.mark.parametrize("mutate, field, fix", [
    (lambda d: d["index"].update(map_sise_gb=1.0), "index.map_sise_gb", "did you mean 'map_size_gb'"),
    (lambda d: d.update(gcc={}), "gcc", "did you mean 'gc'"),
    (lambda d: d["disks"][1].update(capacty_gb=1), "disks[1].capacty_gb", "did you mean 'capacity_gb'"),
    (lambda d: d["disks"][1].update(capacity_gb="10"), "disks[1].capacity_gb", "must be a number"),
    (lambda d: d["disks"][1].pop("capacity_gb"), "disks[1].capacity_gb", "required key is missing"),
    (lambda d: d["disks"][0].update(capacity_gb=0), "disks[0].capacity_gb", "must be > 0"),
    (lambda d: d["io"].update(threads=2.5), "io.threads", "must be an integer"),
    (lambda d: d["io"].update(threads=True), "io.threads", "must be an integer"),
    (lambda d: d["io"].update(max_inflight_pages=0), "io.max_inflight_pages", ">= 1"),
    (lambda d: d.pop("index"), "[index]", "required table is missing"),
    (lambda d: d["index"].pop("dir"), "index.dir", "required key is missing"),
    (lambda d: d["index"].update(map_size_gb=0), "index.map_size_gb", "must be > 0"),
    (lambda d: d["index"].update(map_size_gb=-1.0), "index.map_size_gb", "must be > 0"),
    (lambda d: d["index"].update(map_size_gb=2.0, max_map_size_gb=1.0), "index.max_map_size_gb", "raise it"),
    (lambda d: d.update(disks=[]), "disks", "non-empty"),
    (lambda d: d.pop("disks"), "disks", "at least one"),
    (lambda d: d["disks"][1].update(name="d0"), "disks[1].name", "duplicates disks[0].name"),
    (lambda d: d["disks"][1].update(path=d["disks"][0]["path"] + "/"), "disks[1].path", "same directory as disks[0]"),
    (lambda d: d["gc"].update(high_watermark=0.8, low_watermark=0.85), "gc.low_watermark", "must be below"),
    (lambda d: d["gc"].update(high_watermark=1.2), "gc.high_watermark", "(0, 1]"),
    (lambda d: d["gc"].update(low_watermark=0.0), "gc.low_watermark", "(0, 1]"),
    (lambda d: d["gc"].update(max_reclaim_per_iter=0), "gc.max_reclaim_per_iter", ">= 1"),
    (lambda d: d.update(slot_bytes={"target_kv": 3276801}), "slot_bytes.target_kv", "use 3280896"),
    (lambda d: d.update(slot_bytes={"target_kv": "4096"}), "slot_bytes.target_kv", "must be an integer"),
    (lambda d: d.update(rank_to_disk={"0": "d2"}), 'rank_to_disk."0"', "unknown disk 'd2'"),
    (lambda d: d.update(rank_to_disk={"x": "d0"}), "rank_to_disk", "rank numbers"),
    (lambda d: d["durability"].update(plp_policy="maybe"), "durability.plp_policy", "require, warn, ignore"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_errors_name_field_and_fix(l3_root, mutate, field, fix):
    msg = bad(l3_root, mutate)
    assert msg.startswith(field) or field in msg, msg
    assert fix in msg, msg


def test_gc_needs_table(l3_root):
    doc = config_doc(l3_root)
    doc["gc"] = 5
    with pytest.raises(L3ConfigError, match=r"^gc: must be a table"):
        parse_l3_config(doc)


def test_paths_must_exist_be_dirs(l3_root):
    msg = bad(l3_root, lambda d: d["disks"][0].update(path=l3_root + "/nope"))
    assert msg.startswith("disks[0].path") and "does not exist" in msg and "mkdir -p" in msg
    open(os.path.join(l3_root, "afile"), "w").close()
    msg = bad(l3_root, lambda d: d["index"].update(dir=l3_root + "/afile"))
    assert msg.startswith("index.dir") and "not a directory" in msg
    msg = bad(l3_root, lambda d: d["disks"][0].update(path="relative/dir"))
    assert "absolute path" in msg


def test_not_writable_directory(l3_root):
    # Root ignores mode bits, so only a read-only mount is a real "not writable" for root.
    ro = os.path.join(l3_root, "ro")
    os.makedirs(ro)
    if os.geteuid() != 0:
        os.chmod(ro, 0o555)
    else:
        import subprocess
        if subprocess.run(["mount", "--bind", ro, ro]).returncode != 0:
            pytest.skip("cannot bind-mount here")
        subprocess.run(["mount", "-o", "remount,ro,bind", ro], check=True)
    try:
        msg = bad(l3_root, lambda d: d["disks"][1].update(path=ro))
        assert msg.startswith("disks[1].path") and "not writable" in msg
    finally:
        if os.geteuid() == 0:
            import subprocess
            subprocess.run(["umount", ro], check=True)


def test_file_level_errors(tmp_path):
    with pytest.raises(L3ConfigError, match="does not exist"):
        load_l3_config(str(tmp_path / "missing.toml"))
    p = write_toml(tmp_path / "bad.toml", "[index\ndir = 1\n")
    with pytest.raises(L3ConfigError, match="not valid TOML"):
        load_l3_config(str(p))
    with pytest.raises(L3ConfigError, match="is a directory"):
        load_l3_config(str(tmp_path))


# -- PLP probe + policy (the real device under /tmp here reports its cache) --------------------------

def fake_sys(tmp_path, dev_t, value, partition=False):
    """A sysfs-shaped tree for the probe's parsing (the real /sys is used in the policy tests)."""
    disk = tmp_path / "sys" / "devices" / "vdx"
    node = disk / "vdx1" if partition else disk
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "write_cache").write_text(value + "\n")
    node.mkdir(parents=True, exist_ok=True)
    if partition:
        (node / "partition").write_text("1\n")
    (tmp_path / "sys" / "dev" / "block").mkdir(parents=True)
    os.symlink(node, tmp_path / "sys" / "dev" / "block" / f"{os.major(dev_t)}:{os.minor(dev_t)}")
    return str(tmp_path / "sys")


@pytest.mark.parametrize("value, volatile, partition", [
    ("write back", True, False), ("write through", False, False), ("write back", True, True)])
def test_probe_parses_sysfs(tmp_path, value, volatile, partition):
    target = tmp_path / "t"
    target.mkdir()
    root = fake_sys(tmp_path, os.stat(target).st_dev, value, partition)
    p = probe_write_cache(str(target), sys_root=root)
    assert p.device == "vdx" and p.volatile is volatile


def test_probe_unknown_device_is_not_volatile(tmp_path):
    p = probe_write_cache(str(tmp_path), sys_root=str(tmp_path / "nosys"))
    assert p.device is None and not p.volatile


def _real_probe(l3_root):
    p = probe_write_cache(os.path.join(l3_root, "d0"))
    if not p.volatile:
        pytest.skip(f"the disk under the test dir does not report a volatile cache ({p})")
    return p


def test_plp_require_refuses_volatile_cache(l3_root):
    p = _real_probe(l3_root)
    doc = config_doc(l3_root, durability={"plp_policy": "require"})
    with pytest.raises(L3ConfigError) as e:
        parse_l3_config(doc)
    assert "durability.plp_policy = 'require'" in str(e.value) and p.device in str(e.value)
    assert "set durability.plp_policy = 'warn'" in str(e.value)


def test_plp_warn_once_and_ignore(l3_root, caplog, monkeypatch):
    p = _real_probe(l3_root)
    monkeypatch.setattr(cfgmod, "_warned_devices", set())
    # What is checked is the loader's own once-per-device rule. The sglang-cp tools add a once-per-boot
    # filter to this logger when their main() runs in a process (an earlier in-process CLI test does):
    # it would drop a text it saw earlier in this boot (pytest reuses temp paths across sessions).
    logger = logging.getLogger("sglang_cp.l3.config")
    monkeypatch.setattr(logger, "filters", [f for f in logger.filters if type(f).__name__ != "OncePerBootFilter"])
    with caplog.at_level(logging.WARNING, logger="sglang_cp.l3.config"):
        parse_l3_config(config_doc(l3_root, durability={"plp_policy": "ignore"}))
        assert not caplog.records
        for _ in range(3):
            c = parse_l3_config(config_doc(l3_root, two_disks=True, durability={"plp_policy": "warn"}))
    warnings = [r for r in caplog.records if "volatile" in r.getMessage()]
    assert len(warnings) == 1, "warn once per device, not per disk entry or per load"
    assert p.device in warnings[0].getMessage()
    assert all(pr.volatile for pr in c.plp_probes)
