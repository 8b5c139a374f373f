"""`sglang-cp cachebench` end to end as a real process: gloo rank processes with upstream's
host pools and controller and our L3, all four phases, the restart with cold start `load`,
and its outputs (exit code, JSON, PNG). CI runs a tiny replay of a JSONL trace, then replays it
again against the L3 directory it left, with damaged payloads (`load` of an operator's directory); the
README's demo run and `--quick` are the slow-marked tests."""

import json
import os
import subprocess
import sys

import pytest

from sglang_cp.cachebench.workload import WorkloadSpec, generate, write_trace
from sglang_cp.l3 import load_l3_config
from sglang_cp.l3.tools.fsck import all_entries, find_slabs, open_index

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


def tiny_trace(path) -> list:
    """A tiny JSONL trace at ``path``; the cachebench arguments that replay it on two sharded ranks."""
    write_trace(generate(WorkloadSpec(system_prompts=1, system_tokens=256, documents=3, doc_tokens_min=256,
                                      doc_tokens_max=512, sessions=5, turns=2, turn_tokens=128, seed=7)),
                str(path))
    return ["--trace", str(path), "--cp-size", "2", "--layers", "2", "--raw-mb", "16"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny trace replayed at upstream's default prefetch threshold: (arguments, out dir, process).
    The reuse test's second run replays against the L3 directory it leaves."""
    tmp = tmp_path_factory.mktemp("tiny")
    args = tiny_trace(tmp / "trace.jsonl") + ["--prefetch-threshold", "256"]
    return args, tmp / "out", cachebench(*args, "--out-dir", str(tmp / "out"))


def test_tiny_trace_replay_through_all_phases(tiny_run):
    args, out, proc = tiny_run
    _check_tiny_trace(out, proc, args[1], 256)


@pytest.mark.slow  # in CI the reuse test's second run replays the tiny trace without a threshold
def test_tiny_trace_replay_without_a_prefetch_threshold(tmp_path):
    args = tiny_trace(tmp_path / "trace.jsonl") + ["--prefetch-threshold", "0"]
    proc = cachebench(*args, "--out-dir", str(tmp_path / "out"))
    _check_tiny_trace(tmp_path / "out", proc, args[1], 0)


def _check_tiny_trace(out, proc, trace, threshold):
    res = _check_result(str(out), proc)
    assert res["config"]["trace"] == trace and res["config"]["sharded"]
    assert open(out / "l3" / "l3.toml").readline().startswith("# sglang-cp L3 config written by `sglang-cp cachebench`")
    assert res["config"]["prefetch_threshold"] == threshold
    ph = res["phases"].values()
    skipped = sum(p["l3_declined_pages"] + p["l3_revoked_pages"] for p in ph)
    if threshold:
        # 128-token turns leave 2-page misses behind cached prefixes: the scheduler would not look them up.
        assert skipped > 0 and f"prefetch_threshold {threshold} tokens" in proc.stdout
    else:
        assert skipped == 0 and all(p["computed_pages"] == 0 for p in list(ph)[2:])


def _damage_payloads(cfg_path) -> int:
    """Flip one payload byte of every referenced kv slot (header untouched); returns how many."""
    cfg = load_l3_config(cfg_path)
    slabs = {(s.rank, s.tag): s for s in find_slabs(cfg) if s.payload == "kv"}
    index = open_index(cfg)
    try:
        entries = all_entries(index)
    finally:
        index.close()
    n = 0
    for _, e in entries:
        s = slabs.get((e.rank, e.payload_tag))
        if s is None:
            continue
        off = e.slot * s.slot_bytes + 100
        fd = os.open(s.path, os.O_RDWR)
        try:
            b = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
            os.fsync(fd)
        finally:
            os.close(fd)
        n += 1
    return n


def test_load_against_an_existing_directory_counts_damage_as_partial_hits(tiny_run):
    """`load` against an L3 directory an operator already has, without deleting it, and damage found only
    at read time counted as partial hits with their cause, not as errors. Payload bytes are flipped on
    disk in the slots the index references (headers intact, so cold start `load` keeps them: it checks
    headers only); the second run replays against them. The existence check reads only the index, so
    the ranks agree on a hit and the CRC mismatch shows at read: the store drops the page (a miss, no
    wrong byte) and the agreed hit completes short."""
    args, first, proc = tiny_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cfg = str(first / "l3" / "l3.toml")
    marker = first / "l3" / "operator-file"
    marker.write_text("kept")
    assert _damage_payloads(cfg) > 0

    second = first.parent / "second"
    assert args[-2:] == ["--prefetch-threshold", "256"]
    args = args[:-2] + ["--prefetch-threshold", "0"]  # every lookup reaches L3 and its damaged pages
    p = cachebench(*args, "--out-dir", str(second), "--cp-l3-config", cfg, "--cp-l3-cold-start", "load")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert marker.read_text() == "kept"  # the directory was used as it is, not deleted
    res = json.load(open(second / "cachebench.json"))
    assert res["config"]["l3_reused"] and res["config"]["cold_start"] == "load"
    assert res["errors"] == 0, res["error_samples"]
    ph = res["phases"]
    partial = sum(x["l3_partial_pages"] for x in ph.values())
    assert partial > 0
    causes = {}
    for x in ph.values():
        for k, v in x["l3_partial_causes"].items():
            causes[k] = causes.get(k, 0) + v
    assert causes.get("crc_errors", 0) > 0, causes
    assert "partial L3 hits" in p.stdout and "crc_errors" in p.stdout
    for x in ph.values():
        assert x["rank_divergent_requests"] == 0
        assert x["l2_hit_pages"] + x["l3_hit_pages"] + x["computed_pages"] == x["pages"]
        assert x["l3_declined_pages"] == x["l3_revoked_pages"] == 0  # threshold 0: nothing declined


def test_load_without_a_directory_is_a_usage_error(tmp_path):
    p = cachebench("--cp-l3-cold-start", "load", "--sessions", "2", "--out-dir", str(tmp_path / "none"))
    assert p.returncode == 2 and "no L3 directory from an earlier run" in p.stdout, p.stdout


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
