"""A device that never answers must not wedge a caller: read_pages / write_pages with a timeout and
close() return within their bound, a late completion never touches the caller's memory, and a submit
racing close() gets its acks.

The stall is the store's own fault seam (DiskSlab.fault_injector, called before every preadv / pwritev
/ fdatasync) waiting on an Event that nothing sets during the call; the fixture releases it at
teardown. Each call runs on a helper thread joined with BOUND x SLACK: a call that waits for the
device blocks there and fails the test instead of hanging it. SLACK is a correctness margin, not a
performance threshold.
"""

import threading
import time

import numpy as np
import pytest

from l3_helpers import WAIT_S, aligned_pages, device_before_bound, page, settle, wait_for, within
from sglang_cp.l3 import AckKind

P = 16384
BOUND = 1.0
SLACK = 5.0


def keys(n, prefix=b"b"):
    return [prefix + b"%d" % i for i in range(n)]


class Stall:
    """Fault seam: ops in `ops` block on `gate` once armed (a hung device)."""

    def __init__(self, *ops):
        self.ops = set(ops)
        self.armed = False
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, op, slab, slot):
        if self.armed and op in self.ops:
            self.entered.set()
            self.gate.wait()


@pytest.fixture(autouse=True)
def close_bound(monkeypatch):
    """close() waits CLOSE_TIMEOUT_S for the device; shorten it to BOUND for these tests."""
    import sglang_cp.l3.store as store_mod
    monkeypatch.setattr(store_mod, "CLOSE_TIMEOUT_S", BOUND, raising=False)


@pytest.fixture
def stalls():
    made = []

    def make(*ops):
        s = Stall(*ops)
        made.append(s)
        return s
    yield make
    for s in made:  # teardown: let the stuck I/O threads go
        s.gate.set()


def fill(bufs, value):
    for b in bufs:
        b[:] = value


def test_read_pages_returns_within_bound_when_reads_never_complete(make_store, stalls, monkeypatch):
    stall = stalls("read")
    s = make_store(fault_injector=stall)
    assert all(s.write_pages("kv", keys(8), [page(i) for i in range(8)]))
    stall.armed = True
    device_before_bound(monkeypatch, s, stall.entered.is_set, "a read reaching the hung device")
    o = aligned_pages(8, P)  # aligned: the old code read straight into these
    fill(o, 0xAB)
    done, res = within(lambda: s.read_pages("kv", keys(8), o, timeout=BOUND), BOUND * SLACK)
    assert done, f"read_pages(timeout={BOUND}) still waiting for the device after {BOUND * SLACK} s"
    assert res == [False] * 8
    assert stall.entered.is_set()
    assert s.stats()["counters"]["read_timeouts"] == 8
    # The device answers late: nothing may land in the caller's pages any more.
    stall.gate.set()
    settle(s, "reads")
    assert all((np.asarray(x) == 0xAB).all() for x in o), "a late read completion wrote into the caller's pages"
    # The store still serves exact bytes afterwards.
    stall.armed = False
    assert s.read_pages("kv", keys(8), o, timeout=30) == [True] * 8
    assert all(bytes(x) == page(i) for i, x in enumerate(o))


def test_read_pages_bounded_when_stuck_reads_hold_every_permit(make_store, stalls):
    stall = stalls("read")
    s = make_store(fault_injector=stall, io={"threads": 2, "max_inflight_pages": 4})
    assert all(s.write_pages("kv", keys(12), [page(i) for i in range(12)]))
    stall.armed = True
    o = [np.zeros(P, np.uint8) for _ in range(12)]
    for _ in range(2):  # the second call finds every read permit held by the first call's stuck reads
        done, res = within(lambda: s.read_pages("kv", keys(12), o, timeout=BOUND), BOUND * SLACK)
        assert done, "read_pages waited for a read permit held by I/O stuck on the device"
        assert res == [False] * 12
    assert all(not x.any() for x in o)


