"""Index format 2: rank-prefixed keys (cold start touches only its own rank's range), one key digest
shared by every payload, and the format stamp that refuses an older index instead of missing silently.

Real LMDB environments on disk; the format-1 index is written the way format 1 laid it out.
"""

import glob
import os
import struct

import lmdb
import pytest

from l3_helpers import config_doc, each_reference, page
from sglang_cp.l3 import L3Store, L3StartupError, parse_l3_config
from sglang_cp.l3.format.blob import payload_tag
from sglang_cp.l3.format.index import FORMAT, META_KEY, IndexEntry, LmdbIndex, index_key, key_prefix

P = 4096


def _raw_env(path):
    os.makedirs(path, exist_ok=True)
    return lmdb.open(path, map_size=1 << 22, subdir=True, mode=0o600)


def test_a_fresh_index_is_stamped_and_the_stamp_is_not_an_entry(l3_root):
    path = os.path.join(l3_root, "idx")
    ix = LmdbIndex(path, 1 << 20, 1 << 22)
    assert ix.count() == 0 and ix.all_entries() == []
    ix.commit(puts=[(index_key(7, bytes(16), 3), IndexEntry(3, 0, 1, 7, 4096, 1, 1))])
    assert ix.count() == 1 and [e.rank for _, e in ix.all_entries()] == [3]
    ix.close()
    env = _raw_env(path)
    with env.begin() as txn:
        assert txn.get(META_KEY) == b"%d" % FORMAT
    env.close()
    LmdbIndex(path, 1 << 20, 1 << 22).close()  # reopening our own format is fine


def _format1_index(path, n=5):
    """What format 1 wrote: key = payload tag (4 B) + blake2b(payload, rank, key) (16 B), no stamp."""
    env = _raw_env(path)
    with env.begin(write=True) as txn:
        for i in range(n):
            txn.put(struct.pack("<I", payload_tag("kv")) + i.to_bytes(16, "little"),
                    IndexEntry(0, 0, i, payload_tag("kv"), P, 1, 1).pack())
    env.close()


def _raw_count(path):
    env = _raw_env(path)
    try:
        with env.begin() as txn:
            return txn.stat()["entries"]
    finally:
        env.close()


def test_a_format1_index_is_refused_loudly_and_left_untouched(l3_root):
    path = os.path.join(l3_root, "idx")
    _format1_index(path)
    with pytest.raises(L3StartupError, match=r"index\.dir: .* is format 1, written by an older sglang-cp.*"
                                             r"delete data\.mdb and lock\.mdb"):
        LmdbIndex(path, 1 << 20, 1 << 22)
    assert _raw_count(path) == 5  # not stamped, not wiped


def test_the_store_refuses_a_format1_index_before_creating_a_slab(l3_root):
    _format1_index(os.path.join(l3_root, "idx"))
    cfg = parse_l3_config(config_doc(l3_root))
    for mode in ("clear", "load"):
        with pytest.raises(L3StartupError, match="format 1"):
            L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}, cold_start=mode)
    assert not glob.glob(os.path.join(l3_root, "d0", "**", "*.slab"), recursive=True)
    assert _raw_count(os.path.join(l3_root, "idx")) == 5  # 'clear' did not run on it


def test_an_unknown_format_is_refused(l3_root):
    path = os.path.join(l3_root, "idx")
    LmdbIndex(path, 1 << 20, 1 << 22).close()
    env = _raw_env(path)
    with env.begin(write=True) as txn:
        txn.put(META_KEY, b"%d" % (FORMAT + 1))
    env.close()
    with pytest.raises(L3StartupError, match=f"format b'{FORMAT + 1}', not one this sglang-cp writes"):
        LmdbIndex(path, 1 << 20, 1 << 22)


def test_rank_scans_never_read_other_ranks_entries(l3_root):
    """scan_rank / delete_rank are range scans of the rank's key prefix: values under other ranks'
    prefixes are never even decoded (here they would not decode), so cold start costs this rank's
    entries, not the node's."""
    path = os.path.join(l3_root, "idx")
    ix = LmdbIndex(path, 1 << 20, 1 << 22)
    mine = [(index_key(7, i.to_bytes(16, "big"), 1), IndexEntry(1, 0, i, 7, P, 1, 1)) for i in range(5)]
    ix.commit(puts=mine)
    with ix.env.begin(write=True) as txn:  # neighbours on both sides of rank 1's range
        for r in (0, 2, 0xFFFF):
            for i in range(3):
                txn.put(key_prefix(r, 7) + i.to_bytes(16, "big"), b"not an entry")
    assert ix.scan_rank(1) == mine
    assert ix.delete_rank(1) == 5
    assert ix.scan_rank(1) == [] and ix.delete_rank(1) == 0
    with ix.env.begin() as txn:
        assert txn.stat()["entries"] == 1 + 9  # the stamp and the other ranks' rows, untouched
    ix.close()


