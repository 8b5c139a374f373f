"""io.zero_copy_writes: write_pages under a timeout (upstream's backup path) writes 4 KiB-aligned pages
straight from the caller's memory. The caller may reuse that memory as soon as write_pages returned,
so a write still running at the deadline is abandoned: it finishes into its slot, which stays reserved
until the I/O returns, and it is never indexed. Unaligned pages take the copy path; with the flag off
nothing changes.

Stalls use the store's own seams (DiskSlab.fault_injector before every pwritev; a wrapper around the
pool's seal, where the I/O thread reads the caller's page for the CRC) waiting on an Event; each call
runs on a helper thread joined with BOUND x SLACK (a correctness margin, not a performance threshold).
"""

import threading

import numpy as np
import pytest

from l3_helpers import WAIT_S, aligned_pages, config_doc, device_before_bound, page, settle, slot_of
from l3_helpers import within as _within
from sglang_cp.l3.config import L3ConfigError, parse_l3_config

P = 16384
BOUND = 1.0
SLACK = 5.0
ZC = {"zero_copy_writes": True}


@pytest.fixture(autouse=True)
def close_bound(monkeypatch):
    import sglang_cp.l3.store as store_mod
    monkeypatch.setattr(store_mod, "CLOSE_TIMEOUT_S", BOUND, raising=False)


class StallWrites:
    """Fault seam: once armed, pwritevs block on `gate` (all of them, or only the first: `once`)."""

    def __init__(self, once=False):
        self.once = once
        self.armed = False
        self.gate = threading.Event()
        self.slots = []

    def __call__(self, op, slab, slot):
        if op == "write" and self.armed:
            self.slots.append(slot)
            if not self.once or len(self.slots) == 1:
                self.gate.wait()


@pytest.fixture
def stalls():
    made = []

    def make(**kw):
        s = StallWrites(**kw)
        made.append(s)
        return s
    yield make
    for s in made:  # teardown: let the stuck I/O threads go (before the stores close)
        s.gate.set()


def within(fn, bound=BOUND * SLACK):
    return _within(fn, bound)


def filled(n, first=0, size=P):
    bufs = aligned_pages(n, size)
    for i, b in enumerate(bufs):
        b[:] = np.frombuffer(page(first + i, size), np.uint8)
    return bufs


def test_source_changed_after_timeout_is_never_served(make_store, monkeypatch):
    """The I/O thread reaches the caller's page only after write_pages gave up (a descheduled thread, a
    slow disk queue); upstream has reused the host page for other bytes meanwhile. CRC and data then
    agree on the new bytes: indexing the page would serve them under the old key."""
    s = make_store(io=dict(ZC, threads=2, max_inflight_pages=8))
    pool = s.state.pools["kv"]
    gate, entered = threading.Event(), threading.Event()
    seal = pool.seal_zero_copy

    def late_seal(*a):
        entered.set()
        gate.wait()
        return seal(*a)
    monkeypatch.setattr(pool, "seal_zero_copy", late_seal)
    device_before_bound(monkeypatch, s, entered.is_set, "the I/O thread reaching the caller's page")
    src = filled(1)
    try:
        done, res = within(lambda: s.write_pages("kv", [b"k0"], src, timeout=BOUND))
        assert done, "write_pages(timeout) waited for a zero-copy write past its bound"
        assert res == [False] and entered.is_set()
        src[0][:] = np.frombuffer(page(99), np.uint8)  # the caller reuses its page
    finally:
        gate.set()
    settle(s, "writes")
    out = aligned_pages(1, P)
    assert s.read_pages("kv", [b"k0"], out, timeout=30) == [False], \
        "a page written from caller memory after its write_pages returned was served"
    assert s.exists_prefix("kv", [b"k0"]) == 0
    assert s.stats()["counters"]["zero_copy_pages"] == 1
    assert pool.slots.used == 0, "the abandoned page's slot was not freed after its I/O returned"
    # The key can be written again, with its real bytes.
    assert s.write_pages("kv", [b"k0"], filled(1), timeout=30) == [True]
    assert s.read_pages("kv", [b"k0"], out, timeout=30) == [True] and bytes(out[0]) == page(0)


