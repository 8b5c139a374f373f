#!/usr/bin/env python
"""L3 store vs raw O_DIRECT vs upstream HiCacheFile, one run, same disk, same bytes.

For each page size: two real upstream `MLATokenToKVPoolHost` pools (page_first, uint8 rows) are built
on CPU; pool A holds random data, pool B receives every read, and every read is checked byte for byte.

  raw        posix_fallocate'd file, O_DIRECT pwrite of each page from pool A (io.threads in flight,
             the store's parallelism), one fdatasync (timed); cold O_DIRECT preadv into pool B.
  ours       L3Store.submit_write pipeline (to the last DURABLE ack); read_pages in batches of 128 pages.
  ours-sync128    write_pages per 128-page batch, each waiting for DURABLE (durability.backup_ack =
             "durable", the default), the way upstream's storage thread calls batch_set_v1 through our
             backend: with the backend's write bound (WRITE_TIMEOUT_S), so pages are copied into the
             store's staging first and the caller's memory is free when the call returns.
  ours-written128 the same calls under durability.backup_ack = "written": each returns once its pages
             are written; "ack" = the last call returned (what upstream's backup thread waits),
             "durable write" = until every page is durable (index committed).
  hicache    upstream HiCacheFile (`--hicache-storage-backend file`) driven like HiCacheController's
             generic page path: batch_set of 128 `get_data_page` views; syncfs timed separately
             ("write+sync"); reads: batch_get into `get_dummy_flat_data_page` + set_from_flat_data_page.

The page cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`) before every cold read.
Medians of --reps runs with min-max; the order of paths rotates per rep. GB = 1e9 B.
Run: python -m benchmark.hicache.bench_l3_store --dir /path/on/real/disk [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sglang_cp.integration.cp_l3.backend import WRITE_TIMEOUT_S  # (the backend's write bound)
from sglang_cp.cachebench.rawdisk import drop_caches
from sglang_cp.l3 import L3Store, parse_l3_config
from sglang_cp.l3.format.blob import write_extent

BATCH = 128  # upstream STORAGE_BATCH_SIZE
PAGE_TOKENS = 64
console = Console(width=230)
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs")
    finally:
        os.close(fd)


def make_pool(page_bytes: int, n_pages: int):
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    per_token = page_bytes // PAGE_TOKENS
    layers = next(n for n in (80, 64, 32, 16, 8, 4, 2, 1) if per_token % n == 0 and per_token // n >= 64)
    width = per_token // layers
    dev_tokens = PAGE_TOKENS * 2
    bufs = tuple(torch.zeros((dev_tokens, 1, width), dtype=torch.uint8) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=PAGE_TOKENS, kv_lora_rank=width,
        qk_rope_head_dim=0, kv_cache_dim=width, dtype=torch.uint8, device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(
        info, 1.0, 0, PAGE_TOKENS, "page_first", pin_memory=False, device="cpu", override_kv_cache_dim=width,
        device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers, target_layer_num=layers,
        host_token_capacity=n_pages * PAGE_TOKENS)
    assert pool.get_data_page(0).numel() == page_bytes, "host pool page != benchmark page"
    return pool


def page_np(pool, i: int) -> np.ndarray:
    return pool.get_data_page(i * PAGE_TOKENS).numpy()


# ----------------------------------------------------------------------------------------- paths

def run_raw(d, a, b, n, page_bytes, threads, progress):
    path = os.path.join(d, "raw.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, n * page_bytes)
        task = progress.add_task("raw write", total=n)

        def w(i):
            assert os.pwrite(fd, page_np(a, i), i * page_bytes) == page_bytes
            progress.advance(task)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(w, range(n)))
        os.fdatasync(fd)
        tw = time.perf_counter() - t0
        progress.remove_task(task)
        dropped = drop_caches()
        task = progress.add_task("raw read (cold)", total=n)

        def r(i):
            assert os.preadv(fd, [page_np(b, i)], i * page_bytes) == page_bytes
            progress.advance(task)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(r, range(n)))
        tr = time.perf_counter() - t0
        progress.remove_task(task)
    finally:
        os.close(fd)
        os.unlink(path)
    return {"write": tw, "write+sync": tw, "read": tr, "dropped": dropped}


def staging_pages(page_bytes: int) -> int:
    """io.max_inflight_pages for the run: about 256 MiB of staging whatever the page size."""
    return max(BATCH, (256 << 20) // page_bytes)


def run_ours(d, a, b, n, page_bytes, threads, progress, tag, mode):  # noqa: C901
    """mode 'async': every 128-page batch submitted with submit_write, timed until the last DURABLE ack
    (the spill pipeline). mode 'sync128': write_pages per 128-page batch, each waiting for DURABLE (what
    upstream's storage thread does through batch_set_v1). Reads: read_pages per 128-page batch."""
    root = os.path.join(d, "ours")
    os.makedirs(os.path.join(root, "idx"), exist_ok=True)
    os.makedirs(os.path.join(root, "disk"), exist_ok=True)
    slot = write_extent(page_bytes)
    cfg = parse_l3_config({
        "index": {"dir": os.path.join(root, "idx"), "map_size_gb": 0.064},
        "io": {"threads": threads, "max_inflight_pages": staging_pages(page_bytes)},
        "durability": {"plp_policy": "ignore", "backup_ack": "written" if mode == "written128" else "durable"},
        "disks": [{"name": "d", "path": os.path.join(root, "disk"), "capacity_gb": (n + 8) * slot / 0.85 / 1e9}],
    })
    keys = [f"{tag}-{i}".encode() for i in range(n)]
    store = L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": page_bytes}, cold_start="clear")
    try:
        task = progress.add_task(f"ours write ({mode}, to DURABLE)", total=n)
        t0 = time.perf_counter()
        t_ack = None
        if mode in ("sync128", "written128"):
            for s in range(0, n, BATCH):
                ok = store.write_pages("kv", keys[s:s + BATCH], [page_np(a, i) for i in range(s, min(n, s + BATCH))],
                                       timeout=WRITE_TIMEOUT_S)
                assert all(ok), "ours: write failed"
                progress.advance(task, len(ok))
            t_ack = time.perf_counter() - t0
            while store.stats()["occupancy"]["kv"]["durable"] < n:  # "written": the last group commit
                time.sleep(0.0005)
        else:
            durable = 0

            def drain():
                nonlocal durable
                for ack in store.drain_acks():
                    if ack.kind.value == "durable":
                        assert ack.ok, "ours: write failed"
                        durable += 1
                        progress.advance(task)
            for s in range(0, n, BATCH):
                store.submit_write("kv", keys[s:s + BATCH], [page_np(a, i) for i in range(s, min(n, s + BATCH))])
                drain()
            while durable < n:
                time.sleep(0.0005)
                drain()
        tw = time.perf_counter() - t0
        progress.remove_task(task)
        dropped = drop_caches()
        task = progress.add_task("ours read (cold)", total=n)
        t0 = time.perf_counter()
        for s in range(0, n, BATCH):
            ok = store.read_pages("kv", keys[s:s + BATCH], [page_np(b, i) for i in range(s, min(n, s + BATCH))])
            assert all(ok), "ours: read miss"
            progress.advance(task, len(ok))
        tr = time.perf_counter() - t0
        progress.remove_task(task)
    finally:
        store.close()
        shutil.rmtree(root)
    return {"write": t_ack or tw, "write+sync": tw, "read": tr, "dropped": dropped}


def run_hicache(d, a, b, n, page_bytes, progress, tag):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    root = os.path.join(d, "hicache")
    os.makedirs(root, exist_ok=True)
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="bench", extra_config={"file_storage_path": root})
    backend = StorageBackendFactory.create_backend("file", cfg, a)
    keys = [f"{tag}-{i}" for i in range(n)]
    try:
        task = progress.add_task("HiCacheFile batch_set", total=n)
        t0 = time.perf_counter()
        for s in range(0, n, BATCH):
            idx = range(s, min(n, s + BATCH))
            ok = backend.batch_set(keys[s:s + BATCH], [a.get_data_page(i * PAGE_TOKENS) for i in idx])
            assert ok, "HiCacheFile batch_set failed"
            progress.advance(task, len(idx))
        tw = time.perf_counter() - t0
        syncfs(root)
        tws = time.perf_counter() - t0
        progress.remove_task(task)
        dropped = drop_caches()
        task = progress.add_task("HiCacheFile batch_get (cold)", total=n)
        t0 = time.perf_counter()
        for s in range(0, n, BATCH):
            idx = list(range(s, min(n, s + BATCH)))
            dst = [b.get_dummy_flat_data_page() for _ in idx]
            got = backend.batch_get(keys[s:s + BATCH], dst)
            for j, i in enumerate(idx):
                assert got[j] is not None, "HiCacheFile miss"
                b.set_from_flat_data_page(i * PAGE_TOKENS, got[j])
            progress.advance(task, len(idx))
        tr = time.perf_counter() - t0
        progress.remove_task(task)
    finally:
        shutil.rmtree(root)
    return {"write": tw, "write+sync": tws, "read": tr, "dropped": dropped}


