"""`sglang-cp cachebench` against an L3 directory an operator already has: `load` without deleting it,
and damage found only at read time counted as partial hits with their cause, not as errors.

Real processes end to end: a first run writes the directory; payload bytes are flipped on disk in the
slots the index references (headers intact, so cold start `load` keeps them: it checks headers only);
a second run replays against it with `--cp-l3-config ... --cp-l3-cold-start load`. The existence check
reads only the index, so the ranks agree on a hit and the CRC mismatch shows at read: the store drops
the page (a miss, no wrong byte) and the agreed hit completes short.
"""

import json
import os

from sglang_cp.cachebench.workload import WorkloadSpec, generate, write_trace
from sglang_cp.l3 import load_l3_config
from sglang_cp.l3.tools.fsck import all_entries, find_slabs, open_index
from test_cachebench import cachebench


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


def test_load_against_an_existing_directory_counts_damage_as_partial_hits(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(generate(WorkloadSpec(system_prompts=1, system_tokens=256, documents=2, doc_tokens_min=256,
                                      doc_tokens_max=384, sessions=3, turns=2, turn_tokens=128, seed=3)), str(trace))
    first = tmp_path / "first"
    args = ["--trace", str(trace), "--cp-size", "2", "--layers", "2", "--raw-mb", "8", "--prefetch-threshold", "0"]
    p = cachebench(*args, "--out-dir", str(first))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cfg = str(first / "l3" / "l3.toml")
    marker = first / "l3" / "operator-file"
    marker.write_text("kept")
    assert _damage_payloads(cfg) > 0

    second = tmp_path / "second"
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


def test_load_without_a_directory_is_a_usage_error(tmp_path):
    p = cachebench("--cp-l3-cold-start", "load", "--sessions", "2", "--out-dir", str(tmp_path / "none"))
    assert p.returncode == 2 and "no L3 directory from an earlier run" in p.stdout, p.stdout
