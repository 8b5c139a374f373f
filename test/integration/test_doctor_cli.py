"""`sglang-cp doctor`, `check-args` and `demo` as a user runs them (real processes, real files)."""

import os
import sys

import pytest

from suite_helpers import run_all
from sglang_cp.check_args import OFFLINE_ENV
from sglang_cp.cli import write_demo_config

BIN = os.path.join(os.path.dirname(sys.executable), "sglang-cp")
# doctor reads every hugetlbfs mount of the host: not while another worker's test has one (conftest.py).
pytestmark = pytest.mark.xdist_group("hugepages")


def cmd(*args):
    """A `sglang-cp` run as a run_all job. check-args sets OFFLINE_ENV (setdefault) before it imports sglang
    (suite_helpers.run_job's sets_env); demo imports sglang in its doctor step first, then sets them: a new
    interpreter (a zygote's job may not change what upstream's imports read)."""
    env = dict(os.environ, COLUMNS="200", PYTHONWARNINGS="ignore")
    env.pop("SGLANG_CP_DISABLE", None)
    how = {"check-args": {"sets_env": OFFLINE_ENV}, "demo": {"fresh_interpreter": True}}.get(args[0], {})
    return [BIN, *args], {"env": env, **how}


def run(*args):
    """One `sglang-cp` run, now (for tests that must run it while something else holds a resource)."""
    return run_all({"one": cmd(*args)}, timeout=300)["one"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every CLI run of this module, started together (independent processes, each its own files)."""
    good = write_demo_config(str(tmp_path_factory.mktemp("disk") / "l3"), capacity_gb=0.05)
    bad = write_demo_config(str(tmp_path_factory.mktemp("disk") / "l3"), capacity_gb=0.05)
    with open(bad) as f:
        text = f.read()
    with open(bad, "w") as f:
        f.write(text.replace('name = "local0"', 'name = "local0"\nspeed = 3'))
    return run_all({
        "doctor_good": cmd("doctor", "--cp-l3-config", good),
        "doctor_bad": cmd("doctor", "--cp-l3-config", bad),
        "doctor_huge": cmd("doctor", "--enable-cp-shared-physical-l2-hicache", "--cp-shared-l2-hugetlbfs-dir",
                           str(tmp_path_factory.mktemp("nothuge")), "--hicache-size", "10"),
        "check_ok": cmd("check-args", "--", "--model-path", "dummy", "--enable-hierarchical-cache", "--enable-cp-l3",
                        "--cp-l3-config", good),
        "check_bad": cmd("check-args", "--", "--model-path", "dummy", "--enable-cp-l3", "--cp-l3-config", good),
        "demo": cmd("demo", "--out-dir", str(tmp_path_factory.mktemp("demo") / "demo")),
    }, timeout=300)


def test_doctor_on_this_machine_with_a_good_config(runs):
    p = runs["doctor_good"]
    assert p.returncode == 0, p.stdout + p.stderr
    for needle in ("sglang", "0.5.23", "torch", "entry point", "upstream targets", "O_DIRECT: write+fdatasync",
                   "LMDB dir writable", "no blocking problems", "cuda"):
        assert needle in p.stdout, needle


def test_doctor_fails_on_a_bad_config_naming_the_field(runs):
    p = runs["doctor_bad"]
    assert p.returncode == 1
    assert "disks[0].speed" in p.stdout and "blocking problem" in p.stdout


def test_doctor_fails_when_hugepages_are_asked_for_but_missing(runs):
    p = runs["doctor_huge"]
    assert p.returncode == 1
    assert "FAIL" in p.stdout


def test_check_args_accepts_and_rejects_through_sglangs_parser(runs):
    ok, bad = runs["check_ok"], runs["check_bad"]
    assert ok.returncode == 0 and "accepted" in ok.stdout and "sglang_cp_l3" in ok.stdout
    assert bad.returncode == 2 and "needs --enable-hierarchical-cache" in bad.stdout


def test_demo_is_the_readme_main_job(runs):
    p = runs["demo"]
    assert p.returncode == 0, p.stdout + p.stderr
    assert "accepted" in p.stdout and "rejected" in p.stdout and "gc.low_watermark" in p.stdout
