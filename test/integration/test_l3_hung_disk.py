"""A hung disk under upstream's own HiCache controller: backup, prefetch and shutdown return.

One real rank process (cp_harness): upstream's host pool and ``HybridCacheController`` storage
threads drive our backend. The store's fault seam (DiskSlab.fault_injector) then blocks every slab
write or read on an Event nothing sets until the scenario ends, as a device that never answers.
Upstream's threads call the backend synchronously and wait for its answer, so each step below hangs
unless the backend's bounds hold. The bounds are shortened to BOUND inside the rank process; each
step must finish within BOUND x SLACK (a correctness margin, not a performance threshold).
"""

import pytest

from benchmark.support.cp_harness import PAGE, run_ranks
from cp_scenarios import demo_l3_config

BOUND = 1.0
SLACK = 5.0


@pytest.fixture(params=[False, True], ids=["copy", "zero_copy_writes"])
def l3cfg(disk_tmp, request):
    return demo_l3_config(disk_tmp / "l3", zero_copy=request.param), request.param


def hung_disk(rank, world, rendezvous, l3_config, n_pages):
    import queue
    import threading
    import time

    import sglang_cp.integration.cp_l3.backend as backend_mod
    import sglang_cp.l3.store as store_mod
    from benchmark.support.cp_harness import Rank, tokens_for

    store_mod.CLOSE_TIMEOUT_S = BOUND
    gate = threading.Event()
    stalled = {"ops": set()}

    def stall(op, _slab, _slot):
        if op in stalled["ops"]:
            gate.wait()

    def timed(fn):
        t0 = time.monotonic()
        try:
            return fn(), time.monotonic() - t0
        except queue.Empty:  # the controller never acked within the step's limit
            return "no ack", time.monotonic() - t0

    r = Rank(rank, world, rendezvous, l3_config, sharded=False)
    out = {}
    try:
        store = r.backend.store
        store.state.pools["kv"].slab.fault_injector = stall
        tokens = tokens_for(n_pages, seed=5)
        hi = r.alloc_host(n_pages * PAGE)
        r.fill(hi, n_pages)
        out["backed_healthy"] = r.backup(tokens, hi)
        out["zero_copy_pages"] = store.stats()["counters"]["zero_copy_pages"]
        # The short bounds only from here on: the healthy backup runs under the default ones (a loaded
        # disk's fdatasync can take longer than BOUND, and a healthy backup that timed out is not one).
        backend_mod.READ_TIMEOUT_S = backend_mod.WRITE_TIMEOUT_S = BOUND
        # Reads never come back: the prefetch must end, with nothing loaded.
        stalled["ops"] = {"read"}
        r.zero_host()
        out["prefetch"], out["prefetch_s"] = timed(lambda: r.prefetch(tokens, timeout=BOUND * SLACK)[:2])
        out["host_untouched"] = all(not pool.kv_buffer.any() for _k, pool in r._pools())
        # Writes never come back: the backup must be acked, with nothing stored.
        stalled["ops"] = {"write"}
        tokens2 = tokens_for(n_pages, seed=6)
        hi2 = r.alloc_host(n_pages * PAGE)
        r.fill(hi2, n_pages, salt=1)
        out["backup"], out["backup_s"] = timed(lambda: r.backup(tokens2, hi2, timeout=BOUND * SLACK))
        # Shutdown with those writes still stuck in the device.
        t0 = time.monotonic()
        closer = threading.Thread(target=r.cc.detach_storage_backend, daemon=True)
        closer.start()
        closer.join(BOUND * SLACK * 2)
        out["close_done"], out["close_s"] = not closer.is_alive(), time.monotonic() - t0
        return out
    finally:
        gate.set()  # teardown: let the stuck I/O threads go so the process can exit
        r.dist.destroy_process_group()


def test_hung_disk_never_wedges_backup_prefetch_or_shutdown(l3cfg):
    n_pages = 4
    cfg, zero_copy = l3cfg
    (res,) = run_ranks(1, hung_disk, (cfg, n_pages), timeout=300)
    print(f"hung disk, bounds {BOUND} s: prefetch returned after {res['prefetch_s']:.2f} s, backup after "
          f"{res['backup_s']:.2f} s, shutdown after {res['close_s']:.2f} s")
    assert res["backed_healthy"] == n_pages * PAGE, res
    # The healthy backup went from the host pool itself when the flag is on (upstream's pool is page-aligned).
    assert res["zero_copy_pages"] == (n_pages if zero_copy else 0), res
    assert res["prefetch"] != "no ack", f"prefetch still waiting for a read that never returns: {res}"
    hit, completed = res["prefetch"]
    assert hit == n_pages * PAGE and completed == 0, res  # the index has them; none could be read
    assert res["host_untouched"], "a read that never returned still wrote into the host pool"
    assert res["backup"] != "no ack", f"backup still waiting for a write that never returns: {res}"
    assert res["backup"] == 0, res  # not durable in time: reported not written
    assert res["close_done"], f"shutdown still waiting for the stuck device: {res}"
