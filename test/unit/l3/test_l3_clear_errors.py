"""A runtime clear() whose index delete fails: a counter and a log, the store keeps serving.

Before, the exception escaped the write thread, the store turned fatal and every later call raised.
The failure is injected where the real index raises it (LmdbIndex.delete_rank -> IndexUnavailable, as
for an I/O error under the LMDB environment); everything else is the real store on real files.
"""

import numpy as np

from l3_helpers import page
from sglang_cp.l3.format.index import IndexUnavailable

P = 16384


def keys(n):
    return [b"k%d" % i for i in range(n)]


def test_failed_clear_is_counted_and_the_store_keeps_its_pages(make_store, monkeypatch):
    s = make_store()
    assert all(s.write_pages("kv", keys(5), [page(i) for i in range(5)], timeout=60))

    def broken(rank):
        raise IndexUnavailable("mdb_del: Input/output error")

    monkeypatch.setattr(s.state.index, "delete_rank", broken)
    assert s.clear() is False
    assert s.stats()["counters"]["clear_errors"] == 1
    # Nothing was freed: every page is still there, byte for byte, and the store takes new writes.
    outs = [np.zeros(P, np.uint8) for _ in range(5)]
    assert s.read_pages("kv", keys(5), outs, timeout=60) == [True] * 5
    assert all(bytes(o) == page(i) for i, o in enumerate(outs))
    assert all(s.write_pages("kv", [b"new"], [page(9)], timeout=60))

    monkeypatch.undo()
    assert s.clear() is True
    assert s.exists_prefix("kv", keys(5) + [b"new"]) == 0 and s.stats()["occupancy"]["kv"]["used"] == 0
    assert s.stats()["cold_start"]["index_entries_wiped"] == 6