def test_write_pages_returns_within_bound_and_never_reads_caller_memory_after(make_store, stalls):
    stall = stalls("write")
    s = make_store(fault_injector=stall)
    stall.armed = True
    src = aligned_pages(8, P)  # aligned: the old code wrote straight from these (zero-copy)
    for i, a in enumerate(src):
        a[:] = np.frombuffer(page(i), np.uint8)
    done, res = within(lambda: s.write_pages("kv", keys(8), src, timeout=BOUND), BOUND * SLACK)
    assert done, f"write_pages(timeout={BOUND}) still waiting for the device after {BOUND * SLACK} s"
    assert res == [False] * 8, "a page not durable in time must be reported not written"
    assert s.stats()["counters"]["write_timeouts"] == 8
    fill(src, 0xEE)  # the caller owns its memory again the moment write_pages returned
    stall.armed = False
    stall.gate.set()
    settle(s, "writes")
    o = [np.zeros(P, np.uint8) for _ in range(8)]
    got = s.read_pages("kv", keys(8), o, timeout=30)
    for i, ok in enumerate(got):
        assert not ok or bytes(o[i]) == page(i), f"page {i} picked up bytes the caller wrote after the return"


def test_write_pages_bounded_when_stuck_writes_hold_all_staging(make_store, stalls):
    stall = stalls("write")
    s = make_store(fault_injector=stall, io={"threads": 2, "max_inflight_pages": 4})
    stall.armed = True
    done, res = within(lambda: s.write_pages("kv", keys(16), [page(i) for i in range(16)], timeout=BOUND),
                       BOUND * SLACK)
    assert done, "write_pages blocked on staging tokens held by writes stuck on the device"
    assert res == [False] * 16


def test_write_pages_bounded_when_fdatasync_never_returns(make_store, stalls):
    stall = stalls("sync")
    s = make_store(fault_injector=stall)
    stall.armed = True
    done, res = within(lambda: s.write_pages("kv", keys(4), [page(i) for i in range(4)], timeout=BOUND),
                       BOUND * SLACK)
    assert done and res == [False] * 4
    assert s.exists_prefix("kv", keys(4)) == 0  # not indexed: nothing was durable


def test_close_is_bounded_and_fails_pending_writes(make_store, stalls):
    stall = stalls("write")
    s = make_store(fault_injector=stall)
    stall.armed = True
    op = s.submit_write("kv", keys(6), [page(i) for i in range(6)])
    sync = {}
    waiter = threading.Thread(target=lambda: sync.setdefault(
        "r", s.write_pages("kv", keys(3, b"w"), [page(i) for i in range(3)], timeout=600)), daemon=True)
    waiter.start()
    assert stall.entered.wait(WAIT_S)
    done, err = within(lambda: s.close(), BOUND * SLACK)
    assert done, f"close() (bound {BOUND} s) still joining a writer stuck on the device after {BOUND * SLACK} s"
    assert err is None
    waiter.join(BOUND * SLACK)
    assert not waiter.is_alive(), "a write_pages caller was left waiting on a closed store"
    assert sync["r"] == [False] * 3
    durable = [a for a in s.drain_acks() if a.op == op and a.kind == AckKind.DURABLE]
    assert sorted(a.index_in_op for a in durable) == list(range(6)) and not any(a.ok for a in durable)


def test_close_is_bounded_with_reads_stuck(make_store, stalls):
    stall = stalls("read")
    s = make_store(fault_injector=stall)
    assert all(s.write_pages("kv", keys(4), [page(i) for i in range(4)]))
    stall.armed = True
    o = aligned_pages(4, P)
    fill(o, 0xAB)
    op = s.submit_read("kv", keys(4), o)
    assert stall.entered.wait(WAIT_S)
    done, _ = within(lambda: s.close(), BOUND * SLACK)
    assert done, "close() waited for reads stuck on the device"
    reads = [a for a in s.drain_acks() if a.op == op and a.kind == AckKind.READ]
    assert len(reads) == 4 and not any(a.ok for a in reads)
    stall.gate.set()
    settle(s, "reads")  # the released I/O finished: had it landed in the caller's pages, it has by now
    assert all((np.asarray(x) == 0xAB).all() for x in o), "a read completed after close() touched the caller's pages"


def test_submit_blocked_on_backpressure_fails_at_close(make_store, stalls):
    stall = stalls("write")
    s = make_store(fault_injector=stall, io={"threads": 2, "max_inflight_pages": 4})
    stall.armed = True
    box = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "op", s.submit_write("kv", keys(16), [page(i) for i in range(16)])), daemon=True)
    t.start()
    assert stall.entered.wait(WAIT_S)
    # Staging full: the submitter's next page waits for a slot (the close() below must free it).
    wait_for(lambda: s.stats()["inflight"]["staging_pages"] == 4, "the submitter holding all 4 staging slots")
    done, _ = within(lambda: s.close(), BOUND * SLACK)
    assert done, "close() hung"
    t.join(BOUND * SLACK)
    assert not t.is_alive(), "submit_write stayed blocked on backpressure after close()"
    durable = [a for a in s.drain_acks() if a.op == box["op"] and a.kind == AckKind.DURABLE]
    assert len(durable) == 16 and not any(a.ok for a in durable)


