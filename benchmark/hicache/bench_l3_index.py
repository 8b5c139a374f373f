#!/usr/bin/env python
"""The L3 hit query (exists_*) and the store's spill/reload at node-scale index sizes.

For each index size N (default 1M, 5M, 20M entries; 20M = a node of 8 x 7.68 TB drives of 3.3 MB
pages), one run:

  1. build   N entries of the other 7 ranks of a node, straight into the shared LMDB index in bulk
             (sorted keys, MDB_APPEND; two payload tags, like KV + DSA indexer); bytes/entry reported;
  2. open    an L3Store for rank 0 on that index (cold start 'clear': a range scan of rank 0's keys; timed);
  3. write   16,384 real pages x 2 payloads (4 KiB each) for rank 0 through write_pages, so the
             queried keys are real index entries among the N others;
  4. query   exists_prefix (1 payload) and exists_prefix_multi (KV + indexer) over 2,048 and 16,384 keys
             (a 128K- and a 1M-token context of 64-token pages), and exists_each with 8 classes (one CP8
             rank's hit query for every rotation phase at once), all keys present (the full scan);
             the keys are passed the way the backend passes them (KeyScheme: the constant head as
             key_prefix, upstream's str page hashes as keys, or encoded where the store takes bytes
             only), timed with the query; then again with rank 0 holding N/8 pages (its share of an 8-rank node:
             the query's lookups are in the rank's held digests, whose size is its page count), synthetic
             digests added to its HeldDigests (--held-share 0 skips it), and that query's two steps alone
             (the keys' digests; the held table's probes) so a slow host shows which one it is;
             then rank 0 is reopened with cold start 'load' (its 32,768 entries among the N: timed);
  5. I/O     spill (write_pages per 128 pages, to DURABLE) and cold reload (read_pages per 128) of
             --io-mib of 1 MiB pages, against raw O_DIRECT (pwrite x io.threads + fdatasync; preadv)
             in the same run, so 'unchanged at 20M' is a same-run ratio.

Every figure: median with p99 and min-max over --runs repetitions. The index lives in page cache
(it was just written; a serving node's index is hot). The index is deleted after each size.

    python -m benchmark.hicache.bench_l3_index --dir /var/tmp/l3idx [--sizes 1000000,5000000,20000000]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


from sglang_cp.integration.cp_l3.keys import KeyIdentity, KeyScheme
from sglang_cp.cachebench.rawdisk import drop_caches
from sglang_cp.l3 import L3Store, parse_l3_config
from sglang_cp.l3.format.blob import ALIGN, key_digests, payload_tag
from sglang_cp.l3.native.digests import native_digests
from sglang_cp.l3.format.index import IndexEntry, SharedIndex, key_prefix

PAYLOADS = {"kv": 4096, "indexer": 4096}
BIG = 1 << 20  # spill/reload pages (a second store, rank 1, on its own directory)
QUERY_KEYS = 16384
BATCH = 128


def lmdb_rows(payloads: list[str], skeys: list[bytes], rank: int = 0) -> list[tuple]:
    """The index keys rank `rank` holds for each key in every payload, one row per key (the input of
    LmdbIndex.exists_prefix, the LMDB floor the store's hit query is measured against)."""
    digests = key_digests(rank)(skeys)
    return list(zip(*[[key_prefix(rank, payload_tag(p)) + d for d in digests] for p in payloads]))


def build(index, n: int, seed: int) -> float:
    """n entries of ranks 1..7 (half KV, half indexer), appended in key order: one sorted bulk load.
    Keys in the index's own layout (key_prefix(rank, tag) + 16-byte digest)."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    kl = len(key_prefix(0, 0)) + 16
    keys = np.empty((n, kl), np.uint8)
    prefixes = np.frombuffer(b"".join(key_prefix(1 + r, payload_tag(p)) for r in range(7)
                                      for p in ("kv", "indexer")), np.uint8).reshape(14, kl - 16)
    keys[:, :kl - 16] = prefixes[np.arange(n) % 14]
    keys[:, kl - 16:] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    order = np.sort(keys.view(f"S{kl}").ravel())  # memcmp order of equal-length keys = LMDB's order
    raw = order.tobytes()  # tobytes keeps trailing NULs (bytes(np.bytes_) would strip them)
    del keys, order
    vals = {1 + r: IndexEntry(1 + r, r % 8, r, 0, 4096, 1, 1).pack() for r in range(7)}
    rank_at = len(key_prefix(0)) - 1  # the rank's low byte (ranks 1..7)
    chunk = 1 << 20
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        with index.env.begin(write=True) as txn:
            cur = txn.cursor()
            items = ((raw[kl * i:kl * i + kl], vals[raw[kl * i + rank_at]]) for i in range(s, e))
            consumed, added = cur.putmulti(items, append=True)
            assert added == e - s, f"bulk load: {added} of {e - s} appended (duplicate or out-of-order key)"
    return time.perf_counter() - t0


def timed_calls(fn, runs: int, busy: bool = False) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds of this thread) per call. On a shared, loaded machine wall time is
    mostly waiting for a core; CPU time is the query's own cost. ``busy``: the calls run beside a Python
    thread that never pauses (``--busy-scheduler``: a server's scheduler), so each GIL release the query
    makes waits up to CPython's switch interval."""
    ctx = contextlib.nullcontext()
    if busy:
        from benchmark.support.busy_thread import BusyScheduler

        ctx = BusyScheduler()
    wall, cpu = [], []
    with ctx:
        for _ in range(runs):
            c0, t0 = time.thread_time(), time.perf_counter()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    return wall, cpu


def stat_ms(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return f"{statistics.median(xs) * 1e3:.2f} ms (p99 {p99 * 1e3:.2f}, {xs[0] * 1e3:.2f}-{xs[-1] * 1e3:.2f})"


def raw_io(d: str, pages: list, page_bytes: int, threads: int) -> tuple[float, float]:
    path = os.path.join(d, "raw.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        n = len(pages)
        os.posix_fallocate(fd, 0, n * page_bytes)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda i: os.pwrite(fd, pages[i], i * page_bytes), range(n)))
        os.fdatasync(fd)
        tw = time.perf_counter() - t0
        drop_caches()
        outs = [aligned(page_bytes) for _ in range(n)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda i: os.preadv(fd, [outs[i]], i * page_bytes), range(n)))
        tr = time.perf_counter() - t0
        assert all(bytes(o) == bytes(p) for o, p in zip(outs, pages)), "raw: bytes differ"
    finally:
        os.close(fd)
        os.unlink(path)
    return tw, tr


