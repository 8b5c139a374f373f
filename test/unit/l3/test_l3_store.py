"""L3Store behaviour on real O_DIRECT slabs and a real LMDB index."""

import os
import threading

import numpy as np
import pytest

from l3_helpers import page, settle, wait_for
from sglang_cp.l3 import AckKind, L3StartupError, L3Store, parse_l3_config
from sglang_cp.l3.format.blob import write_extent

P = 16384


def keys(n, prefix=b"k"):
    return [prefix + b"%d" % i for i in range(n)]


def outs(n, size=P):
    return [np.zeros(size, np.uint8) for _ in range(n)]


def drain_until(store, pred, limit=200000):
    got = []
    for _ in range(limit):
        got += store.drain_acks()
        if pred(got):
            return got
        threading.Event().wait(0.001)
    raise AssertionError(f"acks never arrived: {got}")


def test_round_trip_and_prefix(make_store):
    s = make_store(payloads={"kv": P, "ix": 4096})
    ks = keys(20)
    assert s.write_pages("kv", ks, [page(i) for i in range(20)]) == [True] * 20
    assert s.write_pages("ix", ks[:10], [page(i, 4096) for i in range(10)]) == [True] * 10
    o = outs(20)
    assert s.read_pages("kv", ks, o) == [True] * 20
    assert all(bytes(o[i]) == page(i) for i in range(20))
    assert s.exists_prefix("kv", ks) == 20
    assert s.exists_prefix("kv", ks[:5] + [b"missing"] + ks[5:]) == 5
    assert s.exists_prefix_multi(["kv", "ix"], ks) == 10
    assert s.exists_prefix("ix", [b"missing"]) == 0
    st = s.stats()
    assert st["occupancy"]["kv"]["used"] == 20 and st["counters"]["spill_pages"] == 30
    assert st["counters"]["reload_hits"] == 20


def test_unaligned_and_odd_sized_buffers(make_store):
    s = make_store(payloads={"odd": 5000})
    data = [bytes([i]) * 5000 for i in range(4)]
    assert all(s.write_pages("odd", keys(4), [bytearray(d) for d in data]))
    # bytearrays are rarely 4 KiB aligned: the read goes through a bounce buffer, bytes must match.
    o = [bytearray(5000) for _ in range(4)]
    big = np.zeros(5000 + 7, np.uint8)
    o[3] = big[7:]  # deliberately misaligned numpy view
    assert s.read_pages("odd", keys(4), o) == [True] * 4
    assert [bytes(x) for x in o] == data


def test_async_acks_gathered_then_durable_and_memory_reusable(make_store):
    s = make_store()
    bufs = [bytearray(page(i)) for i in range(8)]
    op = s.submit_write("kv", keys(8), bufs)
    for b in bufs:  # GATHERED semantics: the caller may scribble on its memory right after submit
        b[:] = b"\xff" * P
    acks = drain_until(s, lambda a: sum(x.kind is AckKind.DURABLE for x in a) == 8)
    assert {a.op for a in acks} == {op}
    for i in range(8):
        mine = [a for a in acks if a.index_in_op == i]
        assert [a.kind for a in mine] == [AckKind.GATHERED, AckKind.DURABLE] and all(a.ok for a in mine)
        assert mine[0].key == b"k%d" % i
    o = outs(8)
    rop = s.submit_read("kv", keys(8) + [b"nope"], o + [np.zeros(P, np.uint8)])
    racks = drain_until(s, lambda a: len(a) == 9)
    assert all(a.op == rop and a.kind is AckKind.READ for a in racks)
    assert sorted((a.index_in_op, a.ok) for a in racks) == [(i, i < 8) for i in range(9)]
    assert all(bytes(o[i]) == page(i) for i in range(8))


def test_sync_helpers_do_not_steal_async_acks(make_store):
    s = make_store()
    op = s.submit_write("kv", keys(4, b"a"), [page(i) for i in range(4)])
    assert s.write_pages("kv", keys(4, b"b"), [page(i) for i in range(4)]) == [True] * 4
    assert s.read_pages("kv", keys(4, b"b"), outs(4)) == [True] * 4
    acks = drain_until(s, lambda a: sum(x.kind is AckKind.DURABLE for x in a) == 4)
    assert {a.op for a in acks} == {op} and len(acks) == 8  # only the async op's acks, all of them


