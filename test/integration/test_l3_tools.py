"""`sglang-cp l3 stats` and `sglang-cp l3 fsck [--repair]` as real processes on a real L3
directory written by the real store (O_DIRECT slabs, shared LMDB index), with each kind of
damage made on disk the way it happens: a flipped payload byte, a zeroed header, a blob of
another rank copied into a slot, a lost index entry, two entries claiming one slot."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sglang_cp.cli import write_demo_config
from sglang_cp.l3 import L3Store, load_l3_config
from sglang_cp.l3.format.blob import HEADER_BYTES, key_digest
from sglang_cp.l3.format.index import IndexEntry, LmdbIndex, index_key

PAGE_BYTES = 16384
N = 6


def page(rank, i):
    return np.full(PAGE_BYTES, (rank * 31 + i * 7 + 1) % 251, dtype=np.uint8)


def cli(*args, timeout=120):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "sglang_cp.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def l3dir(disk_tmp):
    cfg_path = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    cfg = load_l3_config(cfg_path)
    for rank in (0, 1):
        with L3Store(cfg, rank=rank, ranks_per_node=2, payloads={"kv": PAGE_BYTES}) as s:
            keys = [b"k%d" % i for i in range(N)]
            assert all(s.write_pages("kv", keys, [page(rank, i) for i in range(N)], timeout=60))
    return cfg_path, cfg


def _entry(cfg, rank, key):
    ix = LmdbIndex(cfg.index.dir, cfg.index.map_size_bytes, cfg.index.max_map_size_bytes)
    try:
        from sglang_cp.l3.format.blob import payload_tag

        ikey = index_key(payload_tag("kv"), key_digest(rank, key), rank)
        return ikey, ix.get_many([ikey])[0]
    finally:
        ix.close()


def _slab(cfg, rank):
    d = os.path.join(cfg.disks[0].path, "sglang-cp-l3")
    (name,) = [n for n in os.listdir(d) if n.startswith(f"r{rank}.kv.")]
    return os.path.join(d, name), int(name.split(".s")[1].split(".")[0])


def _rw(path, off, n, data=None):
    fd = os.open(path, os.O_RDWR)
    try:
        if data is None:
            return os.pread(fd, n, off)
        os.pwrite(fd, data, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_stats_reports_occupancy_per_rank_disk_payload(l3dir):
    cfg_path, _ = l3dir
    p = cli("l3", "stats", "--cp-l3-config", cfg_path, "--json")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    rows = {(r["rank"], r["disk"], r["payload"]): r for r in st["slabs"]}
    assert set(rows) == {(0, "local0", "kv"), (1, "local0", "kv")}
    for r in rows.values():
        assert r["used"] == N and r["payload_bytes"] == N * PAGE_BYTES
        assert r["gc"] == "idle"
    assert st["index"]["entries"] == 2 * N and st["unmatched_entries"] == 0
    table = cli("l3", "stats", "--cp-l3-config", cfg_path)
    assert table.returncode == 0 and f"{N} / " in table.stdout


def test_stats_shows_each_ranks_last_cold_start_from_disk(l3dir):
    cfg_path, cfg = l3dir
    st = json.loads(cli("l3", "stats", "--cp-l3-config", cfg_path, "--json").stdout)
    recs = {r["rank"]: r for r in st["last_cold_start"]}
    assert set(recs) == {0, 1} and all(r["mode"] == "clear" and r["disk"] == "local0" for r in recs.values())
    assert recs[0]["pid"] == os.getpid()
    # Rank 0 restarts with `load` after one of its pages lost its header: the record says what happened.
    path0, sb = _slab(cfg, 0)
    _, e1 = _entry(cfg, 0, b"k1")
    _rw(path0, e1.slot * sb + PAGE_BYTES, HEADER_BYTES, bytes(HEADER_BYTES))
    slab_dir = os.path.dirname(path0)
    stale = os.path.join(slab_dir, "r0.cold_start.json.tmp.999999")  # a crash mid-record left this
    open(stale, "w").write("{")
    with L3Store(cfg, rank=0, ranks_per_node=2, payloads={"kv": PAGE_BYTES}, cold_start="load") as s:
        live = s.stats()["cold_start"]["live"]
    assert live == N - 1 and not os.path.exists(stale)
    st = json.loads(cli("l3", "stats", "--cp-l3-config", cfg_path, "--json").stdout)
    recs = {r["rank"]: r for r in st["last_cold_start"]}
    assert recs[0]["mode"] == "load" and recs[0]["live"] == N - 1 and recs[0]["dropped"] == 1
    assert sum(recs[0]["drop_reasons"].values()) == 1 and recs[1]["mode"] == "clear"
    table = cli("l3", "stats", "--cp-l3-config", cfg_path)
    assert table.returncode == 0 and "last cold start per rank" in table.stdout, table.stdout
    assert "load" in table.stdout
    # A damaged record is reported as such, not guessed around.
    with open(os.path.join(cfg.disks[0].path, "sglang-cp-l3", "r1.cold_start.json"), "w") as f:
        f.write("{torn")
    st = json.loads(cli("l3", "stats", "--cp-l3-config", cfg_path, "--json").stdout)
    assert "unreadable record" in {r["rank"]: r for r in st["last_cold_start"]}[1]["error"]


def test_fsck_finds_each_kind_of_damage_and_repair_fixes_it(l3dir):
    cfg_path, cfg = l3dir
    clean = cli("l3", "fsck", "--cp-l3-config", cfg_path, "--json")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert json.loads(clean.stdout)["counts"] == {}

    path0, sb = _slab(cfg, 0)
    path1, _ = _slab(cfg, 1)
    # crc: one payload byte of rank 0's k0 flipped.
    _, e0 = _entry(cfg, 0, b"k0")
    b = _rw(path0, e0.slot * sb + 100, 1)
    _rw(path0, e0.slot * sb + 100, 1, bytes([b[0] ^ 0xFF]))
    # dangling: rank 0's k1 loses its header (a torn slot the index still points at).
    _, e1 = _entry(cfg, 0, b"k1")
    _rw(path0, e1.slot * sb + PAGE_BYTES, HEADER_BYTES, bytes(HEADER_BYTES))
    # cross_rank: rank 1's k2 blob copied over rank 0's k2 slot.
    _, e2 = _entry(cfg, 0, b"k2")
    _, f2 = _entry(cfg, 1, b"k2")
    _rw(path0, e2.slot * sb, sb, _rw(path1, f2.slot * sb, sb))
    # orphan: rank 1's k3 index entry lost (its blob stays on disk).
    k3, g3 = _entry(cfg, 1, b"k3")
    # collision: a second key of rank 0 claims rank 0's k4 slot.
    _, e4 = _entry(cfg, 0, b"k4")
    ix = LmdbIndex(cfg.index.dir, cfg.index.map_size_bytes, cfg.index.max_map_size_bytes)
    try:
        from sglang_cp.l3.format.blob import payload_tag

        fake = index_key(payload_tag("kv"), key_digest(0, b"not-written"), 0)
        ix.commit(deletes=[(k3, g3)], puts=[(fake, IndexEntry(0, 0, e4.slot, e4.payload_tag, PAGE_BYTES,
                                                               e4.last_access, e4.seq + 1))])
    finally:
        ix.close()

    found = cli("l3", "fsck", "--cp-l3-config", cfg_path, "--json")
    assert found.returncode == 1, found.stdout + found.stderr
    rep = json.loads(found.stdout)
    assert rep["counts"] == {"crc": 1, "dangling": 1, "cross_rank": 1, "collision": 1, "orphan": 1}, rep
    table = cli("l3", "fsck", "--cp-l3-config", cfg_path)
    assert table.returncode == 1 and "cross_rank" in table.stdout

    fixed = cli("l3", "fsck", "--cp-l3-config", cfg_path, "--repair", "--json")
    assert fixed.returncode == 3, fixed.stdout + fixed.stderr
    assert json.loads(fixed.stdout)["repaired"] == {"crc": 1, "dangling": 1, "cross_rank": 1, "collision": 1,
                                                    "orphan": 1}
    again = cli("l3", "fsck", "--cp-l3-config", cfg_path, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["counts"] == {}, again.stdout

    # The store after repair: intact pages load and read back exactly; the damaged ones are gone.
    with L3Store(cfg, rank=0, ranks_per_node=2, payloads={"kv": PAGE_BYTES}, cold_start="load") as s:
        assert s.stats()["cold_start"]["dropped"] == 0
        outs = [np.zeros(PAGE_BYTES, np.uint8) for _ in range(N)]
        ok = s.read_pages("kv", [b"k%d" % i for i in range(N)], outs, timeout=60)
        assert ok == [False, False, False, True, True, True]
        for i in (3, 4, 5):
            assert np.array_equal(outs[i], page(0, i))


def test_fsck_refuses_repair_while_a_store_has_the_directory_open(l3dir):
    cfg_path, _ = l3dir
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from sglang_cp.l3 import L3Store, load_l3_config\n"
         f"s = L3Store(load_l3_config({cfg_path!r}), rank=0, ranks_per_node=2, payloads={{'kv': {PAGE_BYTES}}},"
         " cold_start='load')\n"
         "print('ready', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        p = cli("l3", "fsck", "--cp-l3-config", cfg_path, "--repair")
        assert p.returncode == 2, p.stdout + p.stderr
        assert "refusing --repair" in p.stdout and str(holder.pid) in p.stdout
        ro = cli("l3", "fsck", "--cp-l3-config", cfg_path)  # a live owner: refused without --live
        assert ro.returncode == 2 and "--live" in ro.stdout and str(holder.pid) in ro.stdout, ro.stdout
        live = cli("l3", "fsck", "--cp-l3-config", cfg_path, "--live")  # a store that does not write: clean
        assert live.returncode == 0 and "live check" in live.stdout, live.stdout + live.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert cli("l3", "fsck", "--cp-l3-config", cfg_path, "--repair").returncode == 0


def test_fsck_repair_refuses_when_a_store_started_during_the_scan(l3dir, monkeypatch):
    """The live-store check before a scan is not enough for --repair: a server that starts during a long
    scan can write pages into slots the scan found free, whose headers repair would zero. The check runs
    again after the scan; a store that started meanwhile refuses the repair and keeps its pages."""
    from sglang_cp import cli as cp_cli
    from sglang_cp.l3.tools import fsck

    cfg_path, cfg = l3dir
    ikey, _ = _entry(cfg, 0, b"k0")
    ix = LmdbIndex(cfg.index.dir, cfg.index.map_size_bytes, cfg.index.max_map_size_bytes)
    try:  # a lost index entry: its slot is an orphan the repair would zero
        ix.commit(deletes=[(ikey, ix.get_many([ikey])[0])])
    finally:
        ix.close()
    scan, started = fsck.check, []

    def scan_while_a_store_starts(config, *a, **kw):
        rep = scan(config, *a, **kw)
        s = L3Store(cfg, rank=0, ranks_per_node=2, payloads={"kv": PAGE_BYTES}, cold_start="load")
        started.append(s)
        # its first write takes a free slot: the orphan the scan listed
        assert s.write_pages("kv", [b"new"], [page(0, 99)], timeout=60) == [True]
        return rep
    monkeypatch.setattr(fsck, "check", scan_while_a_store_starts)
    try:
        rc = cp_cli.main(["l3", "fsck", "--cp-l3-config", cfg_path, "--repair"])
        s = started[0]
        out = np.zeros(PAGE_BYTES, np.uint8)
        assert s.read_pages("kv", [b"new"], [out], timeout=60) == [True], "repair zeroed a live page's header"
        assert np.array_equal(out, page(0, 99)) and rc == cp_cli.FSCK_USAGE
    finally:
        for s in started:
            s.close()
    monkeypatch.undo()
    assert cli("l3", "fsck", "--cp-l3-config", cfg_path, "--repair").returncode in (0, 3)


def test_bad_config_is_a_usage_error(disk_tmp):
    missing = str(disk_tmp / "nope.toml")
    for sub in ("stats", "fsck"):
        p = cli("l3", sub, "--cp-l3-config", missing)
        assert p.returncode == 2
        assert "--cp-l3-config" in p.stdout and "does not exist" in p.stdout


_CHURN = r"""
import sys, threading
import numpy as np
from sglang_cp.l3 import L3Store, load_l3_config
s = L3Store(load_l3_config(sys.argv[1]), rank=0, ranks_per_node=2, payloads={"kv": int(sys.argv[2])},
            cold_start="load")
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
i = 0
while not stop.is_set():  # new keys only: GC frees and rewrites slots all the time
    keys = [b"churn%d" % (i + j) for j in range(64)]
    assert all(s.write_pages("kv", keys, [np.full(int(sys.argv[2]), (i + j) % 251, np.uint8) for j in range(64)],
                             timeout=60))
    i += 64
    if i == 64:
        print("ready", flush=True)
