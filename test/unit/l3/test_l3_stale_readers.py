"""Stale LMDB readers: a process SIGKILLed inside a read txn (a rank, `sglang-cp l3 stats`) leaves
its reader slot behind, pinning a snapshot; without a reader check every later commit allocates
fresh pages and the index file grows to the map limit. The index clears such slots at open, before
growing the map, and periodically on the write path.

The dead reader is a real process: it opens the index with our LmdbIndex, begins a read txn,
signals ready, and is SIGKILLed while the txn is open. Growth is read from LMDB's own page counter
(`last_pgno`) and the file size; reader slots from `env.readers()`.
"""

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

import sglang_cp.l3.format.index as index_mod
from sglang_cp.l3.format.index import IndexEntry, LmdbIndex, index_key

READER = textwrap.dedent("""
    import sys, time
    from sglang_cp.l3.format.index import LmdbIndex
    ix = LmdbIndex(sys.argv[1], 1 << 20, 1 << 30)
    def hold(txn):
        txn.stat()
        print("ready", flush=True)
        time.sleep(600)
    ix._read(hold) if sys.argv[2] == "txn" else (print("ready", flush=True), time.sleep(600))
""")
KEYS = 100
COMMITS = 300


def k(i):
    return index_key(7, i.to_bytes(16, "little"), 0)


def e(i, seq):
    return IndexEntry(0, 0, i, 7, 4096, seq, seq)


def _spawn(path, mode):
    p = subprocess.Popen([sys.executable, "-c", READER, path, mode], stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([p.stdout], [], [], 60)
    assert ready and p.stdout.readline().strip() == "ready", "reader process did not start"
    return p


def kill_inside_read_txn(path, ix=None) -> int:
    """A real process holding a read txn on the index, SIGKILLed; returns its pid. `ix`: our own open
    index on `path` (LMDB allows one env per path per process)."""
    p = _spawn(path, "txn")
    assert str(p.pid) in reader_pids(ix.env.readers() if ix else path_env_readers(path))
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    return p.pid


def path_env_readers(path) -> str:
    import lmdb
    env = lmdb.open(path, subdir=True, readonly=True, lock=True, max_readers=1024)
    try:
        return env.readers()
    finally:
        env.close()


def reader_pids(table: str) -> set[str]:
    return {line.split()[0] for line in table.splitlines()[1:] if line.strip()}


def rewrite_commits(ix, n, start_seq):
    """n commits that rewrite the same KEYS entries: with no pinned snapshot the freed pages are reused."""
    for c in range(n):
        ix.commit(puts=[(k(i), e(i, start_seq + c)) for i in range(KEYS)])


def pages(ix) -> int:
    return ix.env.info()["last_pgno"]


@pytest.fixture
def live_rank(l3_root):
    """Another live process with the env open (as the other ranks are): LMDB resets its reader table
    only when the first process opens the env, so this keeps stale slots from vanishing by chance."""
    procs = []

    def start(path):
        procs.append(_spawn(path, "open"))
    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=30)


def test_open_clears_a_killed_readers_slot_and_commits_stop_growing(l3_root, live_rank):
    path = os.path.join(l3_root, "idx")
    ix = LmdbIndex(path, 1 << 20, 1 << 22)
    rewrite_commits(ix, 1, 1)
    ix.close()
    live_rank(path)
    pid = kill_inside_read_txn(path)
    assert str(pid) in reader_pids(path_env_readers(path)), "premise: the dead reader's slot is left behind"
    ix = LmdbIndex(path, 1 << 20, 1 << 22)  # a rank restarting
    try:
        rewrite_commits(ix, 20, 10)
        before = pages(ix)
        rewrite_commits(ix, COMMITS, 100)
        grew = pages(ix) - before
        assert grew < 20, f"{COMMITS} commits of the same {KEYS} keys grew the index by {grew} pages (pinned snapshot)"
        assert str(pid) not in reader_pids(ix.env.readers()), "open left the dead reader's slot in place"
    finally:
        ix.close()


def test_map_full_clears_a_killed_reader_before_growing(l3_root, monkeypatch):
    monkeypatch.setattr(index_mod, "_READER_CHECK_INTERVAL_S", 1e9, raising=False)  # only the grow path acts
    path = os.path.join(l3_root, "idx")
    ix = LmdbIndex(path, 256 << 10, 64 << 20)  # this process stays open: LMDB keeps the reader table
    try:
        start = ix.map_size()
        rewrite_commits(ix, 1, 1)
        pid = kill_inside_read_txn(path, ix)
        assert str(pid) in reader_pids(ix.env.readers()), "premise: the dead reader's slot is left behind"
        rewrite_commits(ix, COMMITS, 10)  # pinned: each commit needs fresh pages until the map is full
        assert ix.grows == 0 and ix.map_size() == start, \
            f"the map grew {ix.grows} time(s) to {ix.map_size()} B for a dead reader"
        assert os.path.getsize(os.path.join(path, "data.mdb")) <= start
        assert str(pid) not in reader_pids(ix.env.readers())
    finally:
        ix.close()


def test_periodic_check_reclaims_a_killed_readers_slot(l3_root, monkeypatch):
    monkeypatch.setattr(index_mod, "_READER_CHECK_INTERVAL_S", 0.0, raising=False)  # every write checks
    path = os.path.join(l3_root, "idx")
    ix = LmdbIndex(path, 1 << 20, 1 << 22)
    try:
        rewrite_commits(ix, 1, 1)
        pid = kill_inside_read_txn(path, ix)
        assert str(pid) in reader_pids(ix.env.readers()), "premise: the dead reader's slot is left behind"
        rewrite_commits(ix, 20, 10)
        before = pages(ix)
        rewrite_commits(ix, COMMITS, 100)
        grew = pages(ix) - before
        assert grew < 20, f"{COMMITS} commits of the same {KEYS} keys grew the index by {grew} pages (pinned snapshot)"
        assert str(pid) not in reader_pids(ix.env.readers()), "the write path never reclaimed the dead reader's slot"
    finally:
        ix.close()
