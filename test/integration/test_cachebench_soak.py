"""`sglang-cp cachebench --soak MINUTES` as a real process (issue 27, item 2): epochs of real rank
processes on one L3 directory whose capacity is below the working set (GC reclaims all the time),
a rank SIGKILLed mid-epoch and every restart with cold start `load`, the invariants checked and
printed (soak.json). CI runs the smallest soak (one kill, one restart, one rank process: ~30 s); the
one-minute soak with two ranks (fresh, restart, kill, restart: ~3-4 min here) is slow-marked."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("--layers", "2", "--system-prompts", "1", "--system-tokens", "256", "--documents", "4",
        "--doc-tokens-min", "256", "--doc-tokens-max", "512", "--sessions", "4", "--turns", "2",
        "--turn-tokens", "128")


def soak(out, *args, timeout=900):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "sglang_cp.cli", "cachebench", "--out-dir", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    path = os.path.join(out, "soak.json")
    res = None
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    return proc, res


def _assert_invariants(proc, res):
    assert res is not None, proc.stdout[-4000:] + proc.stderr[-4000:]
    failed = [c for c in res["checks"] if not c["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-4000:])
    assert [c["invariant"] for c in res["checks"]] == [
        "every request answered", "bytes checked, ranks agree",
        "spilled - spill_replaced - gc_reclaimed - bad_pages_dropped == live growth",
        "no error counter moved; no load dropped a page", "GC under pressure",
        "memory bounded (RSS, staging, LMDB map)", "l3 fsck clean after the final stop"]
    for c in res["checks"]:
        assert f"ok {c['invariant']}" in proc.stdout  # printed, not only written
    ep = res["epochs"]
    assert all(e["cold_start"] == "load" for e in ep[1:])
    for prev, e in zip(ep, ep[1:]):  # no request skipped: each epoch starts where the last one stopped
        assert e["first_request"] == prev["first_request"] + prev["answered"]
    for e in ep:
        if e["killed"]:
            assert 0 < e["answered"] < e["planned"] and e["retried"] == 1 and e["killed_after_s"] is not None, e
        else:
            assert e["answered"] == e["planned"] and e["ranks"], e
            for r in e["ranks"]:
                assert r["live_end"] - r["live_start"] == r["balance"], r
    return ep


def test_smallest_soak_kill_then_restart(tmp_path):
    proc, res = soak(tmp_path / "out", "--soak", "0", "--soak-capacity", "0.25", "--cp-size", "1", *TINY)
    ep = _assert_invariants(proc, res)
    assert [e["kind"] for e in ep] == ["kill", "restart"] and ep[0]["killed"]
    assert sum(r["gc_reclaimed"] for r in ep[1]["ranks"]) > 0
    print("\n" + proc.stdout[proc.stdout.index("cachebench soak"):])


def test_soak_usage_errors_exit_2_before_any_rank_starts(tmp_path):
    for args in (("--soak", "-1"), ("--soak", "1", "--soak-capacity", "0"),
                 ("--soak", "1", "--cp-l3-cold-start", "load")):
        proc, res = soak(tmp_path / "out", *args, timeout=120)
        assert proc.returncode == 2 and res is None, proc.stdout + proc.stderr
        assert "--soak" in proc.stdout


@pytest.mark.slow
def test_one_minute_soak_with_two_ranks(tmp_path):
    proc, res = soak(tmp_path / "out", "--soak", "1", "--soak-epoch-s", "20", "--cp-size", "2", timeout=1200)
    ep = _assert_invariants(proc, res)
    kinds = [e["kind"] for e in ep]
    assert kinds[:4] == ["fresh", "restart", "kill", "restart"] and kinds[-1] != "kill", kinds
    print("\n" + proc.stdout[proc.stdout.index("cachebench soak"):])
