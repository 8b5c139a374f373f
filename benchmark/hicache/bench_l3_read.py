#!/usr/bin/env python
"""L3 restore reads against the device's own limit: raw O_DIRECT vs the store's read engines, one run.

Each of --ranks processes (the CP ranks of one node) owns a store on --dir and a raw file holding the same
pages, written once. Then, per rep, every rank reads all its pages back at the same time, once per path:

  raw       preadv of whole pages into the destination buffer, `threads` in flight per rank
  python    L3Store.read_pages per 128-page batch (upstream's batch), io.read_engine = "python"
  native    the same with io.read_engine = "native" (the package's C engine)
  uring     the same with io.read_engine = "uring" (the C engine's checks, reads in flight on an io_uring;
            --uring-threads I/O threads per rank, io.uring_depth --uring-depth reads in flight each)

and every byte read is compared with what was written. Per path: node GB/s (all ranks' bytes / time
until the last rank is done), x raw of the same rep, and CPU seconds per GB (every thread of every rank
process). The order of paths rotates per rep; the page cache is dropped before every read (root).

On a disk the ratios say whether the store keeps up with the device; with --dir on memory (tmpfs with
O_DIRECT on Linux >= 6.6, or `scripts/ram_disk.sh`) the raw path is a memory copy and the ratios say how
much of the machine the software itself leaves unused.

    python -m benchmark.hicache.bench_l3_read --dir DIR [--page-sizes 2359296,5750784] [--gib 1]
        [--threads 4,16] [--ranks 1] [--engines python,native,uring] [--uring-threads N] [--uring-depth 64]
        [--reps 3] [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


BATCH = 128  # upstream's storage batch: one read_pages call per batch, as the backend makes them
PAGE_SMALL, PAGE_GLM5 = 32 * 64 * 1152, 78 * 64 * 1152  # 32-layer and GLM-5 (78-layer) MLA pages, bf16


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def buffer(nbytes: int) -> np.ndarray:
    import mmap

    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    a[::4096] = 0  # fault it in now, not inside a timed read
    return a


def rank_main(rank, args, page_bytes, n, threads, paths, root, start, done, out):  # noqa: C901
    from sglang_cp.cachebench.rawdisk import drop_caches
    from sglang_cp.l3 import L3Store, parse_l3_config
    from sglang_cp.l3.format.blob import write_extent

    d = os.path.join(root, f"rank{rank}")
    src = buffer(n * page_bytes)
    src[:] = np.random.default_rng(rank).integers(0, 256, n * page_bytes, dtype=np.uint8)
    dst = buffer(n * page_bytes)
    pages = [src[i * page_bytes:(i + 1) * page_bytes] for i in range(n)]
    outs = [dst[i * page_bytes:(i + 1) * page_bytes] for i in range(n)]
    keys = [b"r%d-p%d" % (rank, i) for i in range(n)]
    slot = write_extent(page_bytes)
    stores = {}
    for engine in ("python", "native", "uring"):
        if engine not in paths:
            continue
        sub = os.path.join(d, engine)
        os.makedirs(os.path.join(sub, "idx"))
        os.makedirs(os.path.join(sub, "disk"))
        io_threads = args.uring_threads or threads if engine == "uring" else threads
        cfg = parse_l3_config({
            "index": {"dir": os.path.join(sub, "idx"), "map_size_gb": 0.064},
            "io": {"threads": io_threads, "max_inflight_pages": max(64, 2 * threads), "read_engine": engine,
                   "uring_depth": args.uring_depth},
            "durability": {"plp_policy": "ignore"},
            "disks": [{"name": "d", "path": os.path.join(sub, "disk"), "capacity_gb": (n + 8) * slot / 0.85 / 1e9}]})
        s = L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": page_bytes}, cold_start="clear")
        for k in range(0, n, BATCH):
            assert all(s.write_pages("kv", keys[k:k + BATCH], pages[k:k + BATCH])), "write failed"
        if s.stats()["read_engine_effective"] != engine:  # the row must measure what it names
            raise SystemExit(f"{engine}: the store reads with {s.stats()['read_engine_effective']!r} here "
                             "(io_uring refused? see its log line)")
        stores[engine] = s
    raw_path = os.path.join(d, "raw.bin")
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, n * page_bytes)
    for i in range(n):
        assert os.pwrite(fd, pages[i], i * page_bytes) == page_bytes
    os.fdatasync(fd)
    pool = ThreadPoolExecutor(threads)

    def raw():
        def one(i):
            assert os.preadv(fd, [outs[i]], i * page_bytes) == page_bytes
        list(pool.map(one, range(n)))

    def ours(s):
        for k in range(0, n, BATCH):
            ok = s.read_pages("kv", keys[k:k + BATCH], outs[k:k + BATCH])
            assert all(ok), "ours: a page was a miss"

    try:
        for rep in range(args.reps):
            order = paths[rep % len(paths):] + paths[:rep % len(paths)]
            for p in order:
                dst[:] = 0
                if rank == 0:
                    dropped = drop_caches()
                start.wait()
                c0, t0 = cpu_s(), time.perf_counter()
                raw() if p == "raw" else ours(stores[p])
                t, c = time.perf_counter() - t0, cpu_s() - c0
                ok = bool(np.array_equal(dst, src))
                out.put((rank, rep, p, t, c, ok, dropped if rank == 0 else None))
                done.wait()
    finally:
        pool.shutdown()
        os.close(fd)
        for s in stores.values():
            s.close()


def run_case(args, page_bytes, threads, root):
    n = max(BATCH, int(args.gib * (1 << 30)) // page_bytes)
    paths = ["raw"] + args.engines
    ctx = mp.get_context("spawn")
    start, done, out = ctx.Barrier(args.ranks), ctx.Barrier(args.ranks), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, page_bytes, n, threads, paths, root, start, done, out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in range(args.ranks * args.reps * len(paths)):
            got.append(out.get(timeout=1800))
    finally:
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
    bad = [g for g in got if not g[5]]
    if bad:
        raise SystemExit(f"bytes read differ from bytes written: {bad[:3]}")
    node_bytes = args.ranks * n * page_bytes
    per = {}
    for rep in range(args.reps):
        for p in paths:
            rows = [g for g in got if g[1] == rep and g[2] == p]
            per.setdefault(p, []).append((max(g[3] for g in rows), sum(g[4] for g in rows)))
    dropped = all(g[6] for g in got if g[6] is not None)
    res = {"page_bytes": page_bytes, "pages_per_rank": n, "threads": threads, "ranks": args.ranks, "paths": {}}
    for p in paths:
        gbps = [node_bytes / t / 1e9 for t, _ in per[p]]
        xraw = [node_bytes / t / (node_bytes / r[0]) for (t, _), r in zip(per[p], per["raw"])]
        res["paths"][p] = {"gbps": gbps, "x_raw": xraw, "cpu_s_per_gb": [c / (node_bytes / 1e9) for _, c in per[p]]}
    res["cache_dropped"] = dropped
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="scratch dir on the device under test (memory: scripts/ram_disk.sh)")
    ap.add_argument("--page-sizes", default=f"{PAGE_SMALL},{PAGE_GLM5}")
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per rank per case (GiB)")
    ap.add_argument("--threads", default="4,16", help="io.threads of the store = raw requests in flight, per rank")
    ap.add_argument("--ranks", type=int, default=1, help="rank processes reading at once (a node's CP ranks)")
    ap.add_argument("--engines", default="python,native", help="python, native, uring: comma separated")
    ap.add_argument("--uring-threads", type=int, default=0,
                    help="io.threads of the uring path (default: --threads): each thread keeps --uring-depth reads "
                         "in flight, so fewer threads than the other paths need")
    ap.add_argument("--uring-depth", type=int, default=64, help="io.uring_depth of the uring path")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="64 MiB per rank, 1 rep, 2 threads: a smoke run")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.page_sizes.split(",")]
        threads = [int(x) for x in args.threads.split(",")]
        if min(sizes) < 1 or min(threads) < 1 or args.ranks < 1 or args.reps < 1:
            raise ValueError
    except ValueError:
        raise SystemExit("--page-sizes, --threads: positive integers, comma separated; --ranks, --reps >= 1")
    args.engines = [e for e in args.engines.split(",") if e]
    if not args.engines or any(e not in ("python", "native", "uring") for e in args.engines):
        raise SystemExit(f"--engines: python, native and/or uring, got {args.engines}")
    if args.uring_threads < 0 or not 2 <= args.uring_depth <= 1024:
        raise SystemExit("--uring-threads: >= 0 (0: --threads); --uring-depth: in [2, 1024]")
    if args.quick:
        args.gib, args.reps, threads = 1 / 16, 1, [2]
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    if not os.path.isdir(args.dir):
        raise SystemExit(f"--dir {args.dir}: not a directory")
    root = tempfile.mkdtemp(prefix="bench-l3-read-", dir=args.dir)
    results = []
    t_start = time.time()
    try:
        for pb, th in tqdm([(pb, th) for pb in sizes for th in threads], desc="cases"):
            case_root = tempfile.mkdtemp(dir=root)
            try:
                results.append(run_case(args, pb, th, case_root))
            finally:
                shutil.rmtree(case_root, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def fmt(xs, p=2):
        return f"{statistics.median(xs):.{p}f} ({min(xs):.{p}f}-{max(xs):.{p}f})"

    table = Table(title=f"L3 reads vs raw O_DIRECT on {args.dir}: {args.ranks} rank(s) at once, {args.gib:g} GiB per "
                        f"rank, median of {args.reps} (min-max); x raw = per rep against raw of the same rep")
    for col in ("page B", "threads/rank", "path", "node GB/s", "x raw", "CPU s/GB", "bytes ok"):
        table.add_column(col, justify="right")
    for r in results:
        for p, v in r["paths"].items():
            th = args.uring_threads or r["threads"] if p == "uring" else r["threads"]
            table.add_row(f"{r['page_bytes']:,}", str(th), p, fmt(v["gbps"]),
                          "1.00" if p == "raw" else fmt(v["x_raw"]), fmt(v["cpu_s_per_gb"], 3), "True")
    console = Console(width=200)
    console.print(table)
    console.print(f"page cache dropped before every read: {all(r['cache_dropped'] for r in results)}; "
                  f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.2f}; "
                  f"wall time {time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
