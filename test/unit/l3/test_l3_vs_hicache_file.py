"""Each failure mode of upstream HiCacheFile (docs: ../shared/notes/anchor-hicache-file.md), and how this
store handles it: it syncs before acking, never serves a flipped byte, fails one bad page not the batch,
drops a bad page and takes a rewrite, and leaves no temp files across a crash + restart."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

from l3_helpers import config_doc, flip, page, slab_path, slot_offset
from sglang_cp.l3 import L3Store, parse_l3_config

P = 16384


def keys(n, prefix=b"h"):
    return [prefix + b"%d" % i for i in range(n)]


def test_durable_means_data_synced_before_index_commit(make_store):
    """HiCacheFile never calls fsync. Here: write -> fdatasync -> index commit, for every page."""
    log = []

    def record(op, slab, slot):
        log.append((op, slot))
    s = make_store(fault_injector=record)
    real_commit = s.state.index.commit

    def commit(puts=(), deletes=(), touches=()):
        puts = list(puts)
        out = real_commit(puts=puts, deletes=deletes, touches=touches)
        log.append(("commit", [e.slot for _, e in puts]))
        return out
    s.state.index.commit = commit
    for b in range(4):
        assert all(s.write_pages("kv", keys(40, b"b%d-" % b), [page(i) for i in range(40)]))
    committed = 0
    for pos, (op, arg) in enumerate(log):
        if op != "commit":
            continue
        for slot in arg:
            w = max(i for i in range(pos) if log[i] == ("write", slot))
            assert any(log[i][0] == "sync" for i in range(w + 1, pos)), f"slot {slot} indexed without fdatasync"
            committed += 1
    assert committed == 160


def test_flipped_byte_is_never_served(make_store):
    """HiCacheFile returns a page with a flipped byte as good data."""
    s = make_store()
    assert all(s.write_pages("kv", keys(4), [page(i) for i in range(4)]))
    flip(slab_path(s), slot_offset(s, b"h2") + 1234, 0x10)
    o = [np.zeros(P, np.uint8) for _ in range(4)]
    assert s.read_pages("kv", keys(4), o) == [True, True, False, True]


def test_one_bad_page_is_one_miss_in_a_128_page_batch(make_store):
    """HiCacheFile: one truncated file raises out of batch_get and the whole 128-page batch counts 0 hits."""
    s = make_store(capacity_gb=0.01)
    ks = keys(128)
    assert all(s.write_pages("kv", ks, [page(i) for i in range(128)]))
    offs = sorted((slot_offset(s, k), i) for i, k in enumerate(ks))
    os.truncate(slab_path(s), offs[-1][0] + 100)  # the page in the last slot is cut short
    o = [np.zeros(P, np.uint8) for _ in range(128)]
    ok = s.read_pages("kv", ks, o)
    assert sum(ok) == 127 and not ok[offs[-1][1]]
    assert all(bytes(o[i]) == page(i) for i in range(128) if ok[i])


def test_bad_page_is_dropped_and_rewritten(make_store):
    """HiCacheFile keeps a truncated file: exists() still says hit and set() skips the rewrite forever."""
    s = make_store()
    ks = keys(8)
    assert all(s.write_pages("kv", ks, [page(i) for i in range(8)]))
    flip(slab_path(s), slot_offset(s, b"h5") + 7)
    o = [np.zeros(P, np.uint8) for _ in range(8)]
    assert s.read_pages("kv", ks, o)[5] is False
    assert s.exists_prefix("kv", ks) == 5, "the bad page is no longer offered as a hit"
    spilled = s.stats()["counters"]["spill_pages"]
    assert s.write_pages("kv", [ks[5]], [page(5)]) == [True]
    assert s.stats()["counters"]["spill_pages"] == spilled + 1, "the rewrite really wrote"
    assert s.read_pages("kv", ks, o) == [True] * 8 and bytes(o[5]) == page(5)


WRITER = textwrap.dedent("""
    import sys, os
    sys.path.insert(0, sys.argv[2])
    from l3_helpers import config_doc, page
    from sglang_cp.l3 import L3Store, parse_l3_config
    s = L3Store(parse_l3_config(config_doc(sys.argv[1])), rank=0, ranks_per_node=1,
                payloads={"kv": 16384}, cold_start="load")
    i = 0
    while True:
        s.write_pages("kv", [b"t%d-%d" % (os.getpid(), i + j) for j in range(16)], [page(j) for j in range(16)])
        i += 16
        if i == 64:
            print("ready", flush=True)
""")


def test_no_stale_files_after_kill_and_restart(make_store):
    """HiCacheFile leaves .tmp files from interrupted writes that no restart cleans up."""
    root = make_store.root
    here = os.path.dirname(os.path.abspath(__file__))
    listings = []
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", WRITER, root, here], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGKILL)
        p.wait()
        s = L3Store(parse_l3_config(config_doc(root)), rank=0, ranks_per_node=1, payloads={"kv": P},
                    cold_start="load")
        s.close()
        listings.append(sorted(os.path.relpath(os.path.join(d, f), root)
                               for d, _, fs in os.walk(root) for f in fs))
    assert listings[0] == listings[1] == listings[2]
    # The slab, the index, the rank's cold-start record (fixed name, replaced atomically) and its two
    # ownership lock files (fixed names, never unlinked): nothing else.
    assert listings[0] == ["d0/sglang-cp-l3/r0.cold_start.json", "d0/sglang-cp-l3/r0.kv.s20480.slab",
                           "d0/sglang-cp-l3/r0.lock", "idx/data.mdb", "idx/lock.mdb", "idx/r0.lock"]
