"""Read landing areas: reads land in store memory, a finisher thread verifies and copies out, and the
area goes back to the free list. The bound depends on one rule: an area whose preadv has not returned
is never handed to another read (its late completion would overwrite that read's bytes). Also: the
areas are whole huge pages where THP allows (a request then needs few device segments).

The stall is the store's fault seam (called before every preadv) waiting on an Event; real files,
real O_DIRECT, real LMDB.
"""

import threading

import numpy as np
import pytest

from l3_helpers import device_before_bound, page
from sglang_cp.l3.format.aligned import address_of

P = 16384


class FirstReadHangs:
    """Fault seam: once armed, the first read blocks on `gate` (a device that never answers it)."""

    def __init__(self):
        self.armed = False
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, op, slab, slot):
        if op == "read" and self.armed:
            self.armed = False
            self.entered.set()
            self.gate.wait()


def keys(n, prefix=b"l"):
    return [prefix + b"%d" % i for i in range(n)]


def record_landing(store):
    """Wrap the slab's read calls: the address each preadv lands at, in call order."""
    slab = store.state.pools["kv"].slab
    seen = []
    for name in ("read_slot", "read_slots"):
        orig = getattr(slab, name)

        def rec(*args, _orig=orig, **kw):
            iovecs = args[-1] if args and isinstance(args[-1], list) else kw.get("iovecs")
            seen.append(address_of(iovecs[0]))
            return _orig(*args, **kw)
        setattr(slab, name, rec)
    return seen


def test_a_stuck_read_keeps_its_landing_area(make_store, monkeypatch):
    hang = FirstReadHangs()
    s = make_store(fault_injector=hang, io={"threads": 2, "max_inflight_pages": 16})
    assert all(s.write_pages("kv", keys(17), [page(i) for i in range(17)]))
    seen = record_landing(s)
    device_before_bound(monkeypatch, s, hang.entered.is_set, "the read reaching the hung device")
    hang.armed = True
    o = [np.full(P, 0xAB, np.uint8)]
    try:
        assert s.read_pages("kv", [b"l16"], o, timeout=0.5) == [False]
        assert hang.entered.is_set()
        stuck_area = seen[0]
        # The other I/O thread keeps serving, cycling through every free area many times over.
        for rep in range(12):
            n = 1 + rep % 8
            out = [np.zeros(P, np.uint8) for _ in range(n)]
            assert s.read_pages("kv", keys(n), out, timeout=30) == [True] * n
            assert all(bytes(x) == page(i) for i, x in enumerate(out))
        later = seen[1:]
        assert later, "no read reached the device"
        assert stuck_area not in later, "a landing area was handed to another read while its preadv was stuck"
    finally:
        hang.gate.set()
    assert (o[0] == 0xAB).all(), "the late completion reached the caller's page"


def test_landing_areas_are_whole_huge_pages_where_thp_allows(make_store):
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    s = make_store(payloads={"kv": 1 << 20}, capacity_gb=0.05, io={"threads": 2, "max_inflight_pages": 16})
    areas = s.reads.landing_areas("kv")
    assert len(areas) == 4  # two per I/O thread: one in a preadv, one being copied out
    for a in areas:
        addr = address_of(a)
        assert addr % (2 << 20) == 0 and a.nbytes % (2 << 20) == 0, "landing area not on huge page boundaries"
    if "[never]" in mode:
        pytest.skip("THP is off on this kernel: the areas are ordinary pages")
    huge = _anon_huge_kib_over([address_of(a) for a in areas])
    assert huge >= sum(a.nbytes for a in areas) >> 10, f"landing areas only {huge} KiB on huge pages"


def _anon_huge_kib_over(addrs):
    """Sum of AnonHugePages of the mappings that contain `addrs` (each mapping counted once)."""
    lines = open("/proc/self/smaps").read().splitlines()
    total, counted = 0, set()
    for i, line in enumerate(lines):
        head = line.split()[0] if line.split() else ""
        if "-" not in head or ":" in head:
            continue
        try:
            lo, hi = (int(x, 16) for x in head.split("-"))
        except ValueError:
            continue
        if any(lo <= a < hi for a in addrs) and (lo, hi) not in counted:
            counted.add((lo, hi))
            for entry in lines[i + 1:]:
                if entry.startswith("AnonHugePages:"):
                    total += int(entry.split()[1])
                    break
    return total