def test_inflight_duplicates_are_written_once(make_store):
    gate = threading.Event()
    writes = []

    def hold_writes(op, slab, slot):
        if op == "write":
            writes.append(slot)
            gate.wait(30)
    s = make_store(fault_injector=hold_writes)
    k = [b"dup"] * 3 + [b"other"]
    op1 = s.submit_write("kv", k, [page(1), page(1), page(1), page(2)])
    op2 = s.submit_write("kv", [b"dup"], [page(1)])
    gate.set()
    acks = drain_until(s, lambda a: sum(x.kind is AckKind.DURABLE for x in a) == 5)
    assert all(a.ok for a in acks) and {a.op for a in acks} == {op1, op2}
    st = s.stats()["counters"]
    assert st["spill_pages"] == 2 and st["write_dedup_pages"] == 3 and len(writes) == 2
    # Already durable: acknowledged without another write.
    assert s.write_pages("kv", [b"dup"], [page(1)]) == [True]
    assert s.stats()["counters"]["write_already_durable"] == 1 and len(writes) == 2


def _submit_in_thread(store, n):
    """submit_write of n pages on another thread (it may block on backpressure); (thread, done)."""
    done = threading.Event()

    def submit():
        store.submit_write("kv", keys(n), [page(i) for i in range(n)])
        done.set()
    t = threading.Thread(target=submit)
    t.start()
    return t, done


def test_backpressure_blocks_submit_until_pages_are_written(make_store):
    gate = threading.Event()
    s = make_store(io={"max_inflight_pages": 4, "threads": 2},
                   fault_injector=lambda op, slab, slot: gate.wait(30) if op == "write" else None)
    t, done = _submit_in_thread(s, 10)
    # The submitter fills the 4 staging slots at its own pace (a loaded machine: seconds), then blocks.
    wait_for(lambda: s.stats()["inflight"]["staging_pages"] == 4, "the submitter holding all 4 staging slots")
    assert not done.wait(0.5), "submit_write returned although 10 pages cannot fit 4 staging slots"
    assert s.stats()["inflight"]["staging_pages"] == 4
    gate.set()
    t.join(30)
    assert done.is_set()
    drain_until(s, lambda a: sum(x.kind is AckKind.DURABLE for x in a) == 10)
    assert s.stats()["inflight"]["staging_pages"] == 0


def test_stuck_commit_bounds_uncommitted_writes(make_store, monkeypatch):
    """Staging tokens return when a pwrite returns, so a hung fdatasync must still stop the writers:
    past the uncommitted-bytes bound nothing new is written, staging fills and submit blocks."""
    from sglang_cp.l3 import writer
    monkeypatch.setattr(writer, "_GROUP_BYTES", 2 * P)
    monkeypatch.setattr(writer, "_MAX_UNCOMMITTED_BYTES", 4 * P)
    gate = threading.Event()
    syncs, written = [], []

    def injector(op, slab, slot):
        if op == "write":
            written.append(slot)
        elif op == "sync":
            syncs.append(slot)
            gate.wait(30)
    s = make_store(io={"max_inflight_pages": 4, "threads": 2}, fault_injector=injector)
    t, done = _submit_in_thread(s, 40)
    # The first commit reaches fdatasync and the submitter fills staging on their own threads (a loaded
    # machine: seconds); wait for both, then the state must hold.
    wait_for(lambda: syncs, "a group commit reaching fdatasync")
    wait_for(lambda: s.stats()["inflight"]["staging_pages"] == 4, "the submitter holding all 4 staging slots")
    assert not done.wait(1.0), "submit_write ran on although the commit is stuck"
    # The first commit is stuck with its group; at most the bound's worth of pages was written on top
    # of that group, and what is staged waits.
    assert len(written) <= 4 + 4 + 2, f"{len(written)} pages written while the commit was stuck"
    assert s.stats()["inflight"]["staging_pages"] == 4
    gate.set()
    t.join(30)
    assert done.is_set()
    acks = drain_until(s, lambda a: sum(x.kind is AckKind.DURABLE for x in a) == 40)
    assert all(a.ok for a in acks if a.kind is AckKind.DURABLE)
    o = outs(40)
    assert s.read_pages("kv", keys(40), o) == [True] * 40
    assert all(bytes(o[i]) == page(i) for i in range(40))


def test_delete_then_rewrite(make_store):
    s = make_store()
    assert all(s.write_pages("kv", keys(5), [page(i) for i in range(5)]))
    assert s.delete("kv", keys(2) + [b"never"]) == 2
    assert s.read_pages("kv", keys(5), outs(5)) == [False, False, True, True, True]
    assert s.stats()["occupancy"]["kv"]["used"] == 3
    assert s.write_pages("kv", keys(2), [page(7), page(8)]) == [True, True]
    o = outs(2)
    assert s.read_pages("kv", keys(2), o) == [True, True] and bytes(o[1]) == page(8)


