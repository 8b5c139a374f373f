"""Cold start: clear / load / verify, and the invariant that no referenced slot is ever handed out."""

import os

import numpy as np
import pytest

from l3_helpers import config_doc, page, slab_path, slot_offset, flip
from sglang_cp.l3 import L3Store, parse_l3_config
from sglang_cp.l3.format.blob import key_digest
from sglang_cp.l3.format.index import index_key

P = 16384


def keys(n, prefix=b"k"):
    return [prefix + b"%d" % i for i in range(n)]


def reopen(root, mode, rank=0, ranks_per_node=1, payloads=None, **sections):
    cfg = parse_l3_config(config_doc(root, **sections))
    return L3Store(cfg, rank=rank, ranks_per_node=ranks_per_node, payloads=payloads or {"kv": P}, cold_start=mode)


def read_all(s, ks, size=P):
    o = [np.zeros(size, np.uint8) for _ in ks]
    return s.read_pages("kv", ks, o), o


def test_load_restores_pages_lru_and_never_reuses_live_slots(make_store):
    s = make_store()
    ks = keys(30)
    assert all(s.write_pages("kv", ks, [page(i) for i in range(30)]))
    s.touch("kv", ks[:5])
    s.close()
    t = reopen(make_store.root, "load")
    try:
        assert t.stats()["cold_start"]["live"] == 30
        # The persisted touches come back: the 5 touched pages are the warmest after the restart.
        pool = t.state.pools["kv"]
        warmest = {k for k, _ in pool.lru.coldest(30)[-5:]}
        assert warmest == {index_key(pool.tag, key_digest(0, k), 0) for k in ks[:5]}
        ok, o = read_all(t, ks)
        assert all(ok) and all(bytes(o[i]) == page(i) for i in range(30))
        live_slots = {e.slot for _, e in t.state.pools["kv"].lru.coldest(1000)}
        assert len(live_slots) == 30
        # New writes after a load must land in free slots only.
        assert all(t.write_pages("kv", keys(30, b"new"), [page(100 + i) for i in range(30)]))
        ok, o = read_all(t, ks)
        assert all(ok) and all(bytes(o[i]) == page(i) for i in range(30)), "a live blob was clobbered"
        new_slots = {e.slot for k, e in t.state.pools["kv"].lru.coldest(1000)} - live_slots
        assert len(new_slots) == 30
    finally:
        t.close()


def test_clear_wipes_only_this_rank(make_store):
    a = make_store(rank=0, ranks_per_node=2)
    b = make_store(rank=1, ranks_per_node=2)
    assert all(a.write_pages("kv", keys(5), [page(i) for i in range(5)]))
    assert all(b.write_pages("kv", keys(5), [page(i) for i in range(5)]))
    a.close()
    a2 = reopen(make_store.root, "clear", rank=0, ranks_per_node=2)
    try:
        assert a2.exists_prefix("kv", keys(5)) == 0
        assert b.exists_prefix("kv", keys(5)) == 5 and all(read_all(b, keys(5))[0])
    finally:
        a2.close()


def test_load_drops_dangling_and_corrupt_entries(make_store):
    s = make_store()
    ks = keys(10)
    assert all(s.write_pages("kv", ks, [page(i) for i in range(10)]))
    path = slab_path(s)
    off = {k: slot_offset(s, k) for k in ks}
    s.close()
    fd = os.open(path, os.O_RDWR)
    # Kill the header of k3's slot and the payload of k7 (load checks headers; verify also payloads).
    os.pwrite(fd, b"\0" * 64, off[b"k3"] + P)
    os.pwrite(fd, b"\xAA" * 100, off[b"k7"] + 10)
    os.close(fd)
    t = reopen(make_store.root, "load")
    try:
        cs = t.stats()["cold_start"]
        assert cs["live"] == 9 and cs["dropped"] == 1 and cs["drop_reasons"] == {"bad_magic": 1}
        ok, o = read_all(t, ks)
        assert ok == [i not in (3, 7) for i in range(10)], "payload rot is a miss on read"
        assert all(bytes(o[i]) == page(i) for i in range(10) if ok[i])
        assert t.stats()["counters"]["crc_errors"] == 1
    finally:
        t.close()
    # verify finds payload rot at start (k7 was already dropped on read; rot another one now).
    flip(path, off[b"k1"] + P - 1)
    v = reopen(make_store.root, "verify")
    try:
        cs = v.stats()["cold_start"]
        assert cs["mode"] == "verify" and cs["drop_reasons"] == {"crc_mismatch": 1} and cs["live"] == 7
    finally:
        v.close()


def test_entries_outside_the_slab_are_dropped_on_load(make_store):
    s = make_store(capacity_gb=0.02)
    assert all(s.write_pages("kv", keys(200), [page(i) for i in range(200)]))
    total = s.stats()["occupancy"]["kv"]["total"]
    s.close()
    # Shrink the disk budget: slots beyond the new slab end cannot be live any more.
    t = reopen(make_store.root, "load", capacity_gb=0.02 * 100 / total)
    try:
        cs = t.stats()["cold_start"]
        new_total = t.stats()["occupancy"]["kv"]["total"]
        assert new_total < 200 and cs["live"] <= new_total
        assert cs["live"] + cs["dropped"] == 200 and cs["drop_reasons"].get("geometry", 0) > 0
        assert all(e.slot < new_total for _, e in t.state.index.scan_rank(0))
    finally:
        t.close()


def test_changed_page_size_never_misreads_old_slots(make_store):
    s = make_store(payloads={"kv": P})
    assert all(s.write_pages("kv", keys(5), [page(i) for i in range(5)]))
    s.close()
    t = reopen(make_store.root, "load", payloads={"kv": 8192})
    try:
        o = [np.zeros(8192, np.uint8) for _ in range(5)]
        assert t.read_pages("kv", keys(5), o) == [False] * 5
        assert t.stats()["cold_start"]["dropped"] == 5
    finally:
        t.close()


def test_unknown_cold_start_mode_fails_loud(make_store):
    s = make_store()
    s.close()
    with pytest.raises(ValueError, match="--cp-l3-cold-start"):
        reopen(make_store.root, "keep")


def test_vanished_slab_files_are_misses_after_restart(make_store):
    s = make_store(payloads={"kv": P, "ix": 4096})
    assert all(s.write_pages("kv", keys(10), [page(i) for i in range(10)]))
    assert all(s.write_pages("ix", keys(10), [page(i, 4096) for i in range(10)]))
    kv_path = slab_path(s, "kv")
    s.close()
    os.unlink(kv_path)  # the disk (or the file) is gone; the index still names its slots
    t = reopen(make_store.root, "load", payloads={"kv": P, "ix": 4096})
    try:
        cs = t.stats()["cold_start"]
        assert cs["live"] == 10 and cs["dropped"] == 10, cs
        assert t.read_pages("kv", keys(10), [np.zeros(P, np.uint8) for _ in range(10)]) == [False] * 10
        assert t.read_pages("ix", keys(10), [np.zeros(4096, np.uint8) for _ in range(10)]) == [True] * 10
        assert all(t.write_pages("kv", keys(10), [page(i) for i in range(10)]))
    finally:
        t.close()
