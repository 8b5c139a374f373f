"""Upstream's HiCache storage path, side by side: upstream's `file` backend vs our L3,
without CP and under CP=2/4 with KV sharding.

Every configuration runs the same workload through the same upstream code: real gloo
rank processes, each with a real ``MLATokenToKVPoolHost`` in GLM-5's MLA row shape and
upstream's ``HybridCacheController`` (backup thread -> backend; prefetch thread -> hit
query -> gloo MIN -> transfer -> completion MIN). Per rank it measures:

- backup: ``write_storage`` until the controller acks (for `file`, plus ``syncfs`` so the
  bytes are as durable as ours, which acks only after fdatasync + index commit);
- prefetch: ``prefetch`` until the completion ack, page cache dropped before (cold);

and prints GB/s per rank and end-to-end times as a table. `file` cannot run under CP
sharding (upstream refuses it), so its rows are CP=1.

    python benchmark/hicache/bench_cp_l3.py [--pages 64] [--layers 78] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "test", "integration"))

from cp_harness import PAGE, Rank, run_ranks  # noqa: E402


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def bench_rank(rank, world, port, l3_config, backend, file_dir, sharded, n_pages, layers, cold_start):
    from cp_scenarios import tokens_for

    r = Rank(rank, world, port, l3_config, sharded=sharded, layers=layers, host_pages=n_pages + 8,
             backend=backend, file_dir=file_dir, cold_start=cold_start)
    try:
        tokens = tokens_for(n_pages, seed=42)
        hi = r.alloc_host(n_pages * PAGE, start_owner=0)
        r.fill(hi, n_pages)
        owned = sum(1 for i in range(n_pages) if r.owner_of_page_start(int(hi[i * PAGE])) == rank) \
            if sharded else n_pages
        r.dist.barrier()
        t0 = time.perf_counter()
        backed = r.backup(tokens, hi, timeout=600)
        t_ack = time.perf_counter() - t0
        if backend == "file":
            fd = os.open(file_dir, os.O_RDONLY)
            try:
                os.syncfs(fd) if hasattr(os, "syncfs") else os.sync()
            finally:
                os.close(fd)
        t_write = time.perf_counter() - t0
        r.group.free(hi)
        r.zero_host()
        r.dist.barrier()
        if rank == 0:
            dropped = drop_caches()
        else:
            dropped = None
        r.dist.barrier()
        t1 = time.perf_counter()
        hit, completed, hi2 = r.prefetch(tokens, timeout=600)
        t_read = time.perf_counter() - t1
        checked, equal = r.check(hi2, completed // PAGE) if hi2 is not None else (0, 0)
        return {"rank": rank, "owned_pages": owned, "page_bytes": r.page_nbytes, "backed": backed,
                "t_ack": t_ack, "t_write": t_write, "t_read": t_read, "hit": hit, "completed": completed,
                "checked": checked, "equal": equal, "dropped": dropped}
    finally:
        r.close()


def run_config(name, backend, world, sharded, args, workdir):
    from sglang_cp.cli import write_demo_config

    results = []
    for rep in range(args.reps):
        root = tempfile.mkdtemp(dir=workdir, prefix=f"{name}-{rep}-")
        # Room for the workload (slabs are preallocated to the capacity).
        need_gb = round(2.5 * args.pages * args.layers * PAGE * 1152 / 1e9 + 0.5, 2)
        cfg = write_demo_config(os.path.join(root, "l3"), capacity_gb=need_gb)
        file_dir = os.path.join(root, "file")
        os.makedirs(file_dir, exist_ok=True)
        res = run_ranks(world, bench_rank, (cfg, backend, file_dir, sharded, args.pages, args.layers, "clear"),
                        timeout=1200)
        for r in res:
            if r["equal"] != r["checked"] or r["completed"] != args.pages * PAGE:
                raise SystemExit(f"{name}: data check failed on rank {r['rank']}: {r}")
        results.append(res)
        shutil.rmtree(root, ignore_errors=True)
    return results


def summarize(name, results):
    def med(xs):
        return statistics.median(xs), min(xs), max(xs)

    per_rank_bytes = [max(r["owned_pages"] * r["page_bytes"] for r in rep) for rep in results]
    w = [max(r["t_write"] for r in rep) for rep in results]  # all ranks done = end to end
    rd = [max(r["t_read"] for r in rep) for rep in results]
    wgb = [b / t / 1e9 for b, t in zip(per_rank_bytes, w)]
    rgb = [b / t / 1e9 for b, t in zip(per_rank_bytes, rd)]
    return {"name": name, "write_s": med(w), "read_s": med(rd), "write_gbps_rank": med(wgb),
            "read_gbps_rank": med(rgb), "bytes_rank": per_rank_bytes[0],
            "dropped": all(r["dropped"] for rep in results for r in rep if r["dropped"] is not None)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=64, help="64-token pages in the workload")
    p.add_argument("--layers", type=int, default=78, help="MLA layers (GLM-5: 78)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="16 pages x 8 layers, 1 rep (smoke)")
    p.add_argument("--dir", default="/var/tmp", help="scratch dir on the disk under test")
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args()
    if args.quick:
        args.pages, args.layers, args.reps = 16, 8, 1
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    configs = [("upstream file, CP=1", "file", 1, False), ("ours, CP=1", "cp_l3", 1, False),
               ("ours, CP=2 sharded", "cp_l3", 2, True), ("ours, CP=4 sharded", "cp_l3", 4, True)]
    workdir = tempfile.mkdtemp(dir=args.dir, prefix="bench-cp-l3-")
    summaries = []
    try:
        for name, backend, world, sharded in tqdm(configs, desc="configs"):
            summaries.append(summarize(name, run_config(name, backend, world, sharded, args, workdir)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = summaries[0]
    table = Table(title=f"HiCache storage path, {args.pages} pages x {args.layers} layers "
                        f"({args.pages * args.layers * PAGE * 1152 / 1e9:.2f} GB logical), median of "
                        f"{args.reps} (min-max); write = durable (file: + syncfs); read = cold prefetch")
    for col in ("config", "bytes/rank", "write GB/s/rank", "read GB/s/rank", "backup s (e2e)",
                "prefetch s (e2e)", "write x file", "read x file"):
        table.add_column(col, justify="right")

    def fmt(t):
        return f"{t[0]:.2f} ({t[1]:.2f}-{t[2]:.2f})"
    for s in summaries:
        table.add_row(s["name"], f"{s['bytes_rank'] / 1e9:.2f} GB", fmt(s["write_gbps_rank"]),
                      fmt(s["read_gbps_rank"]), fmt(s["write_s"]), fmt(s["read_s"]),
                      f"{base['write_s'][0] / s['write_s'][0]:.2f}x",
                      f"{base['read_s'][0] / s['read_s'][0]:.2f}x")
    Console(width=200).print(table)
    print("page cache dropped before every cold read:", all(s["dropped"] for s in summaries))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=2)


if __name__ == "__main__":
    main()
