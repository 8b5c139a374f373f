"""The real-server damage tests' slab damage (test/gpu/slab_damage.py), on a real store: it hurts exactly
the pages it says, of the ranks and payloads it is told, and each hurt page is a CRC miss (so a GPU damage
test that reads "recomputed, never served" is looking at pages that were really damaged)."""

import glob
import importlib.util
import os

import numpy as np

from l3_helpers import page

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "gpu", "slab_damage.py")
_spec = importlib.util.spec_from_file_location("slab_damage", _PATH)
slab_damage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slab_damage)

P, N = 16384, 21


def _keys(rank):
    return [b"r%d-%d" % (rank, i) for i in range(N)]


def _hits(store, rank):
    outs = [np.zeros(P, np.uint8) for _ in range(N)]
    ok = store.read_pages("kv", _keys(rank), outs)
    for i, good in enumerate(ok):
        if good:
            assert bytes(outs[i]) == page(i), "a hit returned wrong bytes"
    return ok


def test_damage_hits_only_the_selected_ranks_pages_each_a_crc_miss(make_store):
    stores = [make_store(rank=r, ranks_per_node=2) for r in (0, 1)]
    for r, s in enumerate(stores):
        assert all(s.write_pages("kv", _keys(r), [page(i) for i in range(N)]))
    slabs = sorted(glob.glob(os.path.join(make_store.root, "**", "*.slab"), recursive=True))
    assert {os.path.basename(p).split(".")[0] for p in slabs} == {"r0", "r1"}, slabs

    # Every page of rank 1 (the two-GPU damage case), every 7th of rank 0 from the 4th (the one-GPU one).
    assert slab_damage.flip_payload_bytes(slabs, select=lambda n: n.startswith("r1.")) == N
    hurt0 = slab_damage.flip_payload_bytes(slabs, select=lambda n: n.startswith("r0."), every=7, phase=3, back=777)
    assert hurt0 == len(range(3, N, 7)) == 3

    assert _hits(stores[1], 1) == [False] * N
    assert stores[1].stats()["counters"]["crc_errors"] == N
    ok0 = _hits(stores[0], 0)
    assert ok0.count(False) == hurt0, ok0
    assert stores[0].stats()["counters"]["crc_errors"] == hurt0
    # A payload that no file name carries: nothing is touched.
    assert slab_damage.flip_payload_bytes(slabs, select=lambda n: ".indexer.s" in n) == 0