c = s.stats()["counters"]
print("written", i, "reclaimed", c["gc_reclaimed"], flush=True)
s.close()
"""


def test_fsck_on_a_live_directory_refuses_or_confirms_each_finding(l3dir, capsys):
    """A store writing under GC pressure while fsck reads (issue 27, item 5). Before: exit 1 with
    dangling (and now and then crc) findings for pages the store freed and rewrote under the scan.
    Now: refused without --live, naming the owner; with --live every finding whose entry changed is
    transient and the exit is 0, while real damage on a rank that is not live is still a problem."""
    from sglang_cp.cli import main

    cfg_path, cfg = l3dir
    writer = subprocess.Popen([sys.executable, "-c", _CHURN, cfg_path, str(PAGE_BYTES)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        plain = cli("l3", "fsck", "--cp-l3-config", cfg_path, "--json")
        assert plain.returncode == 2, f"a check of a live directory ran: exit {plain.returncode}\n{plain.stdout}"
        assert f"rank 0 by pid {writer.pid}" in plain.stdout and "--live" in plain.stdout, plain.stdout

        def live(*extra):
            capsys.readouterr()
            rc = main(["l3", "fsck", "--cp-l3-config", cfg_path, "--live", "--json", *extra])
            out = capsys.readouterr().out
            return rc, json.loads(out[out.index("{"):])

        transient = runs = 0
        while runs < 30 and transient == 0:  # until the scan raced the writer at least once
            rc, rep = live()
            runs += 1
            counts = rep["counts"]
            assert rc == 0 and not any(counts.get(k) for k in ("dangling", "crc", "cross_rank", "collision")), rep
            transient += counts.get("transient", 0)
        with capsys.disabled():
            print(f"fsck --live on a writing store: {runs} run(s), {transient} transient finding(s), 0 problems")
        assert transient, "the scan never raced the writer: nothing was tested"

        # Real damage where nobody writes (rank 1, closed): still a problem under --live.
        path1, sb = _slab(cfg, 1)
        _, e = _entry(cfg, 1, b"k0")
        b = _rw(path1, e.slot * sb + 100, 1)
        _rw(path1, e.slot * sb + 100, 1, bytes([b[0] ^ 0xFF]))
        rc, rep = live()
        assert rc == 1 and rep["counts"].get("crc") == 1, rep
        assert [f["rank"] for f in rep["findings"] if f["kind"] == "crc"] == [1], rep
        assert main(["l3", "fsck", "--cp-l3-config", cfg_path, "--live", "--repair"]) == 2  # never with a live store
    finally:
        writer.stdin.close()
        tail = writer.stdout.read()
        writer.wait(timeout=60)
    print(f"writer: {tail.strip()}")
    assert writer.returncode == 0
    # Stopped: the exact check runs and finds the planted page only.
    after = cli("l3", "fsck", "--cp-l3-config", cfg_path, "--json")
    assert after.returncode == 1 and json.loads(after.stdout)["counts"].get("crc") == 1, after.stdout
    assert not {"dangling", "cross_rank", "collision"} & set(json.loads(after.stdout)["counts"]), after.stdout