def test_clear_empties_this_rank(make_store):
    s = make_store()
    assert all(s.write_pages("kv", keys(5), [page(i) for i in range(5)]))
    s.clear()
    assert s.exists_prefix("kv", keys(5)) == 0 and s.stats()["occupancy"]["kv"]["used"] == 0
    assert all(s.write_pages("kv", keys(5), [page(i) for i in range(5)]))


def test_gc_lru_watermarks_and_touch(make_store):
    # 40 slots: GC starts above 36 (0.90) and reclaims down to 34 (0.85).
    cap = 40 * write_extent(P) / 1e9
    s = make_store(capacity_gb=cap, gc={"max_reclaim_per_iter": 64})
    assert s.stats()["occupancy"]["kv"]["total"] == 40
    hot = keys(4, b"hot")
    assert all(s.write_pages("kv", hot, [page(i) for i in range(4)]))
    for i in range(0, 200, 8):
        s.touch("kv", hot)  # hot pages stay warm while cold ones stream through
        assert all(s.write_pages("kv", keys(8, b"c%d-" % i), [page(i + j) for j in range(8)]))
        assert s.stats()["occupancy"]["kv"]["used"] <= 40
    st = s.stats()
    assert st["counters"]["gc_reclaimed"] >= 200 + 4 - 40
    assert st["occupancy"]["kv"]["used"] <= 37
    o = outs(4)
    assert s.read_pages("kv", hot, o) == [True] * 4, "touched pages must survive GC"
    assert s.exists_prefix("kv", keys(8, b"c0-")) == 0, "the coldest pages go first"
    # Every slot that GC handed back is consistent: used == durable pages, none leaked.
    assert st["occupancy"]["kv"]["used"] == st["occupancy"]["kv"]["durable"]


def test_gc_bounded_work_per_iteration(make_store):
    cap = 100 * write_extent(P) / 1e9
    s = make_store(capacity_gb=cap, gc={"max_reclaim_per_iter": 3})
    batches = []
    real = s.state.index.commit

    def commit(puts=(), deletes=(), touches=()):
        deletes = list(deletes)
        if deletes:
            batches.append(len(deletes))
        return real(puts=puts, deletes=deletes, touches=touches)
    s.state.index.commit = commit
    for lo in range(0, 95, 5):
        assert all(s.write_pages("kv", keys(5, b"g%d-" % lo), [page(lo + i) for i in range(5)]))
    for _ in range(10):  # a few more write-thread iterations let GC finish its hysteresis
        s.write_pages("kv", [b"tick"], [page(1)])
        s.delete("kv", [b"tick"])
    st = s.stats()
    assert st["counters"]["gc_reclaimed"] >= 95 - 85
    assert st["occupancy"]["kv"]["used"] <= 85, "GC reclaims down to the low watermark"
    gc_batches = batches[: len(batches) - 10]  # the 10 explicit deletes are 1-page batches
    assert gc_batches and max(gc_batches) <= 3, f"a GC iteration reclaimed more than its budget: {gc_batches}"


def test_watermark_policy_hysteresis():
    from sglang_cp.l3.gc import WatermarkPolicy
    w = WatermarkPolicy(0.90, 0.85, 4)
    assert w.to_reclaim(90, 100) == 0            # at the high mark: not above it
    assert w.to_reclaim(91, 100) == 4            # above: start, bounded by the budget
    assert w.to_reclaim(87, 100) == 2            # still active below high, down to low
    assert w.to_reclaim(85, 100) == 0 and not w.active
    assert w.to_reclaim(88, 100) == 0            # between the marks and not active: nothing


def test_bad_input_is_a_clear_error(make_store):
    s = make_store()
    with pytest.raises(ValueError, match=r"pages\[0\]: 10 B but payload 'kv' pages are 16384 B"):
        s.submit_write("kv", [b"a"], [b"x" * 10])
    with pytest.raises(ValueError, match="1 keys but 2 pages"):
        s.submit_write("kv", [b"a"], [page(0), page(1)])
    with pytest.raises(KeyError, match="payload: 'nope' was not opened"):
        s.write_pages("nope", [b"a"], [page(0)])
    with pytest.raises(TypeError, match=r"pages\[0\]: needs the buffer protocol"):
        s.submit_write("kv", [b"a"], [object()])
    with pytest.raises(ValueError, match=r"outs\[0\]: must be writable"):
        s.submit_read("kv", [b"a"], [page(0)])
    with pytest.raises(TypeError, match="keys: must be a list of bytes"):
        s.submit_write("kv", ["a"], [page(0)])