@pytest.mark.parametrize("call,where", [("submit_write", "lookup"), ("submit_write", "staged"),
                                        ("write_pages", "lookup")])
def test_submit_racing_close_is_settled(make_store, call, where):
    """The race: a submitter passes the closed check, close() stops the write thread, then the
    submitter stages / hands over its pages. Forced deterministically: close() runs inside the
    submitter's lookup of durable pages (before staging) or inside its first GATHERED ack (pages staged, not yet
    handed over)."""
    s = make_store()
    raced = []
    if where == "lookup":  # the "already durable" lookup (the pool's LRU)
        real = s.state.durable_entries

        def lookup_then_close(pool, ikeys):
            out = real(pool, ikeys)
            if not raced:
                raced.append(1)
                s.close()
            return out
        s.state.durable_entries = lookup_then_close
    else:
        real_emit = s.state.emit

        def emit_then_close(op, i, kind, ok):
            real_emit(op, i, kind, ok)
            if kind == AckKind.GATHERED and not raced:
                raced.append(1)
                s.close()
        s.state.emit = emit_then_close
    if call == "submit_write":
        def run():
            op = s.submit_write("kv", keys(3), [page(i) for i in range(3)])
            while True:  # the caller's ack loop; it ends only if the DURABLE acks arrive
                acks = [a for a in s.drain_acks() if a.op == op and a.kind == AckKind.DURABLE]
                if len(acks) == 3:
                    return [a.ok for a in sorted(acks, key=lambda a: a.index_in_op)]
                time.sleep(0.01)
    else:
        src = aligned_pages(3, P)  # zero-copy: no staging slot to wait for, straight to the hand-over
        for i, a in enumerate(src):
            a[:] = np.frombuffer(page(i), np.uint8)

        def run():
            return s.write_pages("kv", keys(3), src)  # no timeout: waits for its pages to settle
    done, res = within(run, 30 * SLACK / 5)
    assert raced
    assert done, f"{call} racing close() waits forever for a write thread that is gone"
    assert res == [False] * 3


def test_runs_dispatched_after_close_gave_up_are_settled(make_store):
    """close() gives up on a write thread held inside an index txn (here a forced reclaim's delete, on a
    full pool) and shuts the write I/O pool. When the txn returns, the thread still dispatches the pages
    it had taken; those runs cannot be submitted any more and must be settled, not dropped: once the
    thread is gone every slot is durable or free, and staging is back."""
    from sglang_cp.l3.format.blob import write_extent
    s = make_store(capacity_gb=8.5 * write_extent(P) / 1e9, gc={"high_watermark": 1.0, "low_watermark": 0.5})
    assert all(s.write_pages("kv", keys(8), [page(i) for i in range(8)]))
    assert s.stats()["occupancy"]["kv"] == {"used": 8, "total": 8, "durable": 8}
    held, gate = threading.Event(), threading.Event()
    real = s.state.index.commit

    def commit(puts=(), deletes=(), touches=()):
        deletes = list(deletes)
        if deletes and not held.is_set():  # the device holds up the reclaim's index txn
            held.set()
            gate.wait(WAIT_S)
        return real(puts=puts, deletes=deletes, touches=touches)
    s.state.index.commit = commit
    try:
        s.submit_write("kv", keys(4, b"n"), [page(100 + i) for i in range(4)])
        assert held.wait(WAIT_S), "no forced reclaim reached the index"
        done, _ = within(lambda: s.close(timeout=BOUND), BOUND * SLACK)
        assert done, "close() did not return within its bound"
    finally:
        gate.set()
    wait_for(lambda: not s._writer.is_alive(), "the write thread exiting once its txn returned")
    st = s.stats()
    assert st["occupancy"]["kv"]["used"] == st["occupancy"]["kv"]["durable"] == 4, st["occupancy"]
    assert st["inflight"]["staging_pages"] == 0, st["inflight"]


# ------------------------------------------------------------------ process exit on a dead disk

