"""Corruption on disk is always detected: bit flips (payload, header), truncation, blobs copied between
slots. Each bad page is exactly one miss, is dropped from the index, and can be written again."""

import os
import time

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from l3_helpers import flip, page, slab_path, slot_offset
from sglang_cp.l3.format.blob import HEADER_BYTES

P = 16384
N = 16


def keys(n=N):
    return [b"c%d" % i for i in range(n)]


def read(s, ks):
    o = [np.zeros(P, np.uint8) for _ in ks]
    ok = s.read_pages("kv", ks, o)
    for i, good in enumerate(ok):
        if good:
            assert bytes(o[i]) == page(i), "a hit returned wrong bytes"
    return ok


def expect_single_miss(s, bad):
    ks = keys()
    ok = read(s, ks)
    assert ok == [i != bad for i in range(N)], f"exactly page {bad} must miss: {ok}"
    # Dropped from the index: the prefix stops there, and the slot went back to the pool.
    assert s.exists_prefix("kv", ks) == bad
    s.write_pages("kv", [b"sync"], [page(0)])  # a write-thread round trip: the drop has been applied
    assert s.stats()["counters"]["bad_pages_dropped"] >= 1
    # Writable again, then a hit with the right bytes.
    assert s.write_pages("kv", [ks[bad]], [page(bad)]) == [True]
    assert read(s, ks) == [True] * N


def fill(make_store):
    s = make_store()
    assert all(s.write_pages("kv", keys(), [page(i) for i in range(N)]))
    return s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.integers(0, N - 1), pos=st.integers(0, P + HEADER_BYTES - 1), bit=st.integers(0, 7))
def test_any_bit_flip_in_payload_or_header_is_a_miss(make_store, bad, pos, bit):
    s = fill(make_store)
    try:
        flip(slab_path(s), slot_offset(s, keys()[bad]) + pos, 1 << bit)
        expect_single_miss(s, bad)
        c = s.stats()["counters"]
        assert c["crc_errors"] + c["header_errors"] + c["foreign_blobs"] == 1
        assert (c["crc_errors"] == 1) == (pos < P)
    finally:
        s.clear()
        s.close()


def test_blob_copied_from_another_slot_is_foreign(make_store):
    s = fill(make_store)
    path = slab_path(s)
    src, dst = slot_offset(s, b"c2"), slot_offset(s, b"c5")
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, os.pread(fd, P + HEADER_BYTES, src), dst)  # a perfectly valid blob, wrong place
    os.fsync(fd)
    os.close(fd)
    expect_single_miss(s, 5)
    assert s.stats()["counters"]["foreign_blobs"] == 1


