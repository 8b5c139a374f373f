"""durability.backup_ack = "operation" under upstream's own backup thread (the integration/cp_l3/backup.py hook).

One real rank process (cp_harness): upstream's ``HybridCacheController`` backs up one storage
operation batch by batch through our backend, on real O_DIRECT slabs and a real LMDB index.
Upstream's batch size is shrunk inside the rank so a small slab holds several batches. The
slab's fault seam parks every fdatasync until the test opens a gate: what got written while no
group could commit, and whether upstream saw the operation acked, tell the two modes apart.
"""

import pytest

from benchmark.support.cp_harness import PAGE, run_ranks
from cp_scenarios import demo_l3_config

N_PAGES = 12
BATCH = 4  # upstream's STORAGE_BATCH_SIZE (128) inside the rank: 3 batches per operation


@pytest.fixture(params=[False, True], ids=["copy", "zero_copy_writes"])
def zero_copy(request):
    return request.param


def l3_config(disk_tmp, ack, zero_copy):
    return demo_l3_config(disk_tmp / "l3", zero_copy=zero_copy, backup_ack=ack)


def backup_with_syncs_held(rank, world, rendezvous, l3_config, n_pages, batch, fail_syncs):
    """Back up n_pages while every fdatasync waits for a gate (or, fail_syncs, fails with EIO once
    the gate opens); then prefetch them back and compare the bytes."""
    import threading
    import time

    import sglang.srt.managers.cache_controller as cc_mod
    from benchmark.support.cp_harness import Rank, tokens_for
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    cc_mod.STORAGE_BATCH_SIZE = batch
    gate = threading.Event()
    writes = []

    def seam(op, _slab, slot):
        if op == "write":
            writes.append(slot)
        elif op == "sync":
            gate.wait(120)
            if fail_syncs:
                raise OSError(5, "injected EIO at fdatasync")

    r = Rank(rank, world, rendezvous, l3_config, sharded=False)
    out = {}
    try:
        store = r.backend.store
        store.state.pools["kv"].slab.fault_injector = seam
        tokens = tokens_for(n_pages, seed=11)
        hi = r.alloc_host(n_pages * PAGE)
        r.fill(hi, n_pages)
        # Hashed here, not on the backup thread: the first hash in a process loads upstream's hash
        # extension, which must not count as the backup standing still.
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        box = {}
        t = threading.Thread(
            target=lambda: box.setdefault("completed", r.backup(tokens, hi, timeout=120, hashes=hashes)),
            daemon=True)
        t.start()
        # Let the backup go as far as it can with no group committed: until every page is written, or,
        # once writing has begun, the count of written pages has not moved for 2 s (the durable mode
        # stops after one batch).
        deadline, last, since = time.monotonic() + 60, -1, time.monotonic()
        while time.monotonic() < deadline and len(writes) < n_pages:
            if len(writes) != last or not writes:
                last, since = len(writes), time.monotonic()
            elif time.monotonic() - since > 2.0:
                break
            time.sleep(0.02)
        out["written_while_held"] = len(writes)
        out["acked_while_held"] = "completed" in box
        out["indexed_while_held"] = store.state.index.count()
        gate.set()
        t.join(120)
        out["completed"] = box.get("completed")
        out["indexed_after_ack"] = store.state.index.count()
        r.group.free(hi)
        r.zero_host()
        hit, completed, hi2 = r.prefetch(tokens)
        out["hit"], out["reloaded"] = hit, completed
        if hi2 is not None:
            out["checked"], out["equal"] = r.check(hi2, completed // PAGE, 0)
        return out
    finally:
        gate.set()
        r.close()


def test_operation_ack_stages_every_batch_and_acks_only_when_all_are_durable(disk_tmp, zero_copy):
    cfg = l3_config(disk_tmp, "operation", zero_copy)
    (res,) = run_ranks(1, backup_with_syncs_held, (cfg, N_PAGES, BATCH, False), timeout=300)
    print(f"operation ack: {res}")
    # Every batch of the operation reached the disk while no group could commit ...
    assert res["written_while_held"] == N_PAGES, res
    # ... but upstream was not told the operation is backed up, and nothing is in the index yet.
    assert not res["acked_while_held"], f"the operation was acked before its pages were durable: {res}"
    assert res["indexed_while_held"] == 0, res
    # Once the syncs go through: acked in full, every page in the index, read back byte-exact.
    assert res["completed"] == N_PAGES * PAGE, res
    assert res["indexed_after_ack"] == N_PAGES, res
    assert res["hit"] == res["reloaded"] == N_PAGES * PAGE, res
    assert res["checked"] == res["equal"] == N_PAGES, res


def test_durable_ack_writes_one_batch_per_commit(disk_tmp):
    """The default, for contrast: each batch waits for its own commit, so only the first is written
    while the syncs are held."""
    cfg = l3_config(disk_tmp, "durable", False)
    (res,) = run_ranks(1, backup_with_syncs_held, (cfg, N_PAGES, BATCH, False), timeout=300)
    assert res["written_while_held"] == BATCH, res
    assert not res["acked_while_held"] and res["indexed_while_held"] == 0, res
    assert res["completed"] == N_PAGES * PAGE and res["indexed_after_ack"] == N_PAGES, res
    assert res["checked"] == res["equal"] == N_PAGES, res


def test_operation_ack_reports_pages_that_failed_after_their_batch_returned(disk_tmp):
    """Every group's fdatasync fails: the batches had returned True, the operation's ack says nothing
    was backed up, nothing is indexed, and the prefetch finds nothing (a miss, never bytes)."""
    cfg = l3_config(disk_tmp, "operation", False)
    (res,) = run_ranks(1, backup_with_syncs_held, (cfg, N_PAGES, BATCH, True), timeout=300)
    assert res["written_while_held"] == N_PAGES, res
    assert res["completed"] == 0, res
    assert res["indexed_after_ack"] == 0 and res["hit"] == 0, res