def test_cold_start_keeps_other_ranks_entries(l3_root):
    cfg = parse_l3_config(config_doc(l3_root, capacity_gb=0.004))
    ks = [b"k%d" % i for i in range(6)]
    for rank in (0, 1):
        s = L3Store(cfg, rank=rank, ranks_per_node=2, payloads={"kv": P, "ix": P}, cold_start="clear")
        for p in ("kv", "ix"):
            assert all(s.write_pages(p, ks, [page(i, P) for i in range(6)]))
        s.close()
    s = L3Store(cfg, rank=1, ranks_per_node=2, payloads={"kv": P, "ix": P}, cold_start="load")
    assert s.stats()["cold_start"]["live"] == 12 and s.exists_prefix_multi(["kv", "ix"], ks) == 6
    s.close()
    s = L3Store(cfg, rank=0, ranks_per_node=2, payloads={"kv": P, "ix": P}, cold_start="clear")
    assert s.stats()["cold_start"]["index_entries_wiped"] == 12 and s.state.index.count() == 12  # rank 1's
    s.close()
    s = L3Store(cfg, rank=1, ranks_per_node=2, payloads={"kv": P, "ix": P}, cold_start="load")
    assert s.exists_prefix_multi(["kv", "ix"], ks) == 6  # rank 0's clear left rank 1 whole
    s.close()


def _first_miss(xs: list[bool]) -> int:
    return xs.index(False) if False in xs else len(xs)


def test_hit_query_across_chunk_boundaries_matches_a_per_key_reference(make_store):
    """The hit query works in growing chunks (64, 128, 256, ... keys) of C-level passes; holes on and
    around chunk edges must answer exactly what a key-by-key scan answers."""
    s = make_store(payloads={"kv": P, "ix": P}, capacity_gb=0.04)
    n = 1100
    ks = [b"hq/%d" % i for i in range(n)]
    for p in ("kv", "ix"):
        for b in range(0, n, 256):
            assert all(s.write_pages(p, ks[b:b + 256], [page(0, P)] * len(ks[b:b + 256])))
    has = {"kv": [True] * n, "ix": [True] * n}
    assert s.exists_prefix("kv", ks) == n and s.exists_prefix_multi(["kv", "ix"], ks) == n
    assert s.exists_prefix("kv", ks + [b"absent"]) == n and s.exists_prefix("kv", []) == 0
    for p, i in (("ix", 1000), ("kv", 448), ("ix", 193), ("kv", 64), ("ix", 63), ("kv", 0)):
        s.delete(p, [ks[i]])
        has[p][i] = False
        present = [a and b for a, b in zip(has["kv"], has["ix"])]
        assert s.exists_prefix("kv", ks) == _first_miss(has["kv"])
        assert s.exists_prefix("ix", ks) == _first_miss(has["ix"])
        assert s.exists_prefix_multi(["kv", "ix"], ks) == _first_miss(present)
        for classes in (1, 3, 8, 64):
            assert s.exists_each(["kv", "ix"], ks, classes=classes) == each_reference(present, classes), (i, classes)
        assert s.exists_each(["kv"], ks, classes=8) == each_reference(has["kv"], 8)


def test_key_prefix_asks_about_the_same_keys(make_store):
    s = make_store(payloads={"kv": P, "ix": P})
    head, tails = b"id/0of2/", [b"%02x" % i for i in range(40)]
    full = [head + t for t in tails]
    assert all(s.write_pages("kv", full, [page(0, P)] * 40)) and all(s.write_pages("ix", full[:30], [page(0, P)] * 30))
    assert s.exists_prefix("kv", tails, key_prefix=head) == s.exists_prefix("kv", full) == 40
    assert s.exists_prefix_multi(["kv", "ix"], tails, key_prefix=head) == 30
    assert s.exists_each(["kv", "ix"], tails, classes=4, key_prefix=head) == s.exists_each(["kv", "ix"], full, classes=4)
    assert s.exists_prefix("kv", tails, key_prefix=b"id/1of2/") == 0  # another head is another key
    assert s.exists_prefix("kv", full[:5] + [b"id/0of2/zz"]) == 5
    with pytest.raises(TypeError, match="key_prefix: must be bytes"):
        s.exists_prefix("kv", tails, key_prefix="id/0of2/")


def test_the_lru_digest_set_follows_the_lru():
    from sglang_cp.l3.gc import PageLRU
    from sglang_cp.l3.format.index import ikey_digest
    lru = PageLRU()
    ks = [index_key(7, i.to_bytes(16, "big"), 3) for i in range(4)]
    for i, k in enumerate(ks):
        lru.add(k, IndexEntry(3, 0, i, 7, P, i, i))
    assert all(lru.holds(ikey_digest(k)) for k in ks)
    lru.remove(ks[1])
    lru.touch(ks[2], 99)
    assert [lru.holds(ikey_digest(k)) for k in ks] == [True, False, True, True]
    assert lru.remove(ks[1]) is None and not lru.holds(ikey_digest(ks[1]))
    lru.seed([(ks[1], IndexEntry(3, 0, 1, 7, P, 1, 1))])
    assert [lru.holds(ikey_digest(k)) for k in ks] == [False, True, False, False]
    lru.clear()
    assert not any(lru.holds(ikey_digest(k)) for k in ks) and len(lru) == 0


