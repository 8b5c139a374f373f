"""A store whose open fails after its slabs and index are open: cold start 'clear' has not run yet,
and every file it opened is closed again.

Staging (io.max_inflight_pages page images per payload, allocated and faulted in at open) used to be
built after cold start: an allocation failure there came after 'clear' had wiped the rank's index,
and left the slab and LMDB descriptors open. The allocation failure is injected where it happens
(Staging's constructor raising MemoryError); everything else is the real store on real files.
"""

import os

import numpy as np
import pytest

from l3_helpers import config_doc, page
from sglang_cp.l3 import L3Store, parse_l3_config
from sglang_cp.l3 import opening

P = 16384


def _fds():
    return sorted(os.listdir("/proc/self/fd"))


def test_failed_staging_allocation_wipes_nothing_and_leaks_no_fd(l3_root, monkeypatch):
    cfg = parse_l3_config(config_doc(l3_root))
    keys = [b"k%d" % i for i in range(5)]
    with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}) as s:
        assert all(s.write_pages("kv", keys, [page(i) for i in range(5)], timeout=60))

    def no_memory(*a, **kw):
        raise MemoryError("staging: cannot allocate")

    before = _fds()
    monkeypatch.setattr(opening, "Staging", no_memory)
    with pytest.raises(MemoryError):
        L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}, cold_start="clear")
    monkeypatch.undo()
    assert _fds() == before, "the failed open left descriptors open"

    with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}, cold_start="load") as s:
        outs = [np.zeros(P, np.uint8) for _ in keys]
        assert s.read_pages("kv", keys, outs, timeout=60) == [True] * 5, "the failed open wiped the index"
        assert all(bytes(o) == page(i) for i, o in enumerate(outs))


def _threads_and_rings():
    import threading

    rings = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            rings += "io_uring" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return threading.active_count(), rings


def _settled():
    """Threads, io_uring rings and descriptors once the count of threads stops moving (a closed store's
    executor threads exit on their own shortly after)."""
    import gc
    import time

    last, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:
        gc.collect()
        now = (_threads_and_rings(), _fds())
        if now == last:
            return now
        last = now
        time.sleep(0.3)
    return last


@pytest.mark.parametrize("engine", ["python", "uring"])
def test_a_failed_cold_start_leaves_no_io_threads_rings_or_locks(l3_root, monkeypatch, engine):
    """Cold start raising (an index it cannot open, say) fails the open; the read path built before it
    (I/O threads, the uring engine's rings and landing memory) goes with the files and rank locks, so a
    server can fix the cause and open the store again in the same process."""
    from sglang_cp.l3 import store as store_mod
    from sglang_cp.l3.errors import L3StartupError

    cfg = parse_l3_config(config_doc(l3_root, io={"read_engine": engine, "threads": 4}))
    with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}) as s:
        assert s.write_pages("kv", [b"k"], [page(1)], timeout=60) == [True]
    if engine == "uring":
        from sglang_cp.l3.native import uring

        if uring.probe() != 0:
            pytest.skip(f"io_uring refused here (errno {uring.probe()})")
    before = _settled()

    def failing(st, mode):
        raise L3StartupError("index.dir: cannot open the index (injected)")
    monkeypatch.setattr(store_mod, "recover", failing)
    for _ in range(2):
        with pytest.raises(L3StartupError, match="injected"):
            L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}, cold_start="load")
    monkeypatch.undo()
    assert _settled() == before, "the failed opens left threads, rings or descriptors"
    with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}, cold_start="load") as s:
        out = [np.zeros(P, np.uint8)]
        assert s.read_pages("kv", [b"k"], out, timeout=60) == [True] and bytes(out[0]) == page(1)
