"""`sglang-cp cachebench` end to end as a real process: gloo rank processes with upstream's
host pools and controller and our L3, all four phases, the restart with cold start `load`,
and its outputs (exit code, JSON, PNG). CI runs a tiny replay of a JSONL trace; the
README's demo run and `--quick` are the slow-marked tests."""

import json
import os
import subprocess
import sys

import pytest

from sglang_cp.cachebench.workload import WorkloadSpec, generate, write_trace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cachebench(*args, timeout=900):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "sglang_cp.cli", "cachebench", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def _check_result(out_dir, proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(os.path.join(out_dir, "cachebench.json")) as f:
        res = json.load(f)
    with open(os.path.join(out_dir, "cachebench.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert res["errors"] == 0
    ph = res["phases"]
    assert list(ph) == ["warm-up", "pressure", "reload", "restart"]
    for p in ph.values():
        assert p["l2_hit_pages"] + p["l3_hit_pages"] + p["computed_pages"] == p["pages"]
        assert p["rank_divergent_requests"] == 0
    assert ph["warm-up"]["l2_hit_pages"] + ph["warm-up"]["l3_hit_pages"] < ph["warm-up"]["pages"]
    # The working set outgrew L2 and came back from L3, in the same processes and after a restart.
    assert ph["pressure"]["l3_hit_pages"] > 0
    for name in ("reload", "restart"):
        # Everything computed was persisted: a page is computed again only where the replayed
        # prefetch_threshold declined the lookup or revoked the (too short) hit.
        p = ph[name]
        assert p["computed_pages"] == p["l3_declined_pages"] + p["l3_revoked_pages"], (name, p)
        assert p["l3_hit_pages"] > 0 and p["l3_read_bytes"] > 0
    assert ph["restart"]["recompute_avoided_tokens"] == ph["restart"]["l3_hit_pages"] * 64
    for cs in res["restart_cold_start"]:
        assert cs["mode"] == "load" and cs["live"] > 0 and cs["dropped"] == 0
    assert res["raw_disk"]["read_gbps"] > 0 and res["raw_disk"]["write_gbps"] > 0
    assert "recompute" in proc.stdout and "L3 hit" in proc.stdout and "restart" in proc.stdout  # the table
    return res


# threshold 0 is slow-marked: CI's test_cachebench_reuse replays the same kind of trace at threshold 0 already.
@pytest.mark.parametrize("threshold", [256, pytest.param(0, marks=pytest.mark.slow)])
def test_tiny_trace_replay_through_all_phases(tmp_path, threshold):
    trace = tmp_path / "trace.jsonl"
    write_trace(generate(WorkloadSpec(system_prompts=1, system_tokens=256, documents=3, doc_tokens_min=256,
                                      doc_tokens_max=512, sessions=5, turns=2, turn_tokens=128, seed=7)),
                str(trace))
    out = tmp_path / "out"
    proc = cachebench("--trace", str(trace), "--cp-size", "2", "--layers", "2",
                      "--raw-mb", "16", "--out-dir", str(out), "--prefetch-threshold", str(threshold))
    res = _check_result(str(out), proc)
    assert res["config"]["trace"] == str(trace) and res["config"]["sharded"]
    assert open(out / "l3" / "l3.toml").readline().startswith("# sglang-cp L3 config written by `sglang-cp cachebench`")
    assert res["config"]["prefetch_threshold"] == threshold
    ph = res["phases"].values()
    skipped = sum(p["l3_declined_pages"] + p["l3_revoked_pages"] for p in ph)
    if threshold:
        # 128-token turns leave 2-page misses behind cached prefixes: the scheduler would not look them up.
        assert skipped > 0 and f"prefetch_threshold {threshold} tokens" in proc.stdout
    else:
        assert skipped == 0 and all(p["computed_pages"] == 0 for p in list(ph)[2:])


def test_usage_errors_exit_2_before_any_rank_starts(tmp_path):
    p = cachebench("--l2-pages", "1", "--sessions", "2", "--out-dir", str(tmp_path))
    assert p.returncode == 2 and "--l2-pages" in p.stdout and "use at least" in p.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"segments": [{"id": "x"}]}\n')
    p = cachebench("--trace", str(bad), "--out-dir", str(tmp_path))
    assert p.returncode == 2 and "segments[0].tokens" in p.stdout
    p = cachebench("--prefetch-threshold", "-1", "--out-dir", str(tmp_path))
    assert p.returncode == 2 and "--prefetch-threshold" in p.stdout


@pytest.mark.slow
def test_the_readme_demo_run(tmp_path):
    out = tmp_path / "cachebench"
    _check_result(str(out), cachebench("--out-dir", str(out)))


@pytest.mark.slow
def test_quick_run(tmp_path):
    out = tmp_path / "cachebench"
    _check_result(str(out), cachebench("--quick", "--out-dir", str(out)))