def test_str_keys_ask_about_their_utf8_bytes(make_store):
    """The backend passes upstream's page hashes (str) as they are; the store hashes their UTF-8 bytes, so
    the answers equal those of the encoded keys, holes and chunk edges included."""
    from sglang_cp.l3.format.blob import key_digests
    s = make_store(payloads={"kv": P, "ix": P}, capacity_gb=0.04)
    head = "id/0of2/".encode()
    tails = ["%03x" % i if i % 7 else "é%d" % i for i in range(300)]  # some non-ASCII
    full = [head + t.encode() for t in tails]
    assert key_digests(3)(tails, head) == key_digests(3)([t.encode() for t in tails], head)
    for p in ("kv", "ix"):
        assert all(s.write_pages(p, full, [page(0, P)] * len(full)))
    assert s.exists_prefix_multi(["kv", "ix"], tails, key_prefix=head) == 300
    assert s.exists_each(["kv", "ix"], tails, classes=8, key_prefix=head) == [True] * 300
    for p, i in (("ix", 200), ("kv", 70)):
        s.delete(p, [full[i]])
    for classes in (1, 8):
        assert s.exists_each(["kv", "ix"], tails, classes=classes, key_prefix=head) == \
            s.exists_each(["kv", "ix"], full, classes=classes)
    assert s.exists_prefix("ix", tails, key_prefix=head) == 200
    assert s.exists_prefix_multi(["kv", "ix"], tails, key_prefix=head) == 70
    with pytest.raises(TypeError, match=r"keys: must be all bytes or all str; keys\[0\] is str, keys\[5\] is bytes"):
        s.exists_prefix("kv", tails[:5] + [full[5]] + tails[6:], key_prefix=head)
    with pytest.raises(TypeError, match=r"keys\[0\] is bytes, keys\[2\] is str"):
        s.exists_prefix("kv", full[:2] + tails[2:])
    with pytest.raises(TypeError, match=r"keys\[0\] is str, keys\[150\] is bytes"):  # in the second chunk
        s.exists_prefix("kv", tails[:150] + [full[150]] + tails[151:], key_prefix=head)


def test_a_page_being_dropped_is_a_miss_even_in_a_fully_held_chunk(make_store):
    """A bad page a reader found stays in the LRU until the write thread releases it; meanwhile the hit
    query must not offer it, also where every key of its chunk is held (the chunk's fast path)."""
    from sglang_cp.l3.format.blob import key_digest
    s = make_store(payloads={"kv": P, "ix": P}, capacity_gb=0.04)
    ks = [b"dr/%d" % i for i in range(200)]
    for p in ("kv", "ix"):
        assert all(s.write_pages(p, ks, [page(0, P)] * len(ks)))
    ikey = index_key(s.state.pools["ix"].tag, key_digest(s.rank, ks[100]), s.rank)
    with s.state.lock:
        s.state.dropping.add(ikey)  # what _bad_page does before the write thread's release
    try:
        assert s.exists_prefix_multi(["kv", "ix"], ks) == 100
        assert s.exists_prefix("ix", ks) == 100
        assert s.exists_prefix("kv", ks) == 200  # another payload of the key is not being dropped
        assert s.exists_each(["kv", "ix"], ks, classes=4) == each_reference([i != 100 for i in range(200)], 4)
    finally:
        with s.state.lock:
            s.state.dropping.discard(ikey)
    assert s.exists_prefix_multi(["kv", "ix"], ks) == 200


@pytest.mark.parametrize("npay", [3, 5])  # up to 4 payloads the all-held check counts mask's supersets
def test_hit_query_over_a_subset_of_many_payloads(make_store, npay):
    names = ["p%d" % j for j in range(npay)]
    s = make_store(payloads={nm: P for nm in names}, capacity_gb=0.04)
    n = 150
    ks = [b"mp/%d" % i for i in range(n)]
    missing = {"p0": 140, "p1": 90, "p2": 70, "p3": 100, "p4": 120}
    for nm in names:
        have = [k for i, k in enumerate(ks) if i != missing[nm]]
        assert all(s.write_pages(nm, have, [page(0, P)] * len(have)))
    for ask in (names, names[:1], names[1:2], names[:2], [names[0], names[-1]]):
        first = min(missing[nm] for nm in ask)
        assert s.exists_prefix_multi(ask, ks) == first, ask
        assert s.exists_prefix_multi(ask, ks[:first]) == first, ask
        assert s.exists_each(ask, ks, classes=4) == each_reference([i not in {missing[nm] for nm in ask}
                                                                for i in range(n)], 4), ask
