"""HeldDigests' batch table (the hit query's vectorized lookup at millions of held pages): it must answer
exactly what its dict answers through puts, discards (tombs), growth rebuilds, long probe chains and
bulk drop/rebuild; and the store's hit query over chunks that use it must match a per-key reference."""

import os
import random
import struct

import numpy as np
import pytest

from l3_helpers import each_reference, page
from sglang_cp.l3 import held as l3held
from sglang_cp.l3.held import HeldDigests

P = 4096


@pytest.fixture(autouse=True, params=["native", "numpy"])
def probe_engine(request, monkeypatch):
    """Every test of the table runs on both batch lookups: the C probe (which keeps the GIL) and numpy."""
    from sglang_cp.l3 import native

    monkeypatch.setattr(l3held, "_NATIVE_PROBE", request.param == "native")
    if request.param == "native":
        assert native.held_probe(np.zeros(4096, np.uint64), b"", 1, 0) is not None, "no native library"
    return request.param


def _digest(rng: random.Random, home: int = None) -> bytes:
    """A random 16-byte digest; with `home`, its second word's low 12 bits are `home` (one probe chain
    in a 4096-slot table)."""
    a, b = rng.getrandbits(64), rng.getrandbits(64)
    if home is not None:
        b = (b & ~0xFFF) | home
    return struct.pack("<QQ", a, b)


def _agree(h: HeldDigests, digests: list[bytes]) -> None:
    got = h.many(digests)
    assert got is not None
    want = [h.get(d, 0) for d in digests]
    assert got.tolist() == want


def test_the_table_answers_what_the_dict_answers_through_puts_discards_and_rebuilds():
    rng = random.Random(7)
    h = HeldDigests()
    h.rebuild_table()
    cap0 = h._table[1] + 1
    live: list[bytes] = []
    chain = [_digest(rng, home=5) for _ in range(40)]  # one long probe chain with tombs inside it
    others = [_digest(rng) for _ in range(4000)]       # enough to grow the table past its first size
    absent = [_digest(rng) for _ in range(500)] + [_digest(rng, home=5) for _ in range(20)]
    for d in chain:
        h.add(d, 1)
        h.add(d, 2)
    tab = h._table[0]
    assert ((tab[5:5 + 40] & 0xFFFF) != 0).all(), "the chain's keys do not sit in one probe run from slot 5"
    for i, d in enumerate(chain):
        if i % 3 == 0:
            h.discard(d, 1)
            h.discard(d, 2)  # a tomb in the middle of the chain: later keys must stay reachable
        elif i % 3 == 1:
            h.discard(d, 2)
    _agree(h, chain + absent)
    for i, d in enumerate(others):
        h.add(d, 1 << (i % 3))
        live.append(d)
        if i % 5 == 0:
            h.discard(live[i // 2], 1 << ((i // 2) % 3))
        if i % 400 == 0:
            _agree(h, chain + live + absent)
    assert h._table[1] + 1 > cap0, "the table never grew"
    for i, d in enumerate(chain):
        if i % 3 == 0:
            h.add(d, 4)  # back from a tomb
    _agree(h, chain + live + absent)
    assert h.many([]).tolist() == []
    h.drop_table()
    assert h.many(chain) is None  # no table: the caller asks the dict
    h.rebuild_table()
    _agree(h, chain + live + absent)


def test_a_chain_longer_than_the_probe_bound_is_answered_by_the_dict(monkeypatch):
    monkeypatch.setattr(l3held, "_MAX_PROBES", 8)
    rng = random.Random(3)
    h = HeldDigests()
    h.rebuild_table()
    chain = [_digest(rng, home=9) for _ in range(30)]
    for d in chain:
        h.add(d, 1)
    h.discard(chain[20], 1)
    _agree(h, chain + [_digest(rng, home=9)])


def test_more_pools_than_the_value_has_bits_leave_the_dict_to_answer():
    h = HeldDigests()
    h.rebuild_table()
    d = os.urandom(16)
    h.add(d, 1 << 15)
    assert h.many([d]) is None and h.get(d) == 1 << 15
    h.rebuild_table()
    assert h.many([d]) is None


def test_a_digest_of_another_length_is_an_invariant_error():
    from sglang_cp.l3.errors import L3InvariantError
    h = HeldDigests()
    h.rebuild_table()
    with pytest.raises(L3InvariantError, match="not 16 bytes"):
        h.many([b"short"])


def test_hit_query_chunks_on_the_table_match_a_per_key_reference(make_store):
    """4,100 keys: the chunks of 1,024 and 2,048 keys are looked up in the table, the others in the dict."""
    s = make_store(payloads={"kv": P, "ix": P}, capacity_gb=0.12)
    assert s.state.held.has_table, "cold start did not build the table"
    n = 4100
    ks = [b"tb/%d" % i for i in range(n)]
    for p in ("kv", "ix"):
        for b in range(0, n, 512):
            assert all(s.write_pages(p, ks[b:b + 512], [page(0, P)] * len(ks[b:b + 512])))
    assert s.exists_prefix_multi(["kv", "ix"], ks) == n
    assert s.exists_each(["kv", "ix"], ks, classes=8) == [True] * n
    has = {"kv": [True] * n, "ix": [True] * n}
    for p, i in (("ix", 3500), ("kv", 2100), ("ix", 1500)):
        s.delete(p, [ks[i]])
        has[p][i] = False
        both = [a and b for a, b in zip(has["kv"], has["ix"])]
        assert s.exists_prefix("kv", ks) == (has["kv"].index(False) if False in has["kv"] else n)
        assert s.exists_prefix("ix", ks) == has["ix"].index(False)
        assert s.exists_prefix_multi(["kv", "ix"], ks) == both.index(False)
        for classes in (1, 8):
            assert s.exists_each(["kv", "ix"], ks, classes=classes) == each_reference(both, classes)
    # A restart seeds the LRU from the index (no per-key puts) and builds the table once.
    s.close()
    s = make_store(payloads={"kv": P, "ix": P}, capacity_gb=0.12, cold_start="load")
    assert s.state.held.has_table, "cold start 'load' did not build the table"
    both = [a and b for a, b in zip(has["kv"], has["ix"])]
    assert s.exists_prefix_multi(["kv", "ix"], ks) == both.index(False)
    assert s.exists_each(["kv", "ix"], ks, classes=8) == each_reference(both, 8)
    assert s.exists_prefix("kv", ks) == has["kv"].index(False)


def test_a_long_hit_query_keeps_the_gil(make_store, probe_engine):
    """16,384 keys (a 1M-token prefix) through the table without releasing the GIL: the hit query runs on
    upstream's prefetch thread beside the scheduler's busy Python thread, where numpy's array operations
    (each releases the GIL over 500 elements) took 258 ms instead of 6.6 ms alone."""
    from suite_helpers import gil_releases_seen

    if probe_engine == "numpy":
        pytest.skip("the numpy lookup releases the GIL by design (it is the fallback without the library)")
    s = make_store(payloads={"kv": P}, capacity_gb=0.2)
    ks = [b"gl/%d" % i for i in range(16384)]
    for i in range(0, len(ks), 1024):
        assert all(s.write_pages("kv", ks[i:i + 1024], [page(j % 8, P) for j in range(1024)]))
    assert s.state.held.has_table
    flags, ran = gil_releases_seen(s.exists_each, ["kv"], ks, 8)
    assert ran == 0, f"the hit query released the GIL: another thread ran {ran} loop turns meanwhile"
    assert flags == [True] * len(ks)
