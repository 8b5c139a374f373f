"""The write path's staging copy (submit.py, native/stage_pages.c) and its backpressure wake-up
(staging.Tokens' `ready`).

Pages are copied into staging and checksummed in runs, one native call per run (one GIL release instead
of two per page: beside a busy Python thread each release costs the caller up to the switch interval).
What must hold whichever way the copy runs: every page lands byte-exact with the CRC of its bytes (the
read path checks it, so a wrong CRC is a miss), duplicates in one call are written once, and a caller
blocked on full staging wakes when a run's worth of slots is free, within its deadline, or at close.
"""

import threading
import time

import crc32c as crc32c_pkg
import numpy as np
import pytest

from l3_helpers import WAIT_S, build_native_variant, native_source, page
from sglang_cp.l3 import native
from sglang_cp.l3.staging import Tokens

SIZES = [1, 4095, 256 << 10, (256 << 10) - 1, (256 << 10) + 1, 5750784]


@pytest.mark.parametrize("nbytes", SIZES)
def test_native_staging_copies_each_page_exactly_with_the_crc_of_its_bytes(nbytes):
    lib = native.installed()
    if lib is None:
        pytest.skip("the native library is not installed")
    rng = np.random.default_rng(nbytes)
    srcs = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(3)]
    dsts = [np.zeros(nbytes, np.uint8) for _ in range(3)]
    crcs = native.stage_pages(lib, np.array([d.ctypes.data for d in dsts], np.uint64),
                              np.array([s.ctypes.data for s in srcs], np.uint64), nbytes)
    for s, d, c in zip(srcs, dsts, crcs.tolist()):
        assert bytes(d) == bytes(s)
        assert c == crc32c_pkg.crc32c(bytes(s))


def _write_then_read(make_store, n, size, **io):
    s = make_store(payloads={"kv": size}, io=io)
    keys = [b"k%d" % i for i in range(n)]
    assert s.write_pages("kv", keys, [page(i, size) for i in range(n)], timeout=WAIT_S) == [True] * n
    outs = [bytearray(size) for _ in range(n)]
    got = s.read_pages("kv", keys, outs, timeout=WAIT_S)
    return s, [ok and bytes(o) == page(i, size) for i, (ok, o) in enumerate(zip(got, outs))]


@pytest.mark.parametrize("copy", ["native", "python"])
def test_staged_pages_read_back_exact_whichever_copy_ran(make_store, monkeypatch, copy):
    """More pages than staging holds (the caller blocks and wakes for a run of slots, capped at the
    limit), odd-sized pages (never zero-copy), one key twice in the call (written once)."""
    if copy == "python":  # an installation without the library: numpy's copy and the crc32c package
        monkeypatch.setattr(native, "installed", lambda: None)
    elif native.installed() is None:
        pytest.skip("the native library is not installed")
    s, exact = _write_then_read(make_store, 40, 16384 + 100, max_inflight_pages=3, threads=2)
    assert all(exact)
    assert (s._writes.native is None) == (copy == "python")
    keys = [b"dup", b"dup"] + [b"d%d" % i for i in range(5)]
    pages = [page(7, 16484), page(7, 16484)] + [page(100 + i, 16484) for i in range(5)]
    assert s.write_pages("kv", keys, pages, timeout=WAIT_S) == [True] * 7
    assert s.stats()["counters"]["write_dedup_pages"] >= 1


def test_a_staging_copy_with_a_wrong_crc_is_caught_by_the_read_back(make_store, monkeypatch, tmp_path):
    """The test above must be able to fail: a library whose staging checksums one byte short writes
    blobs whose CRC does not match their bytes, and every such page reads back as a miss."""
    text = native_source("stage_pages.c")
    old = "state = cpl3_crc32c_raw(state, dst + off, len);"
    assert text.count(old) == 1
    lib = build_native_variant(tmp_path, "stage_pages.c", text.replace(old, old.replace("len)", "len - 1)")))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "library_path", lambda: lib)
    s, exact = _write_then_read(make_store, 8, 16384 + 100)
    assert s._writes.native is not None
    assert not any(exact)


def test_a_blocked_caller_wakes_for_a_run_of_tokens_within_its_deadline_and_at_shut():
    t = Tokens(4)
    for _ in range(4):
        assert t.acquire(blocking=False)
    got = []
    waiter = threading.Thread(target=lambda: got.append(t.acquire(ready=3)))
    waiter.start()
    t.release()
    t.release()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # two free: not yet its run
    t.release()
    waiter.join(WAIT_S)
    assert got == [True]  # took one of the three
    assert t.acquire(blocking=False) and t.acquire(blocking=False) and not t.acquire(blocking=False)
    start = time.monotonic()
    assert not t.acquire(deadline=time.monotonic() + 0.1, ready=2)  # past its bound: False, not stuck
    assert time.monotonic() - start < WAIT_S
    late = []
    waiter = threading.Thread(target=lambda: late.append(t.acquire(ready=100)))  # capped at the limit
    waiter.start()
    t.shut()
    waiter.join(WAIT_S)
    assert late == [False]


def test_one_native_call_stages_a_run_of_pages(make_store, monkeypatch):
    """The point of the run: one GIL release per run, not a copy and a CRC per page. Counted at the
    calls (the hand-offs themselves cost time only beside a busy thread, which a test must not time)."""
    from sglang_cp.l3 import submit

    if native.installed() is None:
        pytest.skip("the native library is not installed")
    size = 16384 + 100
    monkeypatch.setattr(submit, "_STAGE_RUN_BYTES", 5 * size)
    runs, per_page = [], []
    real = native.stage_pages
    monkeypatch.setattr(native, "stage_pages", lambda lib, d, s, n: runs.append(len(d)) or real(lib, d, s, n))
    monkeypatch.setattr(submit, "crc32c", lambda *a: per_page.append(1))
    s = make_store(payloads={"kv": size}, io={"max_inflight_pages": 64})
    n = 23
    assert s.write_pages("kv", [b"r%d" % i for i in range(n)], [page(i, size) for i in range(n)],
                         timeout=WAIT_S) == [True] * n
    assert runs == [5, 5, 5, 5, 3] and not per_page