def bench_exists(d, n_keys=2048, runs=51):
    root = os.path.join(d, "exists")
    for sub in ("idx", "disk"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    cfg = parse_l3_config({"index": {"dir": os.path.join(root, "idx")}, "durability": {"plp_policy": "ignore"},
                           "disks": [{"name": "d", "path": os.path.join(root, "disk"), "capacity_gb": 0.05}]})
    store = L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": 4096, "ix": 4096}, cold_start="clear")
    try:
        keys = [b"prefix-%d" % i for i in range(n_keys)]
        page = bytes(4096)
        for s in range(0, n_keys, 256):
            assert all(store.write_pages("kv", keys[s:s + 256], [page] * len(keys[s:s + 256])))
            assert all(store.write_pages("ix", keys[s:s + 256], [page] * len(keys[s:s + 256])))
        lat, lat_multi = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            assert store.exists_prefix("kv", keys) == n_keys
            lat.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert store.exists_prefix_multi(["kv", "ix"], keys) == n_keys
            lat_multi.append(time.perf_counter() - t0)
    finally:
        store.close()
        shutil.rmtree(root)
    return statistics.median(lat), statistics.median(lat_multi)


# ----------------------------------------------------------------------------------------- main

def result_table(rows, args, what: str):
    table = Table(title=f"L3 store vs raw O_DIRECT vs HiCacheFile, {what}: GB/s (1e9 B), median of {args.reps} "
                        f"(min-max), {args.gib:g} GiB per case, {args.threads} I/O threads")
    for col in ("page B", "pages", "path", "write (no sync) / ack", "durable write", "cold read", "W/raw", "W/raw paired",
                "R/raw", "R/raw paired", "W/hicache", "R/hicache", "bytes ok", "cache dropped"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*r)
    return table


def fmt(vals):
    m = statistics.median(vals)
    return f"{m:.2f} ({min(vals):.2f}-{max(vals):.2f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="scratch dir on the disk under test (not tmpfs); default: "
                    "a temp dir under the current directory")
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per case (GiB)")
    ap.add_argument("--page-sizes", default="3276800,65536,1048576")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="io.threads of the store = raw parallelism")
    ap.add_argument("--no-hicache", action="store_true")
    ap.add_argument("--quick", action="store_true", help="0.125 GiB per case, reps 3: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.gib = min(args.gib, 0.125)
    base = args.dir or os.getcwd()
    os.makedirs(base, exist_ok=True)
    d = tempfile.mkdtemp(prefix="bench-l3-", dir=base)
    t_start = time.time()
    rows = []
    ack_ratios = []
    try:
        import torch  # noqa: F401  (imported here so --help stays fast)
        console.print(f"dir={d} gib={args.gib} reps={args.reps} threads={args.threads} batch={BATCH}")
        for page_bytes in [int(x) for x in args.page_sizes.split(",")]:
            n = max(BATCH, int(args.gib * 2**30) // page_bytes)
            t0 = time.time()
            a, b = make_pool(page_bytes, n), make_pool(page_bytes, n)
            a.kv_buffer.view(-1).copy_(torch.randint(0, 256, (a.kv_buffer.numel(),), dtype=torch.uint8))
            console.print(f"page {page_bytes} B: {n} pages, pools built + filled in {time.time() - t0:.1f} s")
            res = {"raw": [], "ours": [], "ours-sync128": [], "ours-written128": [], "hicache": []}
            paths = ["raw", "ours", "ours-sync128", "ours-written128"] + ([] if args.no_hicache else ["hicache"])
            with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TimeElapsedColumn(), console=console, transient=True) as progress:
                for rep in range(args.reps):
                    order = paths[rep % len(paths):] + paths[:rep % len(paths)]
                    for p in order:
                        b.kv_buffer.zero_()
                        # Settle: flush what the previous path left (its deleted files' discards ride the
                        # next journal commit, which the next path's first fdatasync would otherwise pay).
                        os.sync()
                        tag = f"{page_bytes}-{rep}-{time.time_ns()}"
                        if p == "raw":
                            r = run_raw(d, a, b, n, page_bytes, args.threads, progress)
                        elif p == "ours":
                            r = run_ours(d, a, b, n, page_bytes, args.threads, progress, tag, "async")
                        elif p in ("ours-sync128", "ours-written128"):
                            r = run_ours(d, a, b, n, page_bytes, args.threads, progress, tag, p[5:])
                        else:
                            r = run_hicache(d, a, b, n, page_bytes, progress, tag)
                        r["ok"] = bool(torch.equal(a.kv_buffer, b.kv_buffer))
                        res[p].append(r)
            total = n * page_bytes / 1e9
            gbps = {p: {k: [total / r[k] for r in res[p]] for k in ("write", "write+sync", "read")} for p in paths}
            med = {p: {k: statistics.median(v) for k, v in gbps[p].items()} for p in paths}
            for p in paths:
                # Ratios of medians, and the median of per-rep ratios against the raw run of the same rep
                # (paired: both measured minutes apart at most, which cancels the disk's drift).
                ratios = [f"{med[p]['write+sync'] / med['raw']['write+sync']:.2f}",
                          f"{statistics.median(x / y for x, y in zip(gbps[p]['write+sync'], gbps['raw']['write+sync'])):.2f}",
                          f"{med[p]['read'] / med['raw']['read']:.2f}",
                          f"{statistics.median(x / y for x, y in zip(gbps[p]['read'], gbps['raw']['read'])):.2f}"]
                if "hicache" in med:
                    ratios += [f"{med[p]['write+sync'] / med['hicache']['write+sync']:.2f}",
                               f"{med[p]['read'] / med['hicache']['read']:.2f}"]
                else:
                    ratios += ["-", "-"]
                rows.append([f"{page_bytes:,}", f"{n}", p,
                             fmt(gbps[p]["write"]) if p in ("hicache", "ours-sync128", "ours-written128") else "-",
                             fmt(gbps[p]["write+sync"]), fmt(gbps[p]["read"]), *ratios,
                             str(all(r["ok"] for r in res[p])), str(all(r["dropped"] for r in res[p]))])
            for p in ("ours-sync128", "ours-written128"):
                ack_ratios.append((f"{p} {page_bytes:,} B", f"{statistics.median(x / y for x, y in zip(gbps[p]['write'], gbps['raw']['write+sync'])):.2f}"))
            # This page size's rows now: a later size that fails (e.g. host memory) must not lose them.
            console.print(result_table(rows[-len(paths):], args, f"page {page_bytes:,} B"))
            # The pools (and HiCacheFile's reference cycle to pool A) must be gone before the next size's
            # pools pass upstream's host-memory check.
            del a, b
            gc.collect()
        ex, ex_multi = bench_exists(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)

    console.print(result_table(rows, args, "all page sizes"))
    console.print("ours = submit_write pipeline timed to the last DURABLE ack; ours-sync128 = write_pages per 128-page "
                  "batch (each waits for DURABLE, like upstream's storage thread); both read with read_pages per 128 "
                  "pages. io.max_inflight_pages = max(128, 256 MiB / page).")
    console.print("durable write: raw = O_DIRECT + fdatasync; ours = to DURABLE ack (data, fdatasync, LMDB commit); "
                  "hicache = batch_set + syncfs. W ratios use durable write. 'ack' column: ours-sync128/-written128 = "
                  "until the last write_pages call returned (what upstream's backup thread waits); hicache = batch_set "
                  "without sync.")
    console.print("W/ack ratios (ack time vs raw durable write, median of per-rep pairs): " + ", ".join(
        f"{p}: {v}" for p, v in ack_ratios))
    try:
        thp = escape(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip())  # '[madvise]' is markup
    except OSError:
        thp = "unknown"
    console.print(f"ours' staging arena asks for transparent huge pages (THP mode here: {thp}); raw, ours-sync128 "
                  "and hicache read from the upstream host pool's own memory. Before every path: os.sync() (settle).")
    console.print(f"exists_prefix(2048 keys): median {ex * 1e3:.3f} ms; exists_prefix_multi(2 payloads, 2048 keys): "
                  f"median {ex_multi * 1e3:.3f} ms")
    console.print("W/raw, R/raw: ratio of medians; 'paired': median over reps of (path / raw of the same rep).")
    console.print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (the disk and CPUs "
                  "are shared with other jobs)")
    console.print(f"benchmark wall time: {time.time() - t_start:.1f} s")


if __name__ == "__main__":
    main()
