"""The benchmarks under benchmark/ still run end to end (tiny sizes): their numbers are only
trusted in full runs, but a script that no longer starts or that compares wrong bytes must
fail CI, not the next person who needs the figures. Each runs as the docs say: from the repository
root, as a module (``python -m benchmark.hicache.<name>``)."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_l3_store_smoke(disk_tmp):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.hicache.bench_l3_store", "--dir", str(disk_tmp),
         "--gib", "0.005", "--reps", "1", "--page-sizes", "65536"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│") and "65,536" in line]
    # One table after the page size, one at the end: 5 paths each; every path read back the exact bytes.
    assert len(rows) == 10, proc.stdout[-3000:]
    assert {row.split("│")[3].strip() for row in rows} == {"raw", "ours", "ours-sync128", "ours-written128",
                                                           "hicache"}
    assert all(row.split("│")[13].strip() == "True" for row in rows), proc.stdout[-3000:]
    assert "exists_prefix(2048 keys): median" in proc.stdout


def test_bench_l3_index_smoke(disk_tmp):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.hicache.bench_l3_index", "--dir", str(disk_tmp),
         "--sizes", "20000", "--runs", "3", "--io-mib", "128", "--io-reps", "1", "--digest-threads", "0,2"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=REPO)
    # The script asserts every hit query answers the full prefix and every reload returns the bytes written.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "16384 keys: exists_each kv+ix, 8 cls" in proc.stdout and "x raw" in proc.stdout, proc.stdout[-3000:]
    assert "index.digest_threads = 2 (native hasher" in proc.stdout, proc.stdout[-3000:]  # native rows, same run
    assert not os.listdir(disk_tmp), "the index and slabs must be deleted after the run"


def test_bench_cp_l3_smoke(disk_tmp):
    """Upstream's file row, a raw row and one row of ours that takes the other non-default paths: the
    written ack and zero-copy writes, with --phases (durable / operation acks and native reads: next test)."""
    out = disk_tmp / "cp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.hicache.bench_cp_l3", "--quick", "--dir",
         str(disk_tmp), "--json", str(out), "--phases", "--backup-ack", "written", "--zero-copy", "on",
         "--configs", "raw O_DIRECT, 2 writers;ours, CP=2 sharded", "--scheduler-steps", "1,2"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=REPO)
    # The script exits non-zero when any rank reloads wrong bytes or fewer tokens than it wrote.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    rows = json.loads(out.read_text())
    names = [s["name"] for s in rows]
    assert names == ["upstream file, CP=1", "raw O_DIRECT, 2 writers", "ours, CP=2 sharded, ack written, zero-copy"], names
    # The script exits non-zero unless every page of a zero-copy row was written zero-copy.
    assert rows[2]["zero_copy"] is True and rows[2]["backup_ack"] == "written"
    # --phases: the row of ours says when its pages were written and when upstream got its ack (under the
    # written ack the commit may land after the probes stop looking).
    assert rows[2]["phases"]["pwrite"]["n"] >= 1 and rows[2]["phases"]["upstream_ack"]["last"] > 0, rows[2]
    # and where its cold prefetch went: upstream hashed the pages and asked our hit query, then the ranks
    # agreed (a gloo MIN after the query, one for the prefetch's completion), and the store's reads ran
    # inside our restore of the whole prefetch (started at once, then waited for)
    rp = rows[2]["read_phases"]
    assert rp["hash"]["n"] >= 1 and rp["hit_query"]["n"] >= 1 and rp["gloo_min"]["n"] >= 2, rp
    assert rp["reads_started"]["first"] <= rp["restore_wait"]["first"], rp
    assert rp["restore_wait"]["first"] <= rp["store_read"]["first"] <= rp["store_read"]["last"] <= rp["restore_wait"]["last"], rp
    assert rp["hit_query"]["last"] <= rp["reads_started"]["first"] and rp["prefetch_done"]["last"] >= rp["restore_wait"]["last"], rp
    assert "Where each rank's cold prefetch time goes" in proc.stdout
    # every row of ours and of raw reports its read CPU per GB, and each row is printed as it lands, with
    # its read against its raw row and the split into the store's reads and the rest of the prefetch
    assert all(s["read_cpu_s_per_gb"][0] > 0 for s in rows[1:]), rows
    assert "read CPU s/GB" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("row done: ours, CP=2 sharded"))
    assert re.search(r"node read [0-9.]+ GB/s \([0-9.]+x / [0-9.]+x raw\)", line), line
    assert re.search(r"inside the store's reads [0-9.]+ GB/s per rank, prefetch outside them -?[0-9.]+ ms", line), line
    # --scheduler-steps: upstream's file row and ours give their scheduler steps' wall ms (each step is 1 ms of
    # bytecode and a 2 ms sleep, so never under 3 ms) alone, through the backup and through the prefetch,
    # and the step time beyond alone per GB; the raw row has no scheduler
    assert rows[1]["steps_ms"] is None and rows[1]["scheduler_steps_ms"] is None
    for row in (rows[0], rows[2]):
        assert row["scheduler_steps_ms"] == [1.0, 2.0], row
        for phase in ("idle", "write", "read"):
            p50, p99 = row["steps_ms"][phase]
            assert 2.999 <= p50 <= p99, (phase, row["steps_ms"])
        assert all(row[f"steps_excess_ms_per_gb_{op}"][0] >= 0 for op in ("write", "read")), row
    assert re.search(r"scheduler step p50/p99 ms: alone [0-9.]+/[0-9.]+, backup [0-9.]+/[0-9.]+, prefetch "
                     r"[0-9.]+/[0-9.]+; step ms beyond alone per GB: backup [0-9.]+, prefetch [0-9.]+", line), line


@pytest.mark.slow  # the options it adds run in other CI tests: the operation ack, native reads
def test_bench_cp_l3_operation_ack_and_native_reads_without_the_file_row(disk_tmp):
    """--no-file drops upstream's file row (its columns print '-'); --backup-ack takes a list, here the
    per-operation ack through upstream's backup thread; --read-engine native restores through the C engine
    behind upstream's prefetch thread (the script checks every byte); --cp picks the CP sizes;
    --busy-scheduler keeps a Python thread running through the timed backup and prefetch, and our rows' stores set the
    rank processes' switch interval to 1 ms (io.gil_switch_interval_ms) while the raw row keeps CPython's."""
    out = disk_tmp / "cp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.hicache.bench_cp_l3", "--quick", "--dir",
         str(disk_tmp), "--json", str(out), "--no-file", "--backup-ack", "durable,operation", "--cp", "1",
         "--read-engine", "native", "--busy-scheduler", "--gil-switch-interval-ms", "1"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    rows = json.loads(out.read_text())
    assert [s["name"] for s in rows] == ["raw O_DIRECT, 1 writer", "ours, CP=1, native reads, switch 1 ms",
                                         "ours, CP=1, ack operation, native reads, switch 1 ms"]
    assert [s["backup_ack"] for s in rows[1:]] == ["durable", "operation"]
    assert [s["read_engine"] for s in rows[1:]] == ["native", "native"]
    assert [s["busy_scheduler"] for s in rows] == [False, True, True]
    assert [s["switch_interval_ms"] for s in rows[1:]] == [[1.0], [1.0]]
    assert rows[0]["busy_turns_per_s"] is None and all(s["busy_turns_per_s"][0] > 0 for s in rows[1:]), rows
    # the busy thread also runs through the backup: what the scheduler lost per GB beside each operation
    assert rows[0]["sched_lost_s_per_gb_write"] is None
    assert all(s[f"sched_lost_s_per_gb_{op}"][0] >= 0 for s in rows[1:] for op in ("write", "read")), rows
    assert all(s["read_cpu_s_per_gb"][0] > 0 for s in rows), rows  # every row reports its CPU per GB
    assert "read CPU s/GB" in proc.stdout
    # each row is printed as it lands, against its raw row: a run cut by a bound keeps what it measured
    line = next(x for x in proc.stdout.splitlines() if x.startswith("row done: ours, CP=1, native reads, switch 1 ms, 16 pages:"))
    assert re.search(r"node read [0-9.]+ GB/s \([0-9.]+x / [0-9.]+x raw\)", line), line
    # and splits the prefetch into the store's reads and the rest (upstream's threads and MINs)
    assert re.search(r"inside the store's reads [0-9.]+ GB/s per rank, prefetch outside them -?[0-9.]+ ms", line), line
    assert rows[1]["store_read_gbps_rank"][0] > 0 and "outside_store_s" in rows[1], rows[1]
    # the node's own overhead past its longest store time is never more than the most any rank spent outside
    assert re.search(r"\(the node: -?[0-9.]+ ms past its longest store time\)", line), line
    assert rows[1]["outside_store_node_s"][0] <= rows[1]["outside_store_s"][0] + 1e-9, rows[1]
    bad = subprocess.run(
        [sys.executable, "-m", "benchmark.hicache.bench_cp_l3", "--quick", "--dir",
         str(disk_tmp), "--backup-ack", "durable,soon"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=REPO)
    assert bad.returncode == 2 and "--backup-ack: soon is not one of durable, written, operation" in bad.stderr, bad.stderr


def test_bench_cp_l3_refuses_disks_on_one_filesystem(disk_tmp):
    """--disks on one filesystem would report 'scaling with disks' that is one disk's bandwidth split in
    two: refused before anything runs (two loop devices on one disk only warn: l3/devices.py)."""
    a, b = disk_tmp / "a", disk_tmp / "b"
    a.mkdir()
    b.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.hicache.bench_cp_l3", "--quick", "--dir",
         str(disk_tmp), "--disks", f"{a},{b}"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=REPO)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert f"--disks: {a} and {b} are on the same filesystem (device " in proc.stderr, proc.stderr[-3000:]
    assert sorted(os.listdir(disk_tmp)) == ["a", "b"], "nothing may run before the refusal"


def test_bench_l3_read_smoke(disk_tmp):
    """Raw O_DIRECT vs both read engines, two rank processes at once; the script compares every byte."""
    out = disk_tmp / "read.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.hicache.bench_l3_read", "--quick", "--dir",
         str(disk_tmp), "--page-sizes", "1052672", "--ranks", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    (case,) = json.loads(out.read_text())["results"]
    assert case["ranks"] == 2 and sorted(case["paths"]) == ["native", "python", "raw"]
    assert all(v["gbps"][0] > 0 and v["cpu_s_per_gb"][0] > 0 for v in case["paths"].values()), case
    assert not [p for p in os.listdir(disk_tmp) if p != "read.json"], "the stores and raw files must be deleted"


def test_a_benchmark_started_as_a_file_says_how_to_start_it():
    """Run as a file, the repository root is not on sys.path and benchmark.support cannot import: the
    script says the one way to run it instead of a ModuleNotFoundError."""
    for name in ("bench_cp_l3", "bench_server_ttft", "pyspy_profile"):
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO, "benchmark", "hicache", f"{name}.py"), "--help"],
            capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 1, (name, proc.stdout[-2000:], proc.stderr[-2000:])
        assert proc.stderr.strip() == (f"{name}: run it from the repository root as a module: "
                                       f"python -m benchmark.hicache.{name}"), proc.stderr


def test_bench_l3_read_uring_smoke(disk_tmp):
    """--engines uring with one I/O thread per rank (--uring-threads): the io_uring engine's row beside raw, every
    byte compared by the script; a host that refuses io_uring makes the script stop, not mislabel the row."""
    from sglang_cp.l3.native.uring import probe

    if probe():
        pytest.skip("io_uring is refused in this environment")
    out = disk_tmp / "read.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmark", "hicache", "bench_l3_read.py"), "--quick", "--dir",
         str(disk_tmp), "--page-sizes", "1052672", "--engines", "uring", "--uring-threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    (case,) = json.loads(out.read_text())["results"]
    assert sorted(case["paths"]) == ["raw", "uring"]
    assert all(v["gbps"][0] > 0 and v["cpu_s_per_gb"][0] > 0 for v in case["paths"].values()), case