def test_hung_zero_copy_write_is_bounded_and_keeps_its_slot(make_store, stalls, monkeypatch):
    stall = stalls(once=True)
    # Staging for the stuck page and all six others at once: none of them waits for a token, so each
    # reaches the device however slowly the pwrites go (a page still without a token at the caller's
    # bound is given up before any I/O, as on a loaded disk with 4 tokens).
    s = make_store(fault_injector=stall, io=dict(ZC, threads=2, max_inflight_pages=8))
    pool = s.state.pools["kv"]
    src = filled(1)
    stall.armed = True
    reached = {"n": 1}  # pwrites that must have reached the device before a caller's bound passes
    device_before_bound(monkeypatch, s, lambda: len(stall.slots) >= reached["n"],
                        "the call's pwrites reaching the device")
    done, res = within(lambda: s.write_pages("kv", [b"h0"], src, timeout=BOUND))
    assert done, "write_pages(timeout) waited for a hung zero-copy pwrite past its bound"
    assert res == [False] and stall.slots
    stuck = stall.slots[0]
    src[0][:] = 0x5A  # the caller reuses its page while the kernel may still read it
    # The store keeps writing other pages, never into the slot whose write is still in flight. (They
    # become durable only once the stuck write returns: a group commits when no write is in flight.)
    okeys = [b"o%d" % i for i in range(6)]
    others = filled(6, 10)
    reached["n"] = 7  # (this call's bound is held until its six pwrites reached the device: wait for it)
    done, res = within(lambda: s.write_pages("kv", okeys, others, timeout=BOUND), WAIT_S)
    assert done and res == [False] * 6
    assert len(stall.slots) == 7 and stuck not in stall.slots[1:]
    assert pool.slots.used == 7
    stall.gate.set()
    settle(s, "writes")
    assert stuck not in {slot_of(s, k) for k in okeys}
    assert s.read_pages("kv", [b"h0"], aligned_pages(1, P), timeout=30) == [False]
    assert s.exists_prefix("kv", [b"h0"]) == 0
    assert pool.slots.used == 6  # freed once its I/O returned, never indexed
    out = aligned_pages(6, P)
    assert s.read_pages("kv", okeys, out, timeout=30) == [True] * 6
    assert all(bytes(o) == page(10 + i) for i, o in enumerate(out))


def test_hung_disk_bounds_zero_copy_pages_in_flight(make_store, stalls, monkeypatch):
    """Each zero-copy page under a bound holds a staging token: a dead disk cannot collect an unbounded
    number of pending writes (and their caller-memory references) across backup calls."""
    stall = stalls()
    # One I/O thread, parked at the dead disk before the first call's bound passes: the device holds
    # those writes, as a dead disk does. (An I/O thread that starts only after the bound, on a loaded
    # machine, finds its pages cancelled and hands their tokens back while they still count in flight
    # until the write thread reaps them: a momentary count above the bound, not the dead disk's state.)
    s = make_store(fault_injector=stall, io=dict(ZC, threads=1, max_inflight_pages=4))
    stall.armed = True
    device_before_bound(monkeypatch, s, lambda: stall.slots, "the I/O thread reaching the dead disk")
    for call in range(2):
        done, res = within(lambda: s.write_pages("kv", [b"c%d-%d" % (call, i) for i in range(8)],
                                                 filled(8), timeout=BOUND))
        assert done and res == [False] * 8
        st = s.stats()["inflight"]
        assert st["writes"] <= 4 and st["staging_pages"] <= 4, st
    stall.gate.set()
    settle(s, "writes")
    assert s.stats()["inflight"]["staging_pages"] == 0


def test_unaligned_pages_fall_back_to_the_copy_path(make_store):
    s = make_store(io=ZC)
    raw = np.zeros(9 * P + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096 + 64  # 64 B past a 4 KiB boundary, like torch's default allocator
    unaligned = [raw[off + i * P: off + (i + 1) * P] for i in range(8)]
    for i, b in enumerate(unaligned):
        b[:] = np.frombuffer(page(i), np.uint8)
    assert s.write_pages("kv", [b"u%d" % i for i in range(8)], unaligned, timeout=30) == [True] * 8
    assert s.stats()["counters"]["zero_copy_pages"] == 0
    assert s.write_pages("kv", [b"a%d" % i for i in range(8)], filled(8, 20), timeout=30) == [True] * 8
    assert s.stats()["counters"]["zero_copy_pages"] == 8
    out = aligned_pages(8, P)
    assert s.read_pages("kv", [b"u%d" % i for i in range(8)], out, timeout=30) == [True] * 8
    assert all(bytes(o) == page(i) for i, o in enumerate(out))
    assert s.read_pages("kv", [b"a%d" % i for i in range(8)], out, timeout=30) == [True] * 8
    assert all(bytes(o) == page(20 + i) for i, o in enumerate(out))


def test_flag_off_copies_under_a_timeout(make_store):
    s = make_store()
    assert s.config.io.zero_copy_writes is False
    assert s.write_pages("kv", [b"f%d" % i for i in range(4)], filled(4), timeout=30) == [True] * 4
    assert s.stats()["counters"]["zero_copy_pages"] == 0


def test_zero_copy_writes_is_validated(l3_root):
    with pytest.raises(L3ConfigError, match=r"io\.zero_copy_writes: must be true or false, got str 'yes'"):
        parse_l3_config(config_doc(l3_root, io={"zero_copy_writes": "yes"}))
    assert parse_l3_config(config_doc(l3_root, io=ZC)).io.zero_copy_writes is True