def test_startup_errors_name_the_fix(l3_root):
    from l3_helpers import config_doc
    cfg = parse_l3_config(config_doc(l3_root, capacity_gb=1e-5))
    with pytest.raises(L3StartupError, match=r"disks\[0\].capacity_gb: .* raise it to at least"):
        L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P})
    cfg = parse_l3_config(config_doc(l3_root, slot_bytes={"kv": 4096}))
    with pytest.raises(L3StartupError, match=r"slot_bytes.kv: 4096 B cannot hold a 16384 B page"):
        L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P})
    cfg = parse_l3_config(config_doc(l3_root))
    with pytest.raises(ValueError, match=r"rank: must be in \[0, ranks_per_node=2\)"):
        L3Store(cfg, rank=2, ranks_per_node=2, payloads={"kv": P})
    with pytest.raises(ValueError, match="cold_start: 'warm' is not one of clear, load, verify"):
        L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}, cold_start="warm")
    with pytest.raises(ValueError, match=r"payloads: name 'a/b' must match"):
        L3Store(cfg, rank=0, ranks_per_node=1, payloads={"a/b": P})


def test_capacity_split_across_ranks_and_payloads(make_store):
    ex_kv, ex_ix = write_extent(P), write_extent(4096)
    cap = 3 * 10 * (ex_kv + ex_ix) / 1e9  # three ranks share d0 -> 10 slots each, per payload
    s = make_store(payloads={"kv": P, "ix": 4096}, rank=1, ranks_per_node=5, capacity_gb=cap, two_disks=True)
    # ranks 0, 2, 4 map to d0 and 1, 3 to d1 by default: rank 1 shares d1 with one other rank.
    occ = s.stats()["occupancy"]
    assert occ["kv"]["total"] == occ["ix"]["total"] == int(cap * 1e9 // 2) // (ex_kv + ex_ix)
    assert os.path.dirname(s.state.pools["kv"].slab.path).startswith(os.path.join(make_store.root, "d1"))
    t = make_store(payloads={"kv": P, "ix": 4096}, rank=2, ranks_per_node=5, capacity_gb=cap, two_disks=True)
    assert t.stats()["occupancy"]["kv"]["total"] == 10
    assert os.path.getsize(t.state.pools["ix"].slab.path) == 10 * ex_ix


def test_rank_to_disk_mapping(make_store):
    s = make_store(two_disks=True, rank_to_disk={"0": "d1"})
    assert "/d1/" in s.state.pools["kv"].slab.path


def test_read_timeout_never_writes_into_outs_afterwards(make_store):
    gate = threading.Event()
    s = make_store()
    assert all(s.write_pages("kv", keys(3), [page(i) for i in range(3)]))
    s.state.pools["kv"].slab.fault_injector = lambda op, slab, slot: gate.wait(30) if op == "read" else None
    o = outs(3)
    res = s.read_pages("kv", keys(3), o, timeout=0.05)
    # Reads land in store memory; only pages verified and copied before the return reach `o`.
    snapshot = [bytes(x) for x in o]
    gate.set()  # the device answers only after the caller gave up
    settle(s, "reads")  # every late read finished (verified, and delivered or dropped)
    assert [bytes(x) for x in o] == snapshot
    assert all(r is False or bytes(o[i]) == page(i) for i, r in enumerate(res))


def test_close_is_idempotent_and_stops_threads(make_store):
    s = make_store()
    assert all(s.write_pages("kv", keys(2), [page(0), page(1)]))
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.write_pages("kv", keys(1), [page(0)])
    assert not s._writer.is_alive()


def aligned_pages(n, size):
    import mmap
    mm = mmap.mmap(-1, n * ((size + 4095) // 4096 * 4096))
    stride = (size + 4095) // 4096 * 4096
    arr = np.frombuffer(mm, np.uint8)
    return [arr[i * stride: i * stride + size] for i in range(n)]


@pytest.mark.parametrize("size", [P, 5000, 3 * 4096 + 100])
def test_write_pages_zero_copy_from_aligned_memory(make_store, size):
    s = make_store(payloads={"kv": size})
    src = aligned_pages(12, size)
    for i, a in enumerate(src):
        a[:] = np.frombuffer(page(i, size), np.uint8)
    assert s.write_pages("kv", keys(12), src) == [True] * 12
    assert s.stats()["counters"]["zero_copy_pages"] == 12 and s.stats()["inflight"]["staging_pages"] == 0
    dst = aligned_pages(12, size)
    assert s.read_pages("kv", keys(12), dst) == [True] * 12
    assert all(bytes(d) == page(i, size) for i, d in enumerate(dst))
    # Unaligned destinations (bounce path) read the same verified bytes.
    o = [np.zeros(size + 1, np.uint8)[1:] for _ in range(12)]
    assert s.read_pages("kv", keys(12), o) == [True] * 12
    assert all(bytes(d) == page(i, size) for i, d in enumerate(o))


def test_write_pages_timeout_never_reads_caller_memory_afterwards(make_store):
    gate = threading.Event()
    s = make_store(io={"threads": 1, "max_inflight_pages": 64},
                   fault_injector=lambda op, slab, slot: gate.wait(30) if op == "write" else None)
    src = aligned_pages(8, P)
    for i, a in enumerate(src):
        a[:] = np.frombuffer(page(i), np.uint8)
    res = s.write_pages("kv", keys(8), src, timeout=0.05)
    for a in src:  # the caller owns its memory again the moment write_pages returns
        a[:] = 0xEE
    gate.set()  # the device takes the writes only after the caller reused its memory
    s.write_pages("kv", [b"barrier"], [page(99)])
    o = [np.zeros(P, np.uint8) for _ in range(8)]
    got = s.read_pages("kv", keys(8), o)
    assert not all(res)
    assert all(not g or bytes(o[i]) == page(i) for i, g in enumerate(got)), "a page picked up bytes written after return"


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that starts at `addr`, from /proc/self/smaps."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{addr:x}" or line.split("-", 1)[0] == f"{addr:012x}":
            for entry in lines[i + 1:]:
                if entry.startswith("AnonHugePages:"):
                    return int(entry.split()[1])
                if "-" in entry.split()[0]:
                    break
    raise AssertionError(f"mapping at {addr:#x} not found in smaps")


def test_staging_arena_is_populated_and_on_huge_pages_where_thp_allows():
    from sglang_cp.l3.format.aligned import address_of, aligned_buffer
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    buf = aligned_buffer(64 << 20, populate=True, huge=True)
    addr = address_of(buf)
    assert addr % 4096 == 0
    np.frombuffer(buf, np.uint8)[:] = 7  # writable end to end
    if "[never]" in mode:
        pytest.skip("THP is off on this kernel: the arena is ordinary pages")
    # defrag defaults to madvise, so the advised arena compacts on fault: most of it is huge pages.
    assert _anon_huge_kib(addr) >= 32 << 10, f"THP mode {mode.strip()!r} but no huge pages in the arena"
    plain = aligned_buffer(64 << 20, populate=True)
    assert _anon_huge_kib(address_of(plain)) == 0 or "[always]" in mode


def test_starting_a_read_keeps_the_gil(make_store):
    """Starting a 512-page read (slot lookups, runs handed to the I/O threads) does not release the GIL.
    A prefetch starts its reads on upstream's prefetch thread beside the scheduler's busy Python thread,
    where each release waits up to CPython's 5 ms switch interval: looking the slots up in LMDB (py-lmdb
    releases the GIL for every get) took 116 ms for 512 keys there, 0.1 ms alone."""
    from suite_helpers import gil_releases_seen

    s = make_store(io={"max_inflight_pages": 512})  # the whole read in the window: the submit never waits
    ks = [b"g%d" % i for i in range(512)]
    assert all(s.write_pages("kv", ks, [page(i % 8) for i in range(512)]))
    outs = [np.zeros(16384, np.uint8) for _ in ks]
    pending, ran = gil_releases_seen(s.start_read_pages, "kv", ks, outs, 60)
    assert ran == 0, f"starting the read released the GIL: another thread ran {ran} loop turns meanwhile"
    assert s.finish_read_pages(pending) == [True] * 512
    assert all(bytes(o) == page(i % 8) for i, o in enumerate(outs))


def test_a_backup_of_durable_pages_keeps_the_gil(make_store):
    """A backup of pages already durable (upstream backs a prefix up again) is answered without releasing
    the GIL: the check runs on upstream's backup thread beside the scheduler's busy Python thread, where
    an LMDB lookup per key (py-lmdb releases the GIL for every get) cost ~0.2 ms each."""
    from suite_helpers import gil_releases_seen

    s = make_store()
    ks = [b"d%d" % i for i in range(512)]
    pages = [page(i % 8) for i in range(512)]
    assert all(s.write_pages("kv", ks, pages))
    op, ran = gil_releases_seen(s.submit_write, "kv", ks, pages)
    assert ran == 0, f"the backup released the GIL: another thread ran {ran} loop turns meanwhile"
    assert s.stats()["counters"]["write_already_durable"] == 512
    done = [a for a in s.drain_acks() if a.op == op and a.kind == AckKind.DURABLE]
    assert len(done) == 512 and all(a.ok for a in done)