def test_truncated_slab_fails_only_the_cut_pages(make_store):
    s = fill(make_store)
    path = slab_path(s)
    offs = sorted((slot_offset(s, k), i) for i, k in enumerate(keys()))
    last_off, last_i = offs[-1]
    os.truncate(path, last_off + P // 2)  # the last written slot is cut in half
    ok = read(s, keys())
    assert ok == [i != last_i for i in range(N)]
    assert s.stats()["counters"]["short_reads"] == 1
    assert s.exists_prefix("kv", [keys()[last_i]]) == 0


def test_zeroed_slot_is_a_miss(make_store):
    s = fill(make_store)
    fd = os.open(slab_path(s), os.O_RDWR)
    os.pwrite(fd, bytes(P + 4096), slot_offset(s, b"c9"))
    os.fsync(fd)
    os.close(fd)
    expect_single_miss(s, 9)


def test_coalesced_reads_isolate_bad_pages(make_store):
    from l3_helpers import aligned_pages
    s = fill(make_store)
    flip(slab_path(s), slot_offset(s, b"c6") + 3)
    offs = sorted((slot_offset(s, k), i) for i, k in enumerate(keys()))
    os.truncate(slab_path(s), offs[-1][0] + 4096)  # the last slot of the last run comes back short
    o = aligned_pages(N, P)
    ok = s.read_pages("kv", keys(), o)
    assert ok == [i not in (6, offs[-1][1]) for i in range(N)]
    assert all(bytes(o[i]) == page(i) for i in range(N) if ok[i])
    c = s.stats()["counters"]
    assert c["crc_errors"] == 1 and c["short_reads"] == 1


def test_a_slot_reclaimed_and_rewritten_after_the_lookup_is_a_miss(make_store):
    """A read finds its slots among this rank's durable pages (the pool's LRU) and reads them later, on
    an I/O thread. A page deleted after that lookup, its slot handed to another page before the read's
    I/O, is a miss with a counter: never the other page's bytes (the header names another key)."""
    import threading

    from sglang_cp.l3.format.index import index_key

    s = make_store()
    ks = keys(4)
    assert s.write_pages("kv", ks, [page(i) for i in range(4)]) == [True] * 4
    pool = s.state.pool("kv")

    def slot_of(key):
        return pool.lru.get(index_key(pool.tag, s.state.digest(key), 0)).slot

    first_slot = slot_of(ks[0])
    entered, go = threading.Event(), threading.Event()
    for name in ("_read_io", "_read_io_native"):  # hold the read's I/O until the slot changed hands
        real = getattr(s.reads, name)

        def held(*args, _real=real):
            entered.set()
            assert go.wait(30)
            return _real(*args)
        setattr(s.reads, name, held)
    out = [np.zeros(P, np.uint8)]
    pending = s.start_read_pages("kv", [ks[0]], out, timeout=60)
    assert entered.wait(30), "the read never reached its I/O thread"
    assert s.delete("kv", [ks[0]]) == 1
    assert s.write_pages("kv", [b"other"], [page(9)]) == [True]
    assert slot_of(b"other") == first_slot, "the test needs the freed slot reused"
    go.set()
    assert s.finish_read_pages(pending) == [False]
    assert not out[0].any(), "a miss wrote the caller's page"
    assert s.stats()["counters"]["foreign_blobs"] == 1
    got = [np.zeros(P, np.uint8)]
    assert s.read_pages("kv", [b"other"], got) == [True] and bytes(got[0]) == page(9)  # untouched by the drop


def test_a_page_dropped_as_bad_is_written_again_before_the_write_thread_forgets_it(make_store):
    """A reader that finds a bad page deletes its index entry, acks the miss, and leaves the slot to the
    write thread (a Drop). A write of that key in between must really write it: the "already durable"
    check must not answer from the pool's LRU, which holds the entry until the Drop is handled."""
    import threading

    s = make_store()
    ks = keys(8)
    assert all(s.write_pages("kv", ks, [page(i) for i in range(8)]))
    flip(slab_path(s), slot_offset(s, ks[5]) + 7)
    held, real = threading.Event(), s._writer._drop

    def drop_later(m):
        assert held.wait(30)
        real(m)
    s._writer._drop = drop_later  # the write thread takes the Drop only after the rewrite below
    o = [np.zeros(P, np.uint8) for _ in range(8)]
    assert s.read_pages("kv", ks, o)[5] is False
    spilled = s.stats()["counters"]["spill_pages"]
    box = {}
    writer = threading.Thread(target=lambda: box.update(ok=s.write_pages("kv", [ks[5]], [page(5)])))
    writer.start()
    time.sleep(0.3)  # the rewrite is submitted (and waits behind the held Drop for its commit)
    held.set()
    writer.join(30)
    assert box.get("ok") == [True]
    assert s.stats()["counters"]["spill_pages"] == spilled + 1, "the rewrite was taken for a durable page"
    assert s.read_pages("kv", ks, o) == [True] * 8 and bytes(o[5]) == page(5)


def _corrupt_slot(s, slot):
    """Flip payload bytes in ``slot`` (through the page cache, fsync'd: an O_DIRECT read sees them)."""
    pool = s.state.pools["kv"]
    fd = os.open(pool.slab.path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff" * 16, slot * pool.slab.slot_bytes + HEADER_BYTES + 100)
        os.fsync(fd)
    finally:
        os.close(fd)


def _hold_drops(s, monkeypatch):
    """Drops a reader posts are held back (returned to post later), to order them against the write thread."""
    from sglang_cp.l3.messages import Drop

    held, post = [], s.state.post
    monkeypatch.setattr(s.state, "post", lambda m: held.append(m) if isinstance(m, Drop) else post(m))
    return held, post


def test_a_page_dropped_after_its_commit_landed_leaves_no_entry_naming_its_slot(make_store, monkeypatch):
    """backup_ack = "written": a read of a page whose group commit is pending finds it bad, and its index
    delete finds nothing yet. When the commit lands before the write thread handles the drop, the drop
    deletes the entry before it frees the slot: no two entries ever name one slot."""
    from l3_helpers import held_sync, wait_for

    inj, gate, _syncs = held_sync()
    s = make_store(fault_injector=inj, durability={"backup_ack": "written"})
    st = s.state
    held, post = _hold_drops(s, monkeypatch)
    assert s.write_pages("kv", [b"K"], [page(1)]) == [True]
    assert st.index.count() == 0  # its commit waits on the held fdatasync
    _corrupt_slot(s, next(iter(st.inflight.values())).slot)
    assert read_one(s, b"K") is False
    assert len(held) == 1 and held[0].deleted is False
    gate.set()
    wait_for(lambda: st.index.count() == 1 and not st.inflight, "the commit landing")
    post(held[0])
    wait_for(lambda: not st.dropping, "the drop handled")
    assert st.index.count() == 0, "the bad page's entry outlived its slot"
    assert s.write_pages("kv", [b"K2"], [page(2)]) == [True]  # may take the freed slot
    wait_for(lambda: not st.inflight, "K2 committed")
    slots = [e.slot for _, e in st.index.all_entries()]
    assert len(slots) == len(set(slots)) == 1
    assert s.stats()["counters"]["bad_pages_dropped"] == 1


def test_a_bad_page_freed_first_by_another_path_is_counted_once(make_store, monkeypatch):
    """The soak's balance (spilled - replaced - reclaimed - dropped == live growth) counts each freed slot
    once: a delete that frees a bad page before the reader's drop reaches the write thread counts it, and
    the drop does not count it again."""
    s = make_store()
    st = s.state
    assert s.write_pages("kv", [b"K"], [page(1)]) == [True]
    _corrupt_slot(s, st.index.all_entries()[0][1].slot)
    held, post = _hold_drops(s, monkeypatch)
    before = dict(s.stats()["counters"])
    assert read_one(s, b"K") is False and held and held[0].deleted is True
    assert s.delete("kv", [b"K"]) == 1  # the reader deleted its entry; the delete frees the LRU's page
    post(held[0])
    from l3_helpers import wait_for

    wait_for(lambda: not st.dropping, "the drop handled")
    after = s.stats()["counters"]
    freed = sum(after[k] - before[k] for k in ("deleted_pages", "bad_pages_dropped", "gc_reclaimed"))
    assert freed == 1 and s.stats()["occupancy"]["kv"]["used"] == 0


def test_a_delete_naming_a_key_twice_deletes_it_once(make_store):
    s = make_store()
    assert s.write_pages("kv", [b"a", b"b"], [page(1), page(2)]) == [True, True]
    assert s.delete("kv", [b"a", b"a"]) == 1
    assert s.write_pages("kv", [b"c"], [page(3)]) == [True]  # the store is alive
    assert read_one(s, b"a") is False and read_one(s, b"b") is True


def read_one(s, key):
    return s.read_pages("kv", [key], [np.zeros(P, np.uint8)])[0]
