"""Operator tools on odd but real directories: a stray slab name, stale slabs, bracketed names.

`sglang-cp l3 fsck` used to crash (EINVAL from an O_DIRECT read of a 1000-byte slot) on a file
named ``r9.kv.s1000.slab``; `sglang-cp doctor` counted every ``*.slab`` under a disk as reusable
free space, stale ones included; and rich took ``[index]`` in a message for markup and dropped it.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

from sglang_cp import doctor
from sglang_cp.cli import write_demo_config
from sglang_cp.l3 import L3Store, load_l3_config
from sglang_cp.l3.tools import fsck

PAGE_BYTES = 16384


def cli(*args, cwd=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "sglang_cp.cli", *args], capture_output=True, text=True,
                          timeout=180, env=env, cwd=cwd)


def _written(root, capacity_gb=0.05):
    cfg_path = write_demo_config(root, capacity_gb=capacity_gb)
    cfg = load_l3_config(cfg_path)
    with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": PAGE_BYTES}) as s:
        assert all(s.write_pages("kv", [b"a", b"b"], [np.full(PAGE_BYTES, i, np.uint8) for i in (1, 2)],
                                 timeout=60))
    return cfg_path, cfg, cfg.slab_dir(cfg.disks[0].path)


def test_fsck_reports_a_stray_slab_name_and_stays_clean(disk_tmp):
    cfg_path, cfg, slabs = _written(str(disk_tmp / "l3"))
    with open(os.path.join(slabs, "r9.kv.s1000.slab"), "wb") as f:
        f.write(b"\1" * 5000)
    rep = fsck.check(cfg)
    assert rep.counts()["stray"] == 1 and rep.problems() == 0 and rep.live == 2
    p = cli("l3", "fsck", "--cp-l3-config", cfg_path, cwd=str(disk_tmp))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "stray: l3/disk0/sglang-cp-l3/r9.kv.s1000.slab: slot size 1000 B" in p.stdout, p.stdout


def test_doctor_does_not_count_stale_slabs_as_free_space(disk_tmp):
    cfg_path, cfg, slabs = _written(str(disk_tmp / "l3"))
    stale = os.path.join(slabs, "r0.kv.s8192.slab")  # an older slot size of the same rank and payload
    fd = os.open(stale, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, 2 * 10**9)
    finally:
        os.close(fd)
    os.utime(stale, (1, 1))  # written before the slab in use
    st = os.statvfs(cfg.disks[0].path)
    free = st.f_bavail * st.f_frsize
    # Needs 1 GB more than is free: only the stale file's 2 GB would make it fit.
    text = open(cfg_path).read().replace("capacity_gb = 0.05", f"capacity_gb = {(free + 10**9) / 1e9:.3f}")
    open(cfg_path, "w").write(text)
    rows = {r.item: r for r in doctor.check_l3_config(cfg_path)}
    assert rows["local0: space"].status == doctor.FAIL, rows["local0: space"]
    assert rows["local0: stale slabs"].status == doctor.WARN
    assert "r0.kv.s8192.slab (older slot size of rank 0 payload kv)" in rows["local0: stale slabs"].detail


def test_doctor_output_keeps_bracketed_names(disk_tmp):
    cfg_path = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    text = open(cfg_path).read()
    open(cfg_path, "w").write(text[text.index("[gc]"):])  # no [index] table
    console = Console(record=True, width=400)
    doctor.render(list(doctor.check_l3_config(cfg_path)), console)
    out = console.export_text()
    assert "[index]: required table is missing" in out, out


def test_fsck_config_error_keeps_bracketed_names(disk_tmp):
    cfg_path = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    text = open(cfg_path).read()
    open(cfg_path, "w").write(text[text.index("[gc]"):])
    p = cli("l3", "fsck", "--cp-l3-config", cfg_path)
    assert p.returncode == 2
    assert "[index]: required table is missing" in p.stdout, p.stdout


def test_help_keeps_one_subcommand_per_line():
    p = cli("--help")
    assert p.returncode == 0
    lines = p.stdout.splitlines()
    for name in ("doctor", "check-args", "demo", "cachebench", "l3 stats", "l3 fsck"):
        assert any(line.startswith(f"  {name} ") for line in lines), (name, p.stdout)


def test_doctor_checks_the_native_library_or_names_the_fix(disk_tmp, monkeypatch):
    """index.digest_threads > 0 and io.read_engine = "native" need the package's native library: doctor
    loads and checks it as the server will, and without it says which field needs it and how to get it."""
    from sglang_cp.l3 import native

    cfg_path = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    text = open(cfg_path).read()
    open(cfg_path, "w").write(text.replace("[index]\n", "[index]\ndigest_threads = 2\n", 1)
                              .replace("[[disks]]\n", '[io]\nread_engine = "native"\n\n[[disks]]\n', 1))
    rows = {r.item: r for r in doctor.check_l3_config(cfg_path)}
    assert rows["digest_threads = 2"].status == doctor.OK and "checked against hashlib" in rows["digest_threads = 2"].detail
    engine = rows["read_engine = native"]
    assert engine.status in (doctor.OK, doctor.WARN) and "native library" in engine.detail, engine
    # a fast-drive engine: the switch interval's advice, INFO (never a failure)
    hint = rows["gil_switch_interval_ms = 0"]
    assert hint.status == doctor.INFO and "set it to 0.5" in hint.detail, hint
    text = open(cfg_path).read()
    open(cfg_path, "w").write(text.replace('read_engine = "native"\n', 'read_engine = "native"\ngil_switch_interval_ms = 0.5\n'))
    rows = {r.item: r for r in doctor.check_l3_config(cfg_path)}
    assert rows["gil_switch_interval_ms = 0.5"].status == doctor.INFO, rows
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "library_path", lambda: None)
    rows = {r.item: r for r in doctor.check_l3_config(cfg_path)}
    for item, field in (("digest_threads = 2", "index.digest_threads"), ("read_engine = native", "io.read_engine")):
        row = rows[item]
        assert row.status == doctor.FAIL and f"{field}" in row.detail and "reinstall sglang-cp" in row.detail, row