# The child stalls one read (or write) at the seam for STUCK_S, the stuck request's own bound, then
# closes with CHILD_CLOSE_S and returns from main. It must exit long before the stuck request would have
# returned: EXIT_BOUND_S is a generous process-exit bound, the property under test.
STUCK_S = 60.0
CHILD_CLOSE_S = 2.0
EXIT_BOUND_S = 20.0

_EXIT_CHILD = r"""
import json, sys, threading, time
from sglang_cp.l3 import L3Store, parse_l3_config

doc, op_kind, stuck_s, close_s = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
armed, entered, never = [False], threading.Event(), threading.Event()

def stall(op, slab, slot):
    if armed[0] and op == op_kind:
        entered.set()
        never.wait(stuck_s)  # a request stuck in the kernel until the device's own timeout

s = L3Store(parse_l3_config(doc), rank=0, ranks_per_node=1, payloads={"kv": 16384}, cold_start="clear",
            fault_injector=stall)
assert all(s.write_pages("kv", [b"k0"], [bytes(16384)]))
armed[0] = True
if op_kind == "read":
    s.submit_read("kv", [b"k0"], [bytearray(16384)])
else:
    s.submit_write("kv", [b"k1"], [bytes(16384)])
assert entered.wait(30), "the stalled request never reached the device"
t0 = time.monotonic()
s.close(timeout=close_s)
print("close_s=%.2f" % (time.monotonic() - t0), flush=True)
"""


@pytest.mark.parametrize("op", ["read", "write"])
def test_process_exits_within_bound_with_a_request_stuck_in_the_device(l3_root, op):
    """close(timeout) on a dead disk, then a normal interpreter exit: the stuck I/O thread must not be
    joined at exit (it would hold the process for the request's own STUCK_S)."""
    import json
    import subprocess
    import sys

    from l3_helpers import config_doc
    doc = config_doc(l3_root)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _EXIT_CHILD, json.dumps(doc), op, str(STUCK_S),
                             str(CHILD_CLOSE_S)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=STUCK_S * 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    wall = time.monotonic() - t0
    print(f"stuck {op}: {out.strip()}, process exited {proc.returncode} after {wall:.1f} s "
          f"(stuck request's bound {STUCK_S:g} s)")
    assert proc.returncode == 0, err[-3000:]
    assert "close_s=" in out, err[-3000:]
    assert wall < EXIT_BOUND_S, (f"the process took {wall:.1f} s to exit after close(timeout={CHILD_CLOSE_S:g}): "
                                 f"interpreter exit waited for the I/O thread stuck in the device")


def test_a_reader_waiting_for_read_permits_holds_none_of_them(make_store):
    """A run's read permits are taken all at once: a reader that finds too few free holds none while it
    waits. Readers that took theirs one by one could split the permits between them (three readers of
    32-page runs under 64 permits held 31, 31 and 2) and wait for each other for ever, nothing in flight."""
    s = make_store(io={"max_inflight_pages": 64})
    permits = s.reads._slots
    assert permits.acquire_many(40)  # runs of other readers, in flight
    got = []
    waiter = threading.Thread(target=lambda: got.append(s.reads._acquire_permits(32, time.monotonic() + 1.0)))
    waiter.start()
    time.sleep(0.3)
    assert permits.free == 24, "a waiting reader holds permits nobody can use"
    waiter.join(5)
    assert got == [False] and permits.free == 24  # past its bound, with nothing taken
    for _ in range(40):
        permits.release()
    assert s.reads._acquire_permits(32, time.monotonic() + 1.0) and permits.free == 32


def test_readers_on_several_threads_all_finish(make_store):
    """Three threads each reading 256 pages again and again (python engine, runs of up to 32 pages under
    64 permits, a short switch interval so they interleave finely): every read is whole, none waits out
    its bound."""
    import sys

    s = make_store(io={"max_inflight_pages": 64}, capacity_gb=0.05)
    n = 256
    keys = [[b"t%d-k%d" % (t, i) for i in range(n)] for t in range(3)]
    for t in range(3):
        assert all(s.write_pages("kv", keys[t], [page(t * 1000 + i) for i in range(n)], timeout=60))
    results = []

    def reader(t):
        outs = [np.zeros(16384, np.uint8) for _ in range(n)]
        for _ in range(5):
            results.append(sum(s.read_pages("kv", keys[t], outs, timeout=30)))
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.00005)
    try:
        threads = [threading.Thread(target=reader, args=(t,)) for t in range(3)]
        for x in threads:
            x.start()
        for x in threads:
            x.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not any(x.is_alive() for x in threads) and results == [n] * 15, results