def aligned(nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes + ALIGN, np.uint8)
    off = (-buf.ctypes.data) % ALIGN
    return buf[off:off + nbytes]


def store_io(store: L3Store, pages: list, tag: str) -> tuple[float, float]:
    keys = [f"{tag}-{i}".encode() for i in range(len(pages))]
    t0 = time.perf_counter()
    for s in range(0, len(pages), BATCH):
        assert all(store.write_pages("big", keys[s:s + BATCH], pages[s:s + BATCH])), "spill failed"
    tw = time.perf_counter() - t0
    drop_caches()
    outs = [aligned(BIG) for _ in pages]
    t0 = time.perf_counter()
    for s in range(0, len(pages), BATCH):
        assert all(store.read_pages("big", keys[s:s + BATCH], outs[s:s + BATCH])), "reload missed"
    tr = time.perf_counter() - t0
    assert all(bytes(o) == bytes(p) for o, p in zip(outs, pages)), "ours: bytes differ"
    store.delete("big", keys)
    return tw, tr


def one_size(base: str, n: int, args) -> dict:
    timed = functools.partial(timed_calls, busy=args.busy_scheduler)
    d = tempfile.mkdtemp(prefix=f"idx-{n}-", dir=base)
    out = {"entries": n}
    try:
        idx_dir, disk_dir, disk_io = os.path.join(d, "idx"), os.path.join(d, "disk"), os.path.join(d, "disk-io")
        for x in (idx_dir, disk_dir, disk_io):
            os.makedirs(x)
        n_io = max(BATCH, args.io_mib * 2**20 // BIG)
        est = 2 * 4096 * 1.0 + n * 120  # upper bound for the map: ~66 B/entry packed, 120 B with slack
        map_gb = max(0.5, est * 1.5 / 1e9)
        cfg = parse_l3_config({
            "index": {"dir": idx_dir, "map_size_gb": map_gb, "max_map_size_gb": map_gb * 2},
            "io": {"threads": args.threads, "max_inflight_pages": 256},
            "durability": {"plp_policy": "ignore"},
            "disks": [{"name": "d", "path": disk_dir, "capacity_gb": (QUERY_KEYS + 64) * 2 * 8192 / 0.85 / 1e9},
                      {"name": "io", "path": disk_io, "capacity_gb": (n_io + 8) * (BIG + 4096) / 0.85 / 1e9}],
        })
        index = SharedIndex(idx_dir, cfg.index.map_size_bytes, cfg.index.max_map_size_bytes)
        try:
            out["build_s"] = build(index, n, seed=n)
            index.env.sync(True)
            out["bytes_per_entry"] = os.path.getsize(os.path.join(idx_dir, "data.mdb")) / n
            t0 = time.perf_counter()
            store = L3Store(cfg, rank=0, ranks_per_node=2, payloads=PAYLOADS, cold_start="clear")
            out["cold_start_clear_s"] = time.perf_counter() - t0
            io_store = L3Store(cfg, rank=1, ranks_per_node=2, payloads={"big": BIG}, cold_start="load") \
                if args.io_mib else None
        finally:
            index.close()  # the store holds its own reference
        try:
            ks = KeyScheme(KeyIdentity(model="glm-5", dtype="torch.uint8", page_size=64, layout="page_first",
                                       rank_replicated=True, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, cp_size=8,
                                       cp_strategy="zigzag", sharded=True, page_bytes=(("kv", 4096),),
                                       logical_dtypes=(("kv", "fp8_e4m3"),)))
            # (the io store on rank 1 opened with 'load': its scan of the index is not timed)
            hashes = [os.urandom(32).hex() for _ in range(QUERY_KEYS)]
            skeys = ks.keys(hashes, 0)
            page = np.zeros(4096, np.uint8)
            for p in ("kv", "indexer"):
                for s in range(0, QUERY_KEYS, 1024):
                    assert all(store.write_pages(p, skeys[s:s + 1024], [page] * len(skeys[s:s + 1024])))
            out["index_entries"] = store.state.index.count()
            # The keys as the backend of this tree passes them: upstream's str page hashes where the store
            # takes str tails, else encoded (KeyScheme.suffixes; the tree before it did).
            try:
                store.exists_prefix("kv", hashes[:1], key_prefix=ks.prefix(0))
                tails = list
                out["keys_as"] = "str page hashes"
            except TypeError:
                tails = ks.suffixes
                out["keys_as"] = "bytes (KeyScheme.suffixes)"
            dts = [int(x) for x in args.digest_threads.split(",")]
            hashers = {dt: native_digests(dt) for dt in dts}

            def use(dt):  # the store's hit-query hasher: hashlib (0) or the native one on dt threads
                store.state.digests = key_digests(0, hashers[dt])

            def runs_for(nk):
                return args.runs if nk <= 2048 else max(20, args.runs // 4)

            def kvix_queries(nk, tag):
                """The kv+ix hit queries over the first nk keys: exists_prefix_multi, exists_each (8 classes)."""
                h, runs = hashes[:nk], runs_for(nk)
                out[f"{tag[0]}_{nk}{tag[2]}"] = timed(
                    lambda: store.exists_prefix_multi(["kv", "indexer"], tails(h), key_prefix=ks.prefix(0)) == nk
                    or _fail(), runs)
                out[f"{tag[1]}_{nk}{tag[2]}"] = timed(
                    lambda: all(store.exists_each(["kv", "indexer"], tails(h), classes=8, key_prefix=ks.prefix(0)))
                    or _fail(), runs)
            for dt in dts[1:]:
                use(dt)
                for nk in (2048, QUERY_KEYS):
                    kvix_queries(nk, ("prefix2", "each8", f"_t{dt}"))
            use(dts[0])
            for nk in (2048, QUERY_KEYS):
                h = hashes[:nk]
                runs = runs_for(nk)
                out[f"prefix1_{nk}"] = timed(
                    lambda: store.exists_prefix("kv", tails(h), key_prefix=ks.prefix(0)) == nk or _fail(), runs)
                kvix_queries(nk, ("prefix2", "each8", ""))
                if args.busy_scheduler:
                    continue  # py-lmdb releases the GIL for every get: seconds per call beside a busy thread
                # Floors, same run: the LMDB lookups alone (store keys digested beforehand), one txn.
                rows1 = lmdb_rows(["kv"], skeys[:nk])
                rows2 = lmdb_rows(["kv", "indexer"], skeys[:nk])
                out[f"lmdb1_{nk}"] = timed(lambda: store.state.index.exists_prefix(rows1) == nk or _fail(), runs)
                out[f"lmdb2_{nk}"] = timed(lambda: store.state.index.exists_prefix(rows2) == nk or _fail(), runs)
            # Rank 0 holding its share of the node (N / 8 pages): the hit query looks keys up in the rank's
            # held digests, whose size is the rank's page count, not the index's. Synthetic digests (both
            # payloads) are added to the store's HeldDigests and its table rebuilt, as cold start does.
            share = max(0, n // 8 - QUERY_KEYS)
            if args.held_share and share:
                held = store.state.held
                raw = np.random.default_rng(n + 1).bytes(16 * share)
                for i in range(0, 16 * share, 16):
                    held._d[raw[i:i + 16]] = 3
                del raw
                if hasattr(held, "rebuild_table"):
                    t0 = time.perf_counter()
                    held.rebuild_table()
                    out["table_build_s"] = time.perf_counter() - t0
                out["held"] = len(held)
                for dt, nk in [(dt, nk) for dt in dts for nk in (2048, QUERY_KEYS)]:
                    use(dt)
                    t = "" if dt == dts[0] else f"_t{dt}"
                    h, runs = hashes[:nk], runs_for(nk)
                    kvix_queries(nk, ("share2", "share8", t))
                    # Where a query's time goes, same run: the keys' digests alone, then the held table's
                    # probes alone for those digests (one vectorized call; the query probes in chunks).
                    out[f"digest_{nk}{t}"] = timed(lambda: store.state.digests(tails(h), ks.prefix(0)), runs)
                    dg = store.state.digests(tails(h), ks.prefix(0))
                    if not t and getattr(held, "many", None) is not None and held.many(dg) is not None:
                        out[f"probe_{nk}"] = timed(lambda: held.many(dg), runs)
                use(dts[0])
                held._d.clear()  # synthetic: not the store's pages (it is closed next)
            store.close()
            for hs in hashers.values():
                if hs is not None:
                    hs.close()
            t0 = time.perf_counter()
            store = L3Store(cfg, rank=0, ranks_per_node=2, payloads=PAYLOADS, cold_start="load")
            out["cold_start_load_s"] = time.perf_counter() - t0
            out["loaded"] = store.stats()["cold_start"]["live"]
            assert store.exists_prefix_multi(["kv", "indexer"], skeys) == QUERY_KEYS, "load lost pages"
            if io_store is not None:
                rng = np.random.default_rng(1)
                pages = []
                for _ in range(n_io):
                    a = aligned(BIG)
                    a[:] = rng.integers(0, 256, BIG, dtype=np.uint8)
                    pages.append(a)
                ws, rs, rws, rrs = [], [], [], []
                for rep in range(args.io_reps):
                    os.sync()
                    tw, tr = raw_io(disk_io, pages, BIG, args.threads)
                    os.sync()
                    ow, orr = store_io(io_store, pages, f"io{rep}")
                    rws.append(tw / ow)
                    rrs.append(tr / orr)
                    ws.append(ow)
                    rs.append(orr)
                out["io_bytes"] = n_io * BIG
                out["spill_vs_raw"] = rws
                out["reload_vs_raw"] = rrs
                out["spill_gbps"] = [out["io_bytes"] / t / 1e9 for t in ws]
                out["reload_gbps"] = [out["io_bytes"] / t / 1e9 for t in rs]
        finally:
            store.close()
            if io_store is not None:
                io_store.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def _fail():
    raise AssertionError("hit query answered less than the full prefix")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="scratch dir on a real disk (not tmpfs)")
    ap.add_argument("--sizes", default="1000000,5000000,20000000")
    ap.add_argument("--runs", type=int, default=200, help="hit queries per cell (16K-key cells: runs/4, >= 20)")
    ap.add_argument("--io-mib", type=int, default=256, help="spill/reload bytes per rep (0: skip)")
    ap.add_argument("--io-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--held-share", type=int, default=1, help="1: also time the hit query with rank 0 holding "
                    "N/8 pages (its share of an 8-rank node); 0: skip")
    ap.add_argument("--digest-threads", default="0", help="index.digest_threads values to compare, comma list; "
                    "the first is the store's own, each further one repeats the kv+ix hit queries with the native "
                    "hasher on that many threads (e.g. 0,4). Native rows are wall time: their work is on several threads")
    ap.add_argument("--busy-scheduler", action="store_true",
                    help="time every query beside a Python thread that never pauses (a server's scheduler)")
    args = ap.parse_args()
    if args.busy_scheduler and not __package__:
        ap.error("--busy-scheduler: run it from the repository root as a module: "
                 "python -m benchmark.hicache.bench_l3_index")
    dts = [x.strip() for x in args.digest_threads.split(",")]
    if not dts or not all(x.isdigit() and 0 <= int(x) <= 64 for x in dts) or len(set(dts)) != len(dts):
        ap.error(f"--digest-threads: distinct integers in [0, 64], comma-separated, e.g. 0,4; got {args.digest_threads!r}")
    os.makedirs(args.dir, exist_ok=True)
    t_start = time.time()
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        r = one_size(args.dir, n, args)
        rows.append(r)
        print(f"\n== {n:,} entries of other ranks + {r['index_entries'] - n:,} of rank 0, keys passed as {r['keys_as']} "
              f"(bulk build {r['build_s']:.1f} s, {r['bytes_per_entry']:.0f} B/entry on disk = "
              f"{r['bytes_per_entry'] * n / 1e9:.2f} GB); store open + cold start of rank 0: 'clear' "
              f"{r['cold_start_clear_s']:.2f} s, 'load' of its {r['loaded']:,} entries {r['cold_start_load_s']:.2f} s",
              flush=True)
        for nk in (2048, QUERY_KEYS):
            for cell, what in (("prefix1", "exists_prefix kv         "), ("lmdb1", "  floor: LMDB gets, kv   "),
                               ("prefix2", "exists_prefix_multi kv+ix"), ("lmdb2", "  floor: LMDB gets, kv+ix"),
                               ("each8", "exists_each kv+ix, 8 cls ")):
                if f"{cell}_{nk}" not in r:
                    continue  # (the LMDB floors are not timed beside a busy thread)
                wall, cpu = r[f"{cell}_{nk}"]
                print(f"  {nk:>6} keys: {what} wall {stat_ms(wall)}; CPU {stat_ms(cpu)}")
        for dt in [int(x) for x in dts[1:]]:
            print(f"  index.digest_threads = {dt} (native hasher; wall is the figure, CPU is the calling thread's):")
            for nk in (2048, QUERY_KEYS):
                for cell, what in (("prefix2", "exists_prefix_multi kv+ix"), ("each8", "exists_each kv+ix, 8 cls ")):
                    wall, cpu = r[f"{cell}_{nk}_t{dt}"]
                    print(f"  {nk:>6} keys: {what} wall {stat_ms(wall)}; CPU {stat_ms(cpu)}")
        if "held" in r:
            build = f", table built in {r['table_build_s']:.2f} s" if "table_build_s" in r else ", no table"
            print(f"  rank 0 holding {r['held']:,} pages (N/8, its share of the node{build}):")
            for t in [""] + [f"_t{x}" for x in dts[1:]]:
                if t:
                    print(f"  ... with index.digest_threads = {t[2:]} (native hasher; wall is the figure):")
                for nk in (2048, QUERY_KEYS):
                    for cell, what in (("share2", "exists_prefix_multi kv+ix"), ("share8", "exists_each kv+ix, 8 cls "),
                                       ("digest", "  part: key digests      "), ("probe", "  part: held-table probes")):
                        if f"{cell}_{nk}{t}" not in r:
                            continue
                        wall, cpu = r[f"{cell}_{nk}{t}"]
                        print(f"  {nk:>6} keys: {what} wall {stat_ms(wall)}; CPU {stat_ms(cpu)}")
        if "spill_vs_raw" in r:
            def med(xs):
                return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"
            print(f"  spill (write_pages/128, DURABLE) {med(r['spill_gbps'])} GB/s = {med(r['spill_vs_raw'])}x raw; "
                  f"cold reload (read_pages/128) {med(r['reload_gbps'])} GB/s = {med(r['reload_vs_raw'])}x raw "
                  f"({r['io_bytes'] / 2**20:.0f} MiB of 1 MiB pages, {args.io_reps} reps, same-run raw O_DIRECT)")
    if args.busy_scheduler:
        print("\nevery query ran beside a Python thread that never pauses (--busy-scheduler)")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"wall {time.time() - t_start:.0f} s. Times include the backend's key work (KeyScheme.prefix, and "
          "suffixes where keys pass as bytes); "
          "'floor' = the same lookups with the keys digested beforehand (LMDB alone), same run; 'part' = one step "
          "of the N/8 query alone (the keys' blake2b digests; the held table's probes for those digests).")


if __name__ == "__main__":
    main()
