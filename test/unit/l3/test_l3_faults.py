"""I/O faults injected at our disk layer (the DiskSlab seam; LMDB is real): every fault is a miss or
DURABLE ok=False plus a counter, never an exception into the caller, never wrong bytes."""

import errno
import threading

import numpy as np
import pytest

from l3_helpers import page
from sglang_cp.l3 import AckKind

P = 16384


def keys(n, prefix=b"f"):
    return [prefix + b"%d" % i for i in range(n)]


class Faults:
    """Raise OSError(code) for chosen ops/slots, exactly as the kernel would from pwrite/preadv/fdatasync."""

    def __init__(self):
        self.rules = []  # (op, predicate(slot), errno)
        self.lock = threading.Lock()

    def add(self, op, code, pred=lambda slot: True):
        with self.lock:
            self.rules.append((op, pred, code))

    def clear(self):
        with self.lock:
            self.rules.clear()

    def __call__(self, op, slab, slot):
        with self.lock:
            rules = list(self.rules)
        for o, pred, code in rules:
            if o == op and pred(slot):
                raise OSError(code, f"injected {errno.errorcode[code]}")


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.ENODEV])
def test_write_faults_fail_soft_and_free_slots(make_store, code):
    f = Faults()
    s = make_store(fault_injector=f)
    f.add("write", code, lambda slot: slot % 2 == 0)
    ok = s.write_pages("kv", keys(20), [page(i) for i in range(20)])
    assert 0 < sum(ok) < 20
    st = s.stats()
    assert st["counters"]["write_errors"] >= 1
    assert st["occupancy"]["kv"]["used"] == sum(ok), "failed writes must give their slots back"
    # Failed pages are not in the index; good ones read back exactly.
    o = [np.zeros(P, np.uint8) for _ in range(20)]
    assert s.read_pages("kv", keys(20), o) == ok
    assert all(bytes(o[i]) == page(i) for i in range(20) if ok[i])
    f.clear()
    assert all(s.write_pages("kv", keys(20), [page(i) for i in range(20)])), "recovers once the disk does"


def test_fdatasync_failure_means_not_durable(make_store):
    f = Faults()
    s = make_store(fault_injector=f)
    f.add("sync", errno.EIO)
    assert s.write_pages("kv", keys(5), [page(i) for i in range(5)]) == [False] * 5
    assert s.exists_prefix("kv", keys(5)) == 0 and s.stats()["occupancy"]["kv"]["used"] == 0
    f.clear()
    assert all(s.write_pages("kv", keys(5), [page(i) for i in range(5)]))


@pytest.mark.parametrize("code", [errno.EIO, errno.ENODEV])
def test_read_faults_are_misses(make_store, code):
    f = Faults()
    s = make_store(fault_injector=f)
    assert all(s.write_pages("kv", keys(10), [page(i) for i in range(10)]))
    f.add("read", code)
    o = [np.zeros(P, np.uint8) for _ in range(10)]
    assert s.read_pages("kv", keys(10), o) == [False] * 10
    assert s.stats()["counters"]["read_errors"] == 10
    # A transient read error does not condemn the page: it stays indexed and reads fine later.
    f.clear()
    assert s.read_pages("kv", keys(10), o) == [True] * 10


def test_async_faults_arrive_as_acks(make_store):
    f = Faults()
    s = make_store(fault_injector=f)
    f.add("write", errno.EIO)
    op = s.submit_write("kv", keys(3), [page(i) for i in range(3)])
    acks = []
    while sum(a.kind is AckKind.DURABLE for a in acks) < 3:
        acks += s.drain_acks()
    assert [a.ok for a in acks if a.kind is AckKind.DURABLE] == [False] * 3 and {a.op for a in acks} == {op}


def test_mapfull_at_max_fails_soft(make_store):
    # A 64 KiB map that may not grow: LMDB fills up quickly; writes fail soft, reads still work.
    s = make_store(index={"map_size_gb": 64e3 / 1e9, "max_map_size_gb": 64e3 / 1e9})
    results = []
    for b in range(40):
        results += s.write_pages("kv", keys(32, b"m%d-" % b), [page(i) for i in range(32)])
        if s.stats()["counters"]["mapfull"]:
            break
    st = s.stats()
    assert st["counters"]["mapfull"] >= 1 and not all(results)
    assert st["occupancy"]["kv"]["used"] == sum(results)
    good = [k for b in range(40) for k in keys(32, b"m%d-" % b)][: len(results)]
    good = [k for k, r in zip(good, results) if r]
    o = [np.zeros(P, np.uint8) for _ in good]
    assert all(s.read_pages("kv", good, o))


def test_mapfull_grows_within_max(make_store):
    s = make_store(index={"map_size_gb": 64e3 / 1e9, "max_map_size_gb": 0.01})
    assert all(s.write_pages("kv", keys(600), [page(i % 7) for i in range(600)]))
    st = s.stats()
    assert st["counters"]["map_grows"] >= 1 and st["counters"]["mapfull"] == 0


def test_invariant_violation_is_loud(make_store):
    s = make_store()
    assert all(s.write_pages("kv", keys(2), [page(0), page(1)]))
    pool = s.state.pools["kv"]
    from sglang_cp.l3.errors import L3InvariantError
    with pytest.raises(L3InvariantError, match="overruns"):
        pool.slab.write_slot(pool.slab.num_slots, [memoryview(bytearray(pool.extent))])
    used = next(iter(pool.owner))
    with pytest.raises(L3InvariantError, match="double free"):
        pool.slots.free_slot(used) or pool.slots.free_slot(used)


@pytest.mark.parametrize("where", ["read", "write"])
def test_internal_bug_is_loud_and_never_hangs_callers(make_store, where):
    from sglang_cp.l3.errors import L3InvariantError
    armed = threading.Event()

    def bug(op, slab, slot):
        if op == where and armed.is_set():
            raise RuntimeError("a bug in the store, not an I/O fault")
    s = make_store(fault_injector=bug)
    assert all(s.write_pages("kv", keys(4), [page(i) for i in range(4)]))
    armed.set()
    # The sync call returns (no hang) by raising; so does every later call.
    with pytest.raises(L3InvariantError, match="a bug in the store"):
        if where == "read":
            s.read_pages("kv", keys(4), [np.zeros(P, np.uint8) for _ in range(4)])
        else:
            s.write_pages("kv", keys(4, b"n"), [page(i) for i in range(4)])
    with pytest.raises(L3InvariantError, match="a bug in the store"):
        s.exists_prefix("kv", keys(4))
