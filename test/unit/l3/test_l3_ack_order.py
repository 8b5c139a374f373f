"""A delete, clear or touch made after write_pages returned acts on the page, under every backup_ack.

Under durability.backup_ack = "written" write_pages returns before the page's group commit; here that
commit is parked at its fdatasync (the slab's fault seam) until the write thread has taken the delete or
clear, so the operation always meets the pending commit. A dropped page must stay dropped: at once, after
the commit lands, and after a restart with cold start load or verify. Real O_DIRECT slabs, real LMDB.
"""

import numpy as np
import pytest

from l3_helpers import held_sync, page, wait_for
from sglang_cp.l3 import writer
from sglang_cp.l3.format.blob import write_extent
from sglang_cp.l3.messages import Clear, Delete

P = 16384
ACKS = ["durable", "written", "operation"]


def keys(n, prefix=b"k"):
    return [prefix + b"%d" % i for i in range(n)]


def read(s, ks):
    return s.read_pages("kv", ks, [np.zeros(P, np.uint8) for _ in ks])


def assert_gone(s, ks, when):
    assert read(s, ks) == [False] * len(ks), f"a dropped page was read {when}"
    assert s.exists_prefix("kv", ks) == 0, f"a dropped page was a hit {when}"
    assert s.exists_each(["kv"], ks, classes=2) == [False] * len(ks), f"a dropped page was a hit {when}"


def open_gate_once_handled(monkeypatch, gate, kind):
    """Let the parked commit go on only after the write thread handled a message of `kind`."""
    handle = writer.WriteThread._handle

    def handled(self, m):
        handle(self, m)
        if isinstance(m, kind):
            gate.set()
    monkeypatch.setattr(writer.WriteThread, "_handle", handled)


@pytest.mark.parametrize("read_engine", ["python", "native"], indirect=True)
@pytest.mark.parametrize("ack", ACKS)
@pytest.mark.parametrize("op", ["delete", "clear"])
def test_a_drop_after_a_returned_write_wins(make_store, monkeypatch, op, ack, read_engine):
    inj, gate, _ = held_sync()
    cfg = {"durability": {"backup_ack": ack}}
    s = make_store(fault_injector=inj, **cfg)
    ks = keys(4)
    if ack == "written":  # the write returns at its pwrite; its commit waits for the drop to arrive
        open_gate_once_handled(monkeypatch, gate, Delete if op == "delete" else Clear)
    else:  # the write returns only after its commit
        gate.set()
    try:
        assert s.write_pages("kv", ks, [page(i) for i in range(4)]) == [True] * 4
        if ack == "written":
            assert s.state.index.count() == 0, "the commit was meant to be pending at the drop"
        got = s.delete("kv", ks + [b"never-written"]) if op == "delete" else s.clear()
        assert_gone(s, ks, "right after the drop returned")
        assert got == (4 if op == "delete" else True), "delete must count every page it dropped"
    finally:
        gate.set()  # a failed assertion must not leave the commit thread parked for the gate's 30 s
    wait_for(lambda: s.stats()["inflight"]["writes"] == 0, "the pending group commit settling")
    assert_gone(s, ks, "after the pending commit landed")
    assert s.state.index.count() == 0, "a dropped page is in the index"
    assert s.stats()["occupancy"]["kv"]["used"] == 0, "a dropped page's slot did not come back"
    s.close()
    for mode in ("load", "verify"):
        s2 = make_store(cold_start=mode, **cfg)
        assert_gone(s2, ks, f"after a restart with cold start {mode!r}")
        s2.close()


def test_delete_waiting_for_a_commit_that_fails_counts_nothing(make_store, monkeypatch):
    """The page the delete waited for was never stored: 0 held, and its slot comes back."""
    inj, gate, _ = held_sync()

    def failing(op, slab, slot):
        inj(op, slab, slot)
        if op == "sync":
            raise OSError(5, "injected EIO at fdatasync")
    s = make_store(durability={"backup_ack": "written"}, fault_injector=failing)
    open_gate_once_handled(monkeypatch, gate, Delete)
    ks = keys(3)
    try:
        assert s.write_pages("kv", ks, [page(i) for i in range(3)]) == [True] * 3
        assert s.delete("kv", ks) == 0
    finally:
        gate.set()
    assert_gone(s, ks, "after its commit failed")
    wait_for(lambda: s.stats()["occupancy"]["kv"]["used"] == 0, "the failed pages' slots coming back")


@pytest.mark.parametrize("ack", ACKS)
def test_touch_after_a_returned_write_ranks_the_page_warm(make_store, ack):
    """hot and cold are written (in that order), then hot is touched: GC must reclaim cold first. Under
    "written" both commits are still pending at the touch (hot's parked at fdatasync, cold's queued
    behind it)."""
    inj, gate, _ = held_sync()
    # 10 slots: GC starts above 7 (0.75) and reclaims down to 6 (0.6).
    s = make_store(capacity_gb=10 * write_extent(P) / 1e9, fault_injector=inj, durability={"backup_ack": ack},
                   gc={"high_watermark": 0.75, "low_watermark": 0.6})
    assert s.stats()["occupancy"]["kv"]["total"] == 10
    hot, cold = keys(2, b"hot"), keys(2, b"cold")
    if ack != "written":
        gate.set()  # each write returns only after its commit
    try:
        assert s.write_pages("kv", hot, [page(i) for i in range(2)]) == [True] * 2
        assert s.write_pages("kv", cold, [page(i) for i in range(2, 4)]) == [True] * 2
        s.touch("kv", hot)
    finally:
        gate.set()
    wait_for(lambda: s.stats()["occupancy"]["kv"]["durable"] == 4, "hot's and cold's commits landing")
    assert s.write_pages("kv", keys(4, b"fill"), [page(i) for i in range(4, 8)]) == [True] * 4
    wait_for(lambda: s.stats()["counters"]["gc_reclaimed"] >= 2, "GC reclaiming down to the low watermark")
    assert read(s, hot) == [True] * 2, "the touched pages were reclaimed before colder ones"
    assert read(s, cold) == [False] * 2, "the coldest pages go first"
