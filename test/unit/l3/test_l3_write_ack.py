"""durability.backup_ack: when write_pages returns, and read-your-writes for pages whose commit is pending.

Real O_DIRECT slabs and a real LMDB index; the group commit is held (or failed) at its fdatasync through
the slab's fault-injection seam.
"""

import threading

import numpy as np
import pytest

from l3_helpers import WAIT_S, config_doc, held_sync, index_rows, page, wait_for
from sglang_cp.l3 import L3ConfigError, parse_l3_config
from sglang_cp.l3.format.blob import key_digest, key_digester, key_digests

P = 16384


def keys(n, prefix=b"k"):
    return [prefix + b"%d" % i for i in range(n)]


def write_in_thread(s, ks, pages):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("ok", s.write_pages("kv", ks, pages)), daemon=True)
    t.start()
    return t, box


@pytest.mark.parametrize("commit_starts", ["whenever", "after_the_return"])
def test_written_ack_returns_before_the_commit_and_reads_its_own_writes(make_store, monkeypatch, commit_starts):
    """The caller is answered when its pages are written; the group commit starts after that, on its own
    thread, so the test waits for the commit to park at fdatasync before it looks at the pending state.
    'after_the_return' holds the commit thread until write_pages has returned: the order in which the
    commit reaches fdatasync only after the caller already has its answer (a loaded machine's order)."""
    inj, gate, syncs = held_sync()
    returned = threading.Event()
    if commit_starts == "after_the_return":
        from sglang_cp.l3 import commit
        commit_group = commit.GroupCommitter.commit_group

        def held_commit(self, group, touches):
            assert returned.wait(30), "write_pages never returned"
            return commit_group(self, group, touches)
        monkeypatch.setattr(commit.GroupCommitter, "commit_group", held_commit)
    s = make_store(durability={"backup_ack": "written"}, fault_injector=inj)
    try:
        _written_ack_reads_its_own_writes(s, gate, syncs, returned)
    finally:
        gate.set()  # a failed assertion must not leave the commit thread parked for the gate's 30 s
        returned.set()


def _written_ack_reads_its_own_writes(s, gate, syncs, returned):
    ks = keys(12)
    t, box = write_in_thread(s, ks, [page(i) for i in range(12)])
    t.join(WAIT_S)
    # The caller has its answer while the commit is pending (not started, or parked at fdatasync) ...
    assert box.get("ok") == [True] * 12, "write_pages did not return while the group commit was pending"
    returned.set()
    assert syncs.arrived.wait(WAIT_S), "no group commit reached fdatasync"
    # ... the index does not have the pages yet (durability is still the commit's) ...
    assert s.state.index.exists_prefix(index_rows(s, ["kv"], ks)) == 0
    # ... and this process sees and reads them (read-your-writes).
    assert s.exists_prefix("kv", ks) == 12
    assert s.exists_each(["kv"], ks) == [True] * 12
    o = [np.zeros(P, np.uint8) for _ in ks]
    assert s.read_pages("kv", ks, o) == [True] * 12
    assert all(bytes(o[i]) == page(i) for i in range(12))
    # Rewriting a key whose first write is pending is answered at once (dedup on a written task).
    assert s.write_pages("kv", ks[:3], [page(i) for i in range(3)]) == [True] * 3
    gate.set()
    wait_for(lambda: s.stats()["occupancy"]["kv"]["durable"] == 12, "the 12 pages' group commit landing")
    assert s.state.index.count() == 12


def test_durable_ack_default_waits_for_the_commit(make_store):
    inj, gate, syncs = held_sync()
    s = make_store(fault_injector=inj)
    ks = keys(6)
    t, box = write_in_thread(s, ks, [page(i) for i in range(6)])
    t.join(1.0)
    assert "ok" not in box, "default backup_ack returned before fdatasync + index commit"
    # Nothing pending is visible by default: a page counts only once durable.
    assert s.exists_prefix("kv", ks) == 0
    gate.set()
    t.join(WAIT_S)
    assert box["ok"] == [True] * 6 and s.exists_prefix("kv", ks) == 6


def test_written_ack_then_failed_commit_is_a_later_miss_never_bytes(make_store):
    gate = threading.Event()

    def injector(op, slab, slot):
        if op == "sync":
            assert gate.wait(30)
            raise OSError(5, "injected EIO at fdatasync")
    s = make_store(durability={"backup_ack": "written"}, fault_injector=injector)
    ks = keys(5)
    assert s.write_pages("kv", ks, [page(i) for i in range(5)]) == [True] * 5
    gate.set()
    wait_for(lambda: not s.stats()["inflight"]["writes"], "the failed group commit settling its pages")
    assert s.stats()["counters"]["write_errors"] >= 1
    assert s.exists_prefix("kv", ks) == 0
    o = [np.zeros(P, np.uint8) for _ in ks]
    assert s.read_pages("kv", ks, o) == [False] * 5
    assert s.stats()["occupancy"]["kv"]["used"] == 0, "slots of failed pages must come back"


def test_written_pages_survive_close_and_reopen(make_store, l3_root):
    s = make_store(durability={"backup_ack": "written"})
    ks = keys(20)
    assert s.write_pages("kv", ks, [page(i) for i in range(20)]) == [True] * 20
    s.close()  # close drains the pending group commit
    s2 = make_store(durability={"backup_ack": "written"}, cold_start="load")
    assert s2.exists_prefix("kv", ks) == 20
    o = [np.zeros(P, np.uint8) for _ in ks]
    assert s2.read_pages("kv", ks, o) == [True] * 20
    assert all(bytes(o[i]) == page(i) for i in range(20))


def test_exists_each_answers_each_residue_class_prefix(make_store):
    s = make_store(payloads={"kv": P, "ix": 4096})
    ks = keys(12)
    have = [0, 1, 2, 3, 5, 6, 9, 10]  # class 0 (i%3==0): 0,3,6,9 -> all; class 1: 1,10 (4 missing); class 2: 2,5 (8 missing)
    assert all(s.write_pages("kv", [ks[i] for i in have], [page(i) for i in have]))
    assert all(s.write_pages("ix", [ks[i] for i in have], [page(i, 4096) for i in have]))
    got = s.exists_each(["kv", "ix"], ks, classes=3)
    assert got == [True, True, True, True, False, True, True, False, False, True, False, False]
    assert s.exists_each(["kv"], ks) == [True] * 4 + [False] * 8
    assert s.exists_prefix_multi(["kv", "ix"], ks) == 4
    s.delete("ix", [ks[2]])
    assert s.exists_each(["kv", "ix"], ks, classes=3)[2] is False
    with pytest.raises(ValueError, match="classes"):
        s.exists_each(["kv"], ks, classes=0)


def test_key_digester_matches_key_digest():
    for rank, key in [(0, b""), (7, b"x" * 300), (12, b"abc/0of8/ff")]:
        assert key_digester(rank)(key) == key_digest(rank, key)
        assert key_digests(rank)([key, b"y", key]) == [key_digest(rank, key), key_digest(rank, b"y"), key_digest(rank, key)]


def test_backup_ack_is_validated(l3_root):
    with pytest.raises(L3ConfigError,
                       match=r"durability\.backup_ack: 'soon' is not one of durable, written, operation"):
        parse_l3_config(config_doc(l3_root, durability={"plp_policy": "ignore", "backup_ack": "soon"}))
    assert parse_l3_config(config_doc(l3_root)).backup_ack == "durable"
    assert parse_l3_config(config_doc(l3_root, durability={"backup_ack": "operation"})).backup_ack == "operation"
