"""`sglang-cp doctor`, `check-args` and `demo` as a user runs them (real processes, real files)."""

import os
import subprocess
import sys

from sglang_cp.cli import write_demo_config

BIN = os.path.join(os.path.dirname(sys.executable), "sglang-cp")


def run(*args, **kw):
    env = dict(os.environ, COLUMNS="200", PYTHONWARNINGS="ignore")
    env.pop("SGLANG_CP_DISABLE", None)
    return subprocess.run([BIN, *args], capture_output=True, text=True, env=env, timeout=300, **kw)


def test_doctor_on_this_machine_with_a_good_config(disk_tmp):
    cfg = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    p = run("doctor", "--cp-l3-config", cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    for needle in ("sglang", "0.5.23", "torch", "entry point", "upstream targets", "O_DIRECT: write+fdatasync",
                   "LMDB dir writable", "no blocking problems", "cuda"):
        assert needle in p.stdout, needle


def test_doctor_fails_on_a_bad_config_naming_the_field(disk_tmp):
    cfg = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    text = open(cfg).read().replace('name = "local0"', 'name = "local0"\nspeed = 3')
    open(cfg, "w").write(text)
    p = run("doctor", "--cp-l3-config", cfg)
    assert p.returncode == 1
    assert "disks[0].speed" in p.stdout and "blocking problem" in p.stdout


def test_doctor_fails_when_hugepages_are_asked_for_but_missing(tmp_path):
    p = run("doctor", "--enable-cp-shared-physical-l2-hicache", "--cp-shared-l2-hugetlbfs-dir",
            str(tmp_path), "--hicache-size", "10")
    assert p.returncode == 1
    assert "FAIL" in p.stdout


def test_check_args_accepts_and_rejects_through_sglangs_parser(disk_tmp):
    cfg = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    ok = run("check-args", "--", "--model-path", "dummy", "--enable-hierarchical-cache", "--enable-cp-l3",
             "--cp-l3-config", cfg)
    assert ok.returncode == 0 and "accepted" in ok.stdout and "sglang_cp_l3" in ok.stdout
    bad = run("check-args", "--", "--model-path", "dummy", "--enable-cp-l3", "--cp-l3-config", cfg)
    assert bad.returncode == 2 and "needs --enable-hierarchical-cache" in bad.stdout


def test_demo_is_the_readme_main_job(tmp_path):
    p = run("demo", "--out-dir", str(tmp_path / "demo"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "accepted" in p.stdout and "rejected" in p.stdout and "gc.low_watermark" in p.stdout
