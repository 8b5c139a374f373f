"""LMDB index: conditional commits, prefix queries in one txn, MapFull growth, several processes."""

import os
import subprocess
import sys
import textwrap

import pytest

from sglang_cp.l3.errors import L3StartupError
from sglang_cp.l3.format.index import IndexEntry, IndexFull, LmdbIndex, index_key


def e(slot, rank=0, seq=1, la=1):
    return IndexEntry(rank, 0, slot, 7, 4096, la, seq)


def k(i, rank=0):
    return index_key(7, i.to_bytes(16, "little"), rank)


def test_put_get_prefix(l3_root):
    ix = LmdbIndex(os.path.join(l3_root, "idx"), 1 << 20, 1 << 22)
    ix.commit(puts=[(k(i), e(i)) for i in range(10) if i != 6])
    assert ix.get_many([k(0), k(6), k(9)]) == [e(0), None, e(9)]
    assert ix.exists_prefix([[k(i)] for i in range(10)]) == 6
    assert ix.exists_prefix([[k(0), k(1)], [k(2), k(6)]]) == 1  # a row counts only if all its keys exist
    assert ix.exists_prefix([]) == 0
    ix.close()


def test_conditional_delete_and_touch(l3_root):
    ix = LmdbIndex(os.path.join(l3_root, "idx"), 1 << 20, 1 << 22)
    ix.commit(puts=[(k(1), e(1, seq=5)), (k(2), e(2, seq=5))])
    # A delete naming a stale (slot, seq) must not remove the newer mapping.
    assert ix.commit(deletes=[(k(1), e(1, seq=4)), (k(2), e(2, seq=5))]) == [False, True]
    assert ix.get_many([k(1), k(2)]) == [e(1, seq=5), None]
    ix.commit(touches=[(k(1), e(1, seq=5, la=99)), (k(2), e(2, seq=5, la=99))])
    assert ix.get_many([k(1)])[0].last_access == 99
    ix.commit(touches=[(k(1), e(1, seq=5, la=50))])  # never moves last_access backwards
    assert ix.get_many([k(1)])[0].last_access == 99
    ix.close()


def test_scan_and_delete_rank(l3_root):
    ix = LmdbIndex(os.path.join(l3_root, "idx"), 1 << 20, 1 << 22)
    ix.commit(puts=[(k(i, i % 2), e(i, rank=i % 2)) for i in range(10)])
    assert sorted(x.slot for _, x in ix.scan_rank(1)) == [1, 3, 5, 7, 9]
    assert ix.delete_rank(1) == 5
    assert ix.count() == 5 and not ix.scan_rank(1)
    ix.close()


def test_mapfull_grows_then_fails_soft(l3_root):
    ix = LmdbIndex(os.path.join(l3_root, "idx"), 64 << 10, 256 << 10)
    start = ix.map_size()
    n = 0
    with pytest.raises(IndexFull, match="max_map_size_gb"):
        for batch in range(1000):
            ix.commit(puts=[(k(batch * 100 + i), e(i)) for i in range(100)])
            n += 100
    assert ix.grows >= 1 and ix.map_size() == 256 << 10 > start
    assert ix.count() == n  # the failed txn left nothing half-written
    ix.close()


CHILD = textwrap.dedent("""
    import sys
    from sglang_cp.l3.format.index import IndexEntry, LmdbIndex, index_key
    path, rank = sys.argv[1], int(sys.argv[2])
    ix = LmdbIndex(path, 64 << 10, 64 << 20)
    for b in range(20):
        ix.commit(puts=[(index_key(rank, (b * 50 + i).to_bytes(16, "little"), rank),
                         IndexEntry(rank, 0, b * 50 + i, rank, 4096, 1, 1)) for i in range(50)])
    print(ix.map_size())
""")


def test_several_processes_share_one_env(l3_root):
    path = os.path.join(l3_root, "idx")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, path, str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(4)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
    ix = LmdbIndex(path, 64 << 10, 64 << 20)
    assert ix.count() == 4 * 1000  # every rank's writes landed while the map grew under the others
    for r in range(4):
        assert len(ix.scan_rank(r)) == 1000
    ix.close()


def test_open_retries_when_another_rank_grew_the_map_meanwhile(l3_root, monkeypatch):
    """lmdb.open's own first txn fails with MapResizedError when another rank grows the map and commits
    between the open sizing its map and that txn (seen once in CI with four ranks on a fresh index):
    the open is retried, boundedly, and a persistent failure is a startup error naming index.dir."""
    import lmdb

    import sglang_cp.l3.format.index as index_mod

    real_open, calls = lmdb.open, []

    def racing_open(*a, **kw):
        calls.append(1)
        if len(calls) <= 2:
            raise lmdb.MapResizedError("mdb_txn_begin: MDB_MAP_RESIZED")
        return real_open(*a, **kw)

    monkeypatch.setattr(index_mod.lmdb, "open", racing_open)
    ix = LmdbIndex(os.path.join(l3_root, "idx"), 1 << 20, 1 << 22)
    ix.commit(puts=[(k(1), e(1))])
    assert ix.get_many([k(1)]) == [e(1)] and len(calls) == 3
    ix.close()

    def always_resized(*a, **kw):
        raise lmdb.MapResizedError("mdb_txn_begin: MDB_MAP_RESIZED")

    monkeypatch.setattr(index_mod.lmdb, "open", always_resized)
    with pytest.raises(L3StartupError, match="index.dir: cannot open the LMDB index.*MAP_RESIZED"):
        LmdbIndex(os.path.join(l3_root, "idx2"), 1 << 20, 1 << 22)
