"""Upstream's HiCache storage path, side by side: upstream's `file` backend vs our L3,
without CP and under CP=2/4 (``--cp``, e.g. 1,4,8: 8 = a whole node) with KV sharding.

Every configuration runs the same workload through the same upstream code: real gloo
rank processes, each with a real ``MLATokenToKVPoolHost`` in GLM-5's MLA row shape and
upstream's ``HybridCacheController`` (backup thread -> backend; prefetch thread -> hit
query -> gloo MIN -> transfer -> completion MIN). Per rank it measures:

- backup: ``write_storage`` until the controller acks (for `file`, plus ``syncfs`` so the
  bytes are as durable as ours, which acks only after fdatasync + index commit);
- prefetch: ``prefetch`` until the completion ack, cold (pages not read since they were written;
  for `file`, which reads through the page cache, the cache is dropped before; raw rows and ours use
  O_DIRECT), after a restore of a small prompt of its own (other pages) has warmed the rank's code;

and prints GB/s per rank and end-to-end times as a table. `file` cannot run under CP
sharding (upstream refuses it), so its rows are CP=1.

Raw rows, same run, same disk: N writers (one per rank, ``io.threads`` requests in flight
each, like the store) O_DIRECT-pwrite the bytes each rank owns in pages of the same size,
fdatasync, then read them back cold with preadv. Every 'x raw' column divides by the raw row
of the same CP size: the node's total (all ranks' bytes / time until the last rank is done)
against the disk's own in that run.

``--disks DIR0,DIR1``: also run CP=2 with ``rank_to_disk`` mapping rank i to DIR i (two
devices: each rank's slab and I/O on its own filesystem; the index stays under --dir), with
its own raw row over the same two directories, and print each CP=2 rank against the raw writer
on its own device. Two directories on one filesystem are refused; two on one disk underneath
(loop images on it) run with a warning, since they cannot show scaling.

``--read-engine python|native|uring|both|all``: io.read_engine of our rows (one row per engine; both =
python,native, all = the three; a comma-separated list works too). Every row also
reports CPU seconds per GB (all threads of all the node's processes but ``--busy-scheduler``'s thread:
what a rank's restore costs in cores, so what it can reach on a host with more cores than this one).

``--scheduler-steps 2,8``: the scheduler thread instead runs a server's steps (2 ms of bytecode, then 8 ms
with the GIL released, as the forward's synchronisation releases it); each row gives the steps' p50 / p99
wall ms alone, through the backup and through the prefetch: what the storage work in the serving process
adds to every step of every request being served, for ours and for upstream's ``file`` alike.

``--busy-scheduler``: a Python thread per rank runs without pause through the timed backup (to the ack)
and the timed prefetch, as a GPU server's scheduler thread does beside them; each row then gives the
scheduler seconds lost per GB moved (its time beside the operation times the share of its idle rate it
lost). ``--gil-switch-interval-ms 0,0.5``: our rows once per value of the store's
``io.gil_switch_interval_ms`` (0: the interpreter's own 5 ms), which bounds each GIL hand-off between the
busy thread and the restore's threads.

The software's ceiling: point ``--dir`` at a device faster than the software, i.e. memory. On Linux >= 6.6
tmpfs accepts O_DIRECT (``/dev/shm``); on older kernels use ext4 on a loop file in /dev/shm
(``scripts/ram_disk.sh`` sets up either and prints the directory). The raw rows then measure memory
copies, and "x raw" says how much of the machine the software leaves on the table.

    python -m benchmark.hicache.bench_cp_l3 [--pages 64[,512]] [--layers 78] [--reps 3] [--quick] [--disks A,B]
        [--cp 1,2,4[,8]] [--read-engine python|native|uring|both|all] [--backup-ack durable|written|operation|both|LIST]
        [--zero-copy off|on|both] [--phases] [--no-file] [--busy-scheduler | --scheduler-steps 2,8]
        [--gil-switch-interval-ms 0,0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

if not __package__:  # run as a file: the repository root is not on sys.path, so benchmark.* is not importable
    sys.exit("bench_cp_l3: run it from the repository root as a module: python -m benchmark.hicache.bench_cp_l3")

from benchmark.hicache import pyspy_profile  # noqa: E402  (--profile)
from benchmark.support.busy_thread import BusyScheduler, scheduler_steps, switch_interval_list  # noqa: E402
from benchmark.support.cp_harness import GLM5_KV_LORA, GLM5_ROPE, PAGE, Rank, run_ranks, tokens_for  # noqa: E402

from sglang_cp.cachebench.rawdisk import drop_caches  # noqa: E402
from sglang_cp.l3.config import BACKUP_ACKS  # noqa: E402


class PhaseProbes:
    """``--phases``: timestamps (CLOCK_MONOTONIC, comparable across the rank processes) of every step
    a backup takes through our backend, recorded by wrapping the objects of this rank's store in
    place; the store's code is unchanged. Events: (phase, start, end) relative to the backup's t0."""

    def __init__(self, r):
        self.events = []
        store = r.backend.store
        ev = self.events

        def timed(obj, attr, phase):
            fn = getattr(obj, attr)

            def wrapper(*a, **kw):
                t = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    ev.append((phase, t, time.perf_counter()))
            setattr(obj, attr, wrapper)
        self._read_probes(r, timed)
        timed(r.backend, "_set", "backend_set")
        timed(store, "start_write_pages", "submit")          # durable-page check + staging copy + hand-over
        for pool in store.state.pools.values():
            timed(pool.slab, "write_slots", "pwrite")  # a failed run's retry, page by page
            timed(pool.slab, "write_slot", "pwrite")
            timed(pool.slab, "write_runs", "pwrite")  # an I/O task: a group of runs (one run without the library)
            timed(pool.slab, "sync", "fdatasync")
            timed(pool, "seal_image", "crc_seal")
            timed(pool, "seal_zero_copy", "crc_seal")
        timed(store.state.index, "commit", "index_commit")     # LMDB writer-lock wait + txn + its flushes
        index = store.state.index

        class TimedEnv:  # the LMDB writer lock is taken in begin(write=True)
            def __init__(self, env):
                self._env = env

            def begin(self, write=False, **kw):
                t = time.perf_counter()
                txn = self._env.begin(write=write, **kw)
                if write:
                    ev.append(("lmdb_lock_wait", t, time.perf_counter()))
                return txn

            def __getattr__(self, name):
                return getattr(self._env, name)
        if not isinstance(index.env, TimedEnv):
            index.env = TimedEnv(index.env)

    @staticmethod
    def _read_probes(r, timed):
        """The prefetch's steps, upstream's and ours: the page hashes (upstream hashes every page of the
        request on every rank), our hit query, every gloo MIN (the hit count and phase vector after the
        query, the prefetch's one completed count on the sync thread), the host-pool allocation, our
        restore of the whole prefetch (every payload's reads started at once, then waited for) and,
        inside it, the store's reads from start to finish."""
        from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as hcc

        timed(hcc, "get_storage_hash_str", "hash")  # a module function: _storage_hit_query looks it up there
        timed(r.backend, "batch_exists_v2", "hit_query")
        timed(r.backend, "batch_exists", "hit_query")
        timed(r.cc, "_all_reduce", "gloo_min")
        timed(r.cc, "allocate_storage_hit", "allocate")
        timed(r.backend, "start_restore", "reads_started")
        timed(r.backend, "finish_restore", "restore_wait")
        timed(r.backend.store, "finish_read_pages", "store_read")

    def report(self, t0, t_ack, end="upstream_ack"):
        """Per phase: first start, last end (s after t0), busy sum and count; ``end``: the step that closes
        the timed operation (the backup's ack, or the prefetch's last ack), at ``t_ack``."""
        out = {}
        for phase, a, b in self.events:
            d = out.setdefault(phase, {"first": a - t0, "last": b - t0, "sum": 0.0, "n": 0})
            d["first"] = min(d["first"], a - t0)
            d["last"] = max(d["last"], b - t0)
            d["sum"] += b - a
            d["n"] += 1
        out[end] = {"first": t_ack, "last": t_ack, "sum": 0.0, "n": 1}
        self.events.clear()
        return out


def bench_rank(rank, world, rendezvous, l3_config, backend, file_dir, sharded, n_pages, layers, cold_start,
               phases=False, profile=None, busy=None):
    import contextlib

    # Under sharding a rank's host (and device) pool holds its own stripe; logical capacity is x world.
    host_pages = (-(-n_pages // world) if sharded else n_pages) + 8
    r = Rank(rank, world, rendezvous, l3_config, sharded=sharded, layers=layers, host_pages=host_pages,
             backend=backend, file_dir=file_dir, cold_start=cold_start)
    probes = PhaseProbes(r) if phases and backend == "cp_l3" else None
    try:
        # A small prompt of its own, backed up now and restored just before the timed read: each rank is a
        # fresh process, and its first prefetch would otherwise pay first-call costs a serving process has
        # long paid (upstream's first host-pool allocation and hash, torch's first ops on its index tensors).
        # The timed read stays cold: its pages are other pages.
        warm_pages = 2 * world
        warm_tokens = tokens_for(warm_pages, seed=4242)
        whi = r.alloc_host(warm_pages * PAGE, start_owner=0)
        r.fill(whi, warm_pages, salt=1)
        r.backup(warm_tokens, whi, timeout=600)
        r.group.free(whi)
        if probes is not None:
            probes.events.clear()
        zero_copy_0 = r.backend.store.stats()["counters"]["zero_copy_pages"] if backend == "cp_l3" else 0
        tokens = tokens_for(n_pages, seed=42)
        hi = r.alloc_host(n_pages * PAGE, start_owner=0)
        r.fill(hi, n_pages)
        owned = sum(1 for i in range(n_pages) if r.owner_of_page_start(int(hi[i * PAGE])) == rank) \
            if sharded else n_pages
        # The page hashes come from the radix tree (computed at insert), not from the backup path; the
        # first hash in a process also loads upstream's hash extension (~0.1-0.2 s once), which the
        # timed backup must not include.
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        idle_turns = None
        step = busy if isinstance(busy, tuple) else None  # --scheduler-steps: (work s, wait s)
        idle_steps = None
        if busy:  # the busy thread's rate with nothing beside it: what the rates under load compare with
            with BusyScheduler(step) as idle:
                time.sleep(1.0 if step else 0.5)
            idle_turns, idle_steps = idle.turns_per_s, idle.step_quantiles()
        r.dist.barrier()
        c0 = cpu_s()
        # --busy-scheduler: the scheduler thread also runs through the backup (a serving process backs up
        # while it schedules), until the controller's ack; file's later syncfs is not the server's work
        with BusyScheduler(step) if busy else contextlib.nullcontext() as busy_write:
            t0 = time.perf_counter()
            backed = r.backup(tokens, hi, timeout=600, hashes=hashes)
            t_ack = time.perf_counter() - t0
        if backend == "file":
            fd = os.open(file_dir, os.O_RDONLY)
            try:
                os.syncfs(fd) if hasattr(os, "syncfs") else os.sync()
            finally:
                os.close(fd)
        t_write = time.perf_counter() - t0
        cpu_write = cpu_s() - c0 - (busy_write.cpu_s if busy_write is not None else 0.0)
        phase_report = probes.report(t0, t_ack) if probes is not None else None
        r.group.free(hi)
        r.zero_host()
        r.dist.barrier()
        # Only upstream's file backend reads through the page cache. Raw rows and ours read with O_DIRECT,
        # past it; dropping it before them evicted only the code pages a fresh rank had not run yet (the
        # prefetch path's first torch ops re-faulted from disk: 20-40 ms inside the timed read, dev VM),
        # which a serving process mapped long before a restore.
        dropped = drop_caches() if rank == 0 and backend == "file" else None
        # --profile: py-spy attaches to this rank (every thread: upstream's and ours) before the clock starts
        recording = contextlib.nullcontext()
        if profile and backend == "cp_l3":
            # CPU samples only, at 199 Hz: on a host with few cores py-spy would otherwise take the cores
            # the read needs (docs_internal/figures.md, "Upstream's storage path")
            recording = pyspy_profile.Recorder(os.getpid(), f"{profile}-rank{rank}.txt", rate=199, idle=False)
        _hit, _done, whi = r.prefetch(warm_tokens, rid="warm-up", timeout=600)
        if whi is not None:
            r.group.free(whi)
        counters = (lambda: r.backend.store.stats()["counters"]) if backend == "cp_l3" else (lambda: {})
        if probes is not None:
            probes.events.clear()
        with recording:
            r.dist.barrier()
            k0 = counters()
            c1 = cpu_s()
            with BusyScheduler(step) if busy else contextlib.nullcontext() as busy_thread:
                switch_s = sys.getswitchinterval()  # as the store's io.gil_switch_interval_ms left it
                t1 = time.perf_counter()
                hit, completed, hi2 = r.prefetch(tokens, timeout=600)
                t_read = time.perf_counter() - t1
            cpu_read = cpu_s() - c1 - (busy_thread.cpu_s if busy_thread is not None else 0.0)
            k1 = counters()
        read_phase_report = probes.report(t1, t_read, end="prefetch_done") if probes is not None else None
        # the store's own share of the prefetch: wall time inside its page reads and its hit queries
        store_read_s = (k1.get("read_ns", 0) - k0.get("read_ns", 0)) / 1e9
        store_hitq_s = (k1.get("hit_query_ns", 0) - k0.get("hit_query_ns", 0)) / 1e9
        checked, equal = r.check(hi2, completed // PAGE) if hi2 is not None else (0, 0)
        zero_copy_pages = (r.backend.store.stats()["counters"]["zero_copy_pages"] - zero_copy_0
                           if backend == "cp_l3" else 0)
        engine = r.backend.store.stats()["read_engine_effective"] if backend == "cp_l3" else None
        return {"rank": rank, "zero_copy_pages": zero_copy_pages, "owned_pages": owned, "page_bytes": r.page_nbytes,
                "read_engine": engine, "switch_interval_ms": switch_s * 1e3,
                # what the busy thread (the scheduler) still got done per second through the prefetch,
                # through the backup, and alone
                "busy_turns_per_s": busy_thread.turns_per_s if busy_thread is not None else None,
                "busy_write_turns_per_s": busy_write.turns_per_s if busy_write is not None else None,
                "busy_idle_turns_per_s": idle_turns,
                # --scheduler-steps: (p50, p99) of the steps' wall ms alone, through the backup, the prefetch
                "steps_ms": ({"idle": idle_steps, "write": busy_write.step_quantiles(),
                              "read": busy_thread.step_quantiles()} if step else None),
                # ... and the ms its steps took beyond their median alone, summed over the backup / prefetch
                "steps_excess_ms": ({op: sum(max(0.0, x - idle_steps[0]) for x in b.steps_ms)
                                     for op, b in (("write", busy_write), ("read", busy_thread))}
                                    if step and idle_steps else None),
                "backed": backed,
                "t_ack": t_ack, "t_write": t_write, "t_read": t_read, "cpu_write": cpu_write, "cpu_read": cpu_read,
                "store_read_s": store_read_s, "store_hitq_s": store_hitq_s,
                "hit": hit, "completed": completed,
                "checked": checked, "equal": equal, "dropped": dropped, "phases": phase_report,
                "read_phases": read_phase_report}
    finally:
        r.close()


def cpu_s() -> float:
    """CPU seconds of this whole process (every thread: upstream's controller threads and the store's)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def page_nbytes(layers: int) -> int:
    return PAGE * (GLM5_KV_LORA + GLM5_ROPE) * 2 * layers  # bf16 MLA rows, page_first: one page = all layers


def aligned_pages(nbytes: int):
    """Page-aligned anonymous memory, faulted in (first touch is not part of a timed read)."""
    import mmap

    import numpy as np

    a = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
    a[::4096] = 0
    return a


def open_raw(path: str, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def run_raw(world, dirs, args, pages):
    """`world` writers on `dirs` (writer i on dirs[i % len]): times of the slowest, per rep."""
    import numpy as np

    nbytes = page_nbytes(args.layers)
    n_pages = -(-pages // world)  # pages each rank owns (sharded) or all of them (world 1)
    # Writers write from, and readers land in, memory as large as a rank's host pool share, as the ranks
    # do: one reused page would stay in the CPU cache, which on a RAM-speed --dir makes raw a cache copy.
    src = aligned_pages(n_pages * nbytes)
    src[:nbytes] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    for p in range(1, n_pages):
        src[p * nbytes:(p + 1) * nbytes] = src[:nbytes]
    dst_bufs = [aligned_pages(n_pages * nbytes) for _ in range(world)]
    out = []
    for rep in range(args.reps):
        fds = [open_raw(os.path.join(dirs[i % len(dirs)], f"raw-{i}.bin"), n_pages * nbytes) for i in range(world)]
        try:
            os.sync()

            def writer(i):
                with ThreadPoolExecutor(args.threads) as ex:
                    list(ex.map(lambda p: os.pwrite(fds[i], src[p * nbytes:(p + 1) * nbytes], p * nbytes),
                                range(n_pages)))
                os.fdatasync(fds[i])
                return time.perf_counter()  # this writer's own end: the per-rank raw figure (--disks)

            def reader(i):
                def one(p):
                    assert os.preadv(fds[i], [dst_bufs[i][p * nbytes:(p + 1) * nbytes]], p * nbytes) == nbytes
                with ThreadPoolExecutor(args.threads) as ex:
                    list(ex.map(one, range(n_pages)))
                return time.perf_counter()
            c0, t0 = cpu_s(), time.perf_counter()
            with ThreadPoolExecutor(world) as ex:
                tw = [t - t0 for t in ex.map(writer, range(world))]
            cw = cpu_s() - c0
            dropped = None  # O_DIRECT reads: the page cache is not on their path (bench_rank)
            c0, t0 = cpu_s(), time.perf_counter()
            with ThreadPoolExecutor(world) as ex:
                tr = [t - t0 for t in ex.map(reader, range(world))]
            cr = cpu_s() - c0
        finally:
            for i, fd in enumerate(fds):
                os.close(fd)
                os.unlink(os.path.join(dirs[i % len(dirs)], f"raw-{i}.bin"))
        # One process ran every writer: its CPU time is the node's, reported on writer 0.
        out.append([{"rank": i, "owned_pages": n_pages, "page_bytes": nbytes, "t_write": tw[i], "t_read": tr[i],
                     "cpu_write": cw if i == 0 else 0.0, "cpu_read": cr if i == 0 else 0.0,
                     "dropped": dropped if i == 0 else None} for i in range(world)])
    return out


TWO_DISK_CONFIG = """\
[index]
dir = "{root}/index"
map_size_gb = 0.25

[durability]
plp_policy = "ignore"

[[disks]]
name = "d0"
path = "{d0}"
capacity_gb = {capacity_gb}

[[disks]]
name = "d1"
path = "{d1}"
capacity_gb = {capacity_gb}

[rank_to_disk]
"0" = "d0"
"1" = "d1"
"""


def _insert_before(cfg, table, before, after):
    """Rewrite the demo config: `before` goes in front of its first `table` line, `after` right under it."""
    with open(cfg) as f:
        text = f.read()
    assert table in text and (not before or before.splitlines()[0] not in text), cfg  # a table is written once
    with open(cfg, "w") as f:
        f.write(text.replace(table, before + table + after, 1))


def run_config(name, backend, world, sharded, args, workdir, pages, disks=None, ack="durable", zero_copy=False,
               engine="python", switch_ms=0.0):
    from sglang_cp.cli import write_demo_config

    results = []
    for rep in range(args.reps):
        root = tempfile.mkdtemp(dir=workdir, prefix=f"{name.replace(' ', '_').replace(',', '')}-{rep}-")
        # Room for the workload (slabs are preallocated to the capacity).
        need_gb = round(2.5 * pages * args.layers * PAGE * 1152 / 1e9 + 0.5, 2)
        if disks:
            subs = [tempfile.mkdtemp(dir=x, prefix="bench-cp-l3-") for x in disks]
            os.makedirs(os.path.join(root, "l3", "index"))
            cfg = os.path.join(root, "l3", "l3.toml")
            with open(cfg, "w") as f:
                f.write(TWO_DISK_CONFIG.format(root=os.path.join(root, "l3"), d0=subs[0], d1=subs[1],
                                               capacity_gb=round(need_gb / 2 + 0.1, 2)))
        else:
            subs = []
            cfg = write_demo_config(os.path.join(root, "l3"), capacity_gb=need_gb)
        if ack != "durable":  # durability.backup_ack (docs_internal/l3_write_ack.md)
            _insert_before(cfg, "[durability]\n", "", f'backup_ack = "{ack}"\n')
        # io.threads = the raw rows' requests in flight per writer (--threads), so each ratio compares the
        # same concurrency; io.zero_copy_writes (docs_internal/l3_store.md, "Zero-copy writes under a timeout").
        io = (f"[io]\nthreads = {args.threads}\n" + ("zero_copy_writes = true\n" if zero_copy else "")
              + f'read_engine = "{engine}"\n' + (f"gil_switch_interval_ms = {switch_ms}\n" if switch_ms else ""))
        _insert_before(cfg, "[[disks]]\n", io + "\n", "")
        file_dir = os.path.join(root, "file")
        os.makedirs(file_dir, exist_ok=True)
        profile = None
        if args.profile:
            slug = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
            profile = os.path.join(os.path.abspath(args.profile), f"profile-{slug}-{pages}p-rep{rep}")
        busy = args.scheduler_steps or ("spin" if args.busy_scheduler else None)
        res = run_ranks(world, bench_rank, (cfg, backend, file_dir, sharded, pages, args.layers, "clear",
                                            args.phases, profile, busy), timeout=1200)
        if profile:
            print(f"{name}, rep {rep}, rank 0's cold read under py-spy ({profile}-rank0.txt):\n"
                  + pyspy_profile.format_summary(pyspy_profile.summarize(f"{profile}-rank0.txt")))
        for r in res:
            if r["equal"] != r["checked"] or r["completed"] != pages * PAGE:
                raise SystemExit(f"{name}: data check failed on rank {r['rank']}: {r}")
            if zero_copy and r["zero_copy_pages"] != r["owned_pages"]:  # the row must measure what it names
                raise SystemExit(f"{name}: rank {r['rank']} wrote {r['zero_copy_pages']} of {r['owned_pages']} "
                                 "pages zero-copy (host pool pages not 4 KiB-aligned?)")
            if backend == "cp_l3" and r["read_engine"] != engine:  # e.g. io_uring refused here: uring -> native
                raise SystemExit(f"{name}: rank {r['rank']} read with io.read_engine {r['read_engine']!r}, not "
                                 f"{engine!r} (see the store's log line at open)")
        results.append(res)
        shutil.rmtree(root, ignore_errors=True)
        for x in subs:
            shutil.rmtree(x, ignore_errors=True)
    return results


def summarize(name, results):
    def med(xs):
        return statistics.median(xs), min(xs), max(xs)

    def rk(i, t):
        return [(r["owned_pages"] * r["page_bytes"], r[t]) for rep in results for r in rep if r["rank"] == i]

    per_rank_bytes = [max(r["owned_pages"] * r["page_bytes"] for r in rep) for rep in results]
    w = [max(r["t_write"] for r in rep) for rep in results]  # all ranks done = end to end
    rd = [max(r["t_read"] for r in rep) for rep in results]
    wgb = [b / t / 1e9 for b, t in zip(per_rank_bytes, w)]
    rgb = [b / t / 1e9 for b, t in zip(per_rank_bytes, rd)]
    node_bytes = [sum(r["owned_pages"] * r["page_bytes"] for r in rep) for rep in results]
    drops = [r["dropped"] for rep in results for r in rep if r["dropped"] is not None]
    out = {"name": name, "write_s": med(w), "read_s": med(rd), "write_gbps_rank": med(wgb),
           "read_gbps_rank": med(rgb), "bytes_rank": per_rank_bytes[0], "world": len(results[0]),
           "node_write_gbps": med([b / t / 1e9 for b, t in zip(node_bytes, w)]),
           "node_read_gbps": med([b / t / 1e9 for b, t in zip(node_bytes, rd)]),
           # None: an O_DIRECT row (no page cache on its path); else whether every drop before it succeeded
           "dropped": all(drops) if drops else None,
           # the rank processes' CPython switch interval through the timed prefetch
           "switch_interval_ms": sorted({round(r["switch_interval_ms"], 6) for rep in results for r in rep
                                         if "switch_interval_ms" in r}),
           "busy_turns_per_s": (med([r["busy_turns_per_s"] for rep in results for r in rep])
                                if any(r.get("busy_turns_per_s") for rep in results for r in rep) else None),
           # the scheduler's seconds lost per GB the rank moved: its time beside the backup (to the ack) or the
           # prefetch, times the share of its idle rate it lost there (GIL hand-offs and, on a host with few
           # cores, the cores the I/O threads take)
           **{f"sched_lost_s_per_gb_{op}": (
               med([r[t] * max(0.0, 1 - r[k] / r["busy_idle_turns_per_s"]) / (r["owned_pages"] * r["page_bytes"] / 1e9)
                    for rep in results for r in rep])
               if all(r.get(k) and r.get("busy_idle_turns_per_s") for rep in results for r in rep) else None)
              for op, k, t in (("write", "busy_write_turns_per_s", "t_ack"), ("read", "busy_turns_per_s", "t_read"))},
           # --scheduler-steps: median over ranks and reps of each phase's (p50, p99) step wall ms
           "steps_ms": ({ph: tuple(statistics.median(r["steps_ms"][ph][k] for rep in results for r in rep)
                                   for k in (0, 1))
                         for ph in ("idle", "write", "read")}
                        if all(r.get("steps_ms") and all(r["steps_ms"].values()) for rep in results for r in rep)
                        else None),
           # ... and the step time beyond the median alone, per GB the rank moved: what the operation cost the
           # requests being served, whatever its length
           **{f"steps_excess_ms_per_gb_{op}": (
               med([r["steps_excess_ms"][op] / (r["owned_pages"] * r["page_bytes"] / 1e9) for rep in results for r in rep])
               if all(r.get("steps_excess_ms") for rep in results for r in rep) else None)
              for op in ("write", "read")},
           # CPU seconds of every process of the node (ranks, or the raw process) per GB moved
           "read_cpu_s_per_gb": med([sum(r["cpu_read"] for r in rep) / (b / 1e9) for rep, b in zip(results, node_bytes)]),
           "write_cpu_s_per_gb": med([sum(r["cpu_write"] for r in rep) / (b / 1e9)
                                      for rep, b in zip(results, node_bytes)])}
    # Per rank (each rank's own bytes / its own time): the --disks table sets these against the raw
    # writer on the same device.
    out["per_rank"] = [{"rank": i, "write_gbps": med([b / t / 1e9 for b, t in rk(i, "t_write")]),
                        "read_gbps": med([b / t / 1e9 for b, t in rk(i, "t_read")])}
                       for i in range(len(results[0]))]
    if any(r.get("store_read_s") for rep in results for r in rep):
        # per rep, the slowest rank: its bytes over its time inside the store's reads, and the part of its
        # prefetch spent outside the store's reads and hit queries (upstream's threads, the gloo MINs)
        out["store_read_gbps_rank"] = med([min(r["owned_pages"] * r["page_bytes"] / r["store_read_s"] / 1e9
                                               for r in rep if r["store_read_s"] > 0) for rep in results])
        out["outside_store_s"] = med([max(r["t_read"] - r["store_read_s"] - r["store_hitq_s"] for r in rep)
                                      for rep in results])
        # The node's prefetch ends with its last rank; the ranks' own "outside" above also holds their waits
        # for slower peers (every batch ends in a MIN over all ranks). The node's own overhead: the node time
        # less the longest time any rank spent inside the store.
        out["outside_store_node_s"] = med([max(r["t_read"] for r in rep)
                                           - max(r["store_read_s"] + r["store_hitq_s"] for r in rep)
                                           for rep in results])
    for key in ("phases", "read_phases"):
        reports = [r[key] for rep in results for r in rep if r.get(key)]
        if reports:  # per phase: medians over every (rep, rank) of first start, last end, busy sum, count
            out[key] = {ph: {k: statistics.median(rp[ph][k] if ph in rp else 0.0 for rp in reports)
                             for k in ("first", "last", "sum", "n")}
                        for ph in dict.fromkeys(ph for rp in reports for ph in rp)}
    return out


PHASE_ORDER = ("backend_set", "submit", "crc_seal", "pwrite", "fdatasync", "lmdb_lock_wait",
               "index_commit", "upstream_ack")
READ_PHASE_ORDER = ("hash", "hit_query", "gloo_min", "allocate", "reads_started", "restore_wait", "store_read",
                    "prefetch_done")


def print_phases(console, summaries):
    from rich.table import Table

    for key, order, what, end in (("phases", PHASE_ORDER, "backup", "upstream_ack"),
                                  ("read_phases", READ_PHASE_ORDER, "cold prefetch", "prefetch_done")):
        rows = [s for s in summaries if s.get(key)]
        if not rows:
            continue
        t = Table(title=f"Where each rank's {what} time goes (--phases): ms after the {what} started; median "
                        "over ranks and reps of first start / last end / busy sum (all threads) / calls")
        t.add_column("config")
        for ph in order:
            t.add_column(ph, justify="right")
        for s in rows:
            cells = []
            for ph in order:
                d = s[key].get(ph)
                if d is None:
                    cells.append("-")
                elif ph == end:
                    cells.append(f"{d['last'] * 1e3:.1f}")
                else:
                    cells.append(f"{d['first'] * 1e3:.1f}/{d['last'] * 1e3:.1f}/{d['sum'] * 1e3:.1f}/{d['n']:g}")
            t.add_row(f"{s['name']}, {s['pages']} pages", *cells)
        console.print(t)


def check_disks(disks):
    """--disks must be two devices. One filesystem (same st_dev) is refused; one disk underneath (loop
    images on it, a single-member LVM volume) runs with a loud warning: ranks on it share its bandwidth,
    so no per-rank scaling can show. Returns (device name per dir, why they share one or None)."""
    from sglang_cp.l3.devices import disk_chain, shared_device

    st = [os.stat(x).st_dev for x in disks]
    why = shared_device(*disks)
    if st[0] == st[1]:
        raise SystemExit(f"--disks: {disks[0]} and {disks[1]} are on {why or 'one filesystem'}; pass directories "
                         "on two devices (two mounts), or drop --disks")
    names = [" -> ".join(disk_chain(x)) or f"dev {os.major(d)}:{os.minor(d)}" for x, d in zip(disks, st)]
    if why:
        print(f"\n{'!' * 100}\nWARNING --disks: {disks[0]} and {disks[1]} are on {why}. The two 'disks' share "
              f"one device, so the 2-disk rows cannot show per-rank scaling with disks.\n{'!' * 100}\n",
              file=sys.stderr, flush=True)
    return names, why


def print_per_rank(console, group, pages, devices, shared):
    """--disks: every CP=2 row of ours, rank by rank, against the raw writer on that rank's device in this
    run (the raw row with as many writers on the same directories: writer i runs where rank i does)."""
    from rich.table import Table

    raw = {s["disks"]: s for s in group if s["name"].startswith("raw") and s["world"] == 2}
    ours = [s for s in group if s["name"].startswith("ours") and s["world"] == 2]
    one = {s["backup_ack"]: s for s in ours if s["disks"] == 1}
    t = Table(title=f"Per rank, {pages} pages, CP=2 sharded: each rank's GB/s (its bytes / its own time), median "
                    "(min-max), against the raw writer on its own device in this run (2 writers at once, writer i "
                    "where rank i is); 'x one disk' = the same rank in the one-disk row"
                    + (f". WARNING: the two --disks are on {shared}: no scaling can show" if shared else ""))
    for col in ("config", "rank", "device", "write GB/s", "raw write GB/s", "W x raw", "read GB/s",
                "raw read GB/s", "R x raw", "W x one disk", "R x one disk"):
        t.add_column(col, justify="right")

    def fmt(v):
        return f"{v[0]:.2f} ({v[1]:.2f}-{v[2]:.2f})"
    for s in ours:
        r, base = raw.get(s["disks"]), one.get(s["backup_ack"]) if s["disks"] == 2 else None
        for i, pr in enumerate(s["per_rank"]):
            rr = r["per_rank"][i] if r else None
            b = base["per_rank"][i] if base else None
            t.add_row(s["name"], str(i), devices[s["disks"]][i], fmt(pr["write_gbps"]),
                      fmt(rr["write_gbps"]) if rr else "-",
                      f"{pr['write_gbps'][0] / rr['write_gbps'][0]:.2f}x" if rr else "-",
                      fmt(pr["read_gbps"]), fmt(rr["read_gbps"]) if rr else "-",
                      f"{pr['read_gbps'][0] / rr['read_gbps'][0]:.2f}x" if rr else "-",
                      f"{pr['write_gbps'][0] / b['write_gbps'][0]:.2f}x" if b else "-",
                      f"{pr['read_gbps'][0] / b['read_gbps'][0]:.2f}x" if b else "-")
    console.print(t)


def _row_line(s: dict, summaries: list) -> str:
    """One finished row in one line, against the raw row of the same writers and disks measured before it."""
    raw = next((r for r in reversed(summaries) if r["name"].startswith("raw") and r["world"] == s["world"]
                and r["disks"] == s["disks"] and r["pages"] == s["pages"]), None)
    w, r = s["node_write_gbps"][0], s["node_read_gbps"][0]
    vs = (f" ({w / raw['node_write_gbps'][0]:.2f}x / {r / raw['node_read_gbps'][0]:.2f}x raw)"
          if raw is not None and raw is not s else "")
    return (f"row done: {s['name']}, {s['pages']} pages: node write {w:.2f} GB/s, node read {r:.2f} GB/s{vs}; "
            f"CPU s/GB {s['write_cpu_s_per_gb'][0]:.3f} / {s['read_cpu_s_per_gb'][0]:.3f}"
            + (f"; inside the store's reads {s['store_read_gbps_rank'][0]:.2f} GB/s per rank, prefetch outside them "
               f"{s['outside_store_s'][0] * 1e3:.1f} ms (the node: "
               f"{s['outside_store_node_s'][0] * 1e3:.1f} ms past its longest store time)"
               if s.get("store_read_gbps_rank") else "")
            + (f"; the busy thread ran {s['busy_turns_per_s'][0] / 1e3:.0f}K turns/s through the prefetch"
               if s.get("busy_turns_per_s") and not s.get("steps_ms") else "")
            + (f"; scheduler seconds lost per GB: backup {s['sched_lost_s_per_gb_write'][0]:.3f}, prefetch "
               f"{s['sched_lost_s_per_gb_read'][0]:.3f}" if s.get("sched_lost_s_per_gb_write") else "")
            + ("; scheduler step p50/p99 ms: " + ", ".join(
                f"{ph} {s['steps_ms'][k][0]:.1f}/{s['steps_ms'][k][1]:.1f}"
                for ph, k in (("alone", "idle"), ("backup", "write"), ("prefetch", "read")))
               + f"; step ms beyond alone per GB: backup {s['steps_excess_ms_per_gb_write'][0]:.1f}, prefetch "
                 f"{s['steps_excess_ms_per_gb_read'][0]:.1f}"
               if s.get("steps_ms") else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", default="64", help="64-token pages in the workload; a comma list runs each size "
                                                 "(e.g. 64,512: 512 pages = one 32K-token prompt)")
    p.add_argument("--layers", type=int, default=78, help="MLA layers (GLM-5: 78)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="16 pages x 8 layers, 1 rep (smoke)")
    p.add_argument("--dir", default="/var/tmp", help="scratch dir on the disk under test")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--threads", type=int, default=4, help="requests in flight per writer: the raw rows' threads and our rows' io.threads")
    p.add_argument("--disks", default=None, help="DIR0,DIR1 on two devices: add CP=2 rows with rank_to_disk")
    p.add_argument("--configs", default=None,
                   help="';'-separated subset of row names (default: all; the file row runs unless --no-file)")
    p.add_argument("--no-file", action="store_true",
                   help="skip upstream's file row (its 'x file' columns print '-'): for runs that compare our "
                        "modes against raw only, where the file row's minutes are not wanted")
    p.add_argument("--backup-ack", default="durable",
                   help="durability.backup_ack of our rows: durable, written, operation, or a comma-separated list "
                        "(one row per value after each config); 'both' = durable,written")
    p.add_argument("--zero-copy", default="off", choices=("off", "on", "both"),
                   help="io.zero_copy_writes of our rows; 'both' adds a 'zero-copy' row after each copying one")
    p.add_argument("--cp", default="1,2,4",
                   help="CP sizes, comma separated: each N runs 'raw O_DIRECT, N writers' and 'ours, CP=N sharded' "
                        "(N=1: '1 writer' and 'ours, CP=1'); 8 = a node of eight ranks")
    p.add_argument("--read-engine", default="python",
                   help="io.read_engine of our rows: python, native, uring, both (python,native), all, or a "
                        "comma-separated list (one row per engine)")
    p.add_argument("--profile", metavar="DIR",
                   help="record each rank's cold read of our rows under py-spy into DIR and print rank 0's "
                        "time per thread role (a profile run: py-spy's sampling costs CPU; pip install py-spy)")
    p.add_argument("--phases", action="store_true",
                   help="record per-phase timestamps of each rank's backup and cold prefetch in our rows and print "
                        "where the time goes")
    p.add_argument("--busy-scheduler", action="store_true",
                   help="a Python thread per rank runs without pause during the timed prefetch, as a GPU server's "
                        "scheduler loop does while a request waits (its CPU counts in the read CPU columns)")
    p.add_argument("--scheduler-steps", type=scheduler_steps, metavar="WORK_MS,WAIT_MS",
                   help="instead of --busy-scheduler's thread that never pauses, a serving scheduler's steps: "
                        "WORK_MS of bytecode, then WAIT_MS with the GIL released (the forward), e.g. 2,8; each row "
                        "gives the steps' p50/p99 wall ms alone, through the backup and through the prefetch")
    p.add_argument("--gil-switch-interval-ms", type=switch_interval_list, default=[0.0], metavar="MS[,MS...]",
                   help="io.gil_switch_interval_ms of our rows, one row per value (0: the interpreter's own, 5 ms)")
    args = p.parse_args()
    switches = args.gil_switch_interval_ms
    if args.profile:
        pyspy_profile.pyspy_binary()
        os.makedirs(args.profile, mode=0o700, exist_ok=True)
    try:
        sizes = [int(x) for x in str(args.pages).split(",")]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--pages: pass page counts >= 1, comma separated (e.g. 64,512), got {args.pages!r}")
    if args.quick:
        sizes, args.layers, args.reps = [16], 8, 1
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    try:
        cps = [int(x) for x in args.cp.split(",")]
        if not cps or min(cps) < 1 or max(cps) > 64:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--cp: pass CP sizes in [1, 64], comma separated (e.g. 1,4,8), got {args.cp!r}")
    engines = {"both": ["python", "native"], "all": ["python", "native", "uring"]}.get(
        args.read_engine, args.read_engine.split(","))
    if any(e not in ("python", "native", "uring") for e in engines):
        p.error(f"--read-engine: pass python, native, uring, both, all or a list, got {args.read_engine!r}")
    configs = [("upstream file, CP=1", "file", 1, False, None)] if 1 in cps else []
    for n in cps:
        configs += ([("raw O_DIRECT, 1 writer", "raw", 1, False, None), ("ours, CP=1", "cp_l3", 1, False, None)]
                    if n == 1 else [(f"raw O_DIRECT, {n} writers", "raw", n, True, None),
                                    (f"ours, CP={n} sharded", "cp_l3", n, True, None)])
    disks = args.disks.split(",") if args.disks else None
    if disks:
        if len(disks) != 2 or not all(os.path.isdir(x) for x in disks):
            raise SystemExit("--disks: pass two existing directories, DIR0,DIR1, on two devices")
        disk_names, shared = check_disks(disks)
        configs += [("raw O_DIRECT, 2 writers, 2 disks", "raw", 2, True, disks),
                    ("ours, CP=2 sharded, 2 disks", "cp_l3", 2, True, disks)]
    if args.configs:
        keep = set(args.configs.split(";"))
        configs = [c for c in configs if c[0] in keep or c[0].startswith("upstream")]
    if args.no_file:
        configs = [c for c in configs if c[1] != "file"]
    acks = ["durable", "written"] if args.backup_ack == "both" else args.backup_ack.split(",")
    bad = [a for a in acks if a not in BACKUP_ACKS]
    if bad:
        p.error(f"--backup-ack: {', '.join(bad)} is not one of {', '.join(BACKUP_ACKS)} (or 'both')")
    zcs = {"off": [False], "on": [True], "both": [False, True]}[args.zero_copy]
    rows = []
    for name, backend, world, sharded, dk in configs:
        if backend != "cp_l3":
            rows.append((name, backend, world, sharded, dk, "durable", False, "python", 0.0))
            continue
        for ack in acks:
            for zc in zcs:
                for engine in engines:
                    for sw in switches:
                        label = (name + (f", ack {ack}" if ack != "durable" else "") + (", zero-copy" if zc else "")
                                 + (f", {engine} reads" if engine != "python" else "")
                                 + (f", switch {sw:g} ms" if sw else ""))
                        rows.append((label, backend, world, sharded, dk, ack, zc, engine, sw))
    os.makedirs(args.dir, mode=0o700, exist_ok=True)  # a scratch directory named on the command line
    workdir = tempfile.mkdtemp(dir=args.dir, prefix="bench-cp-l3-")
    summaries = []
    try:
        for pages in sizes:
            for name, backend, world, sharded, dk, ack, zc, engine, sw in tqdm(rows, desc=f"configs, {pages} pages"):
                if backend == "raw":
                    s = summarize(name, run_raw(world, dk or [workdir], args, pages))
                else:
                    s = summarize(name, run_config(name, backend, world, sharded, args, workdir, pages, dk, ack,
                                                   zc, engine, sw))
                s.update(disks=len(dk) if dk else 1, pages=pages, backup_ack=ack, zero_copy=zc, read_engine=engine,
                         gil_switch_interval_ms=sw or None, busy_scheduler=bool(args.busy_scheduler and backend != "raw"),
                         scheduler_steps_ms=([x * 1e3 for x in args.scheduler_steps]
                                             if args.scheduler_steps and backend != "raw" else None))
                summaries.append(s)
                # each row as it lands (and the JSON so far): a run cut by a bound keeps what it measured
                tqdm.write(_row_line(s, summaries))
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(summaries, f, indent=2)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def fmt(t):
        return f"{t[0]:.2f} ({t[1]:.2f}-{t[2]:.2f})"
    console = Console(width=280)
    for pages in sizes:
        group = [s for s in summaries if s["pages"] == pages]
        base = next((s for s in group if s["name"].startswith("upstream")), None)
        raw = {(s["world"], s["disks"]): s for s in group if s["name"].startswith("raw")}
        table = Table(title=f"HiCache storage path, {pages} pages x {args.layers} layers "
                            f"({pages * args.layers * PAGE * 1152 / 1e9:.2f} GB logical), median of "
                            f"{args.reps} (min-max); write = until upstream's backup ack (durable, file: + syncfs; "
                            "'ack written': pages in their slots, commit pending; 'ack operation': the operation's ack after all its "
                            "pages are durable, its batches staged without waiting); read = cold prefetch")
        for col in ("config", "bytes/rank", "write GB/s/rank", "read GB/s/rank", "backup s (e2e)",
                    "prefetch s (e2e)", "node write GB/s", "node read GB/s", "node W x raw", "node R x raw",
                    "write x file", "read x file", "write CPU s/GB", "read CPU s/GB"):
            table.add_column(col, justify="right")
        for s in group:
            r = raw.get((s["world"], s["disks"]))
            vs_raw = (f"{s['node_write_gbps'][0] / r['node_write_gbps'][0]:.2f}x",
                      f"{s['node_read_gbps'][0] / r['node_read_gbps'][0]:.2f}x") if r else ("-", "-")
            table.add_row(s["name"], f"{s['bytes_rank'] / 1e9:.2f} GB", fmt(s["write_gbps_rank"]),
                          fmt(s["read_gbps_rank"]), fmt(s["write_s"]), fmt(s["read_s"]),
                          fmt(s["node_write_gbps"]), fmt(s["node_read_gbps"]), *vs_raw,
                          *((f"{base['write_s'][0] / s['write_s'][0]:.2f}x",
                             f"{base['read_s'][0] / s['read_s'][0]:.2f}x") if base else ("-", "-")),
                          f"{s['write_cpu_s_per_gb'][0]:.3f}", f"{s['read_cpu_s_per_gb'][0]:.3f}")
        console.print(table)
        if disks:
            from sglang_cp.l3.devices import disk_chain

            one = " -> ".join(disk_chain(args.dir)) or args.dir
            print_per_rank(console, group, pages, {1: [one, one], 2: disk_names}, shared)
    print_phases(console, summaries)
    buffered = [s["dropped"] for s in summaries if s["dropped"] is not None]
    print("page cache dropped before every buffered cold read (upstream's file rows):",
          all(buffered) if buffered else "no such rows", "| raw rows and ours read with O_DIRECT, past it")
    print("node = all ranks' bytes / time until the last rank is done; 'x raw' = against the raw row with as many "
          "writers on the same disk(s) in this run; file and CP=1 ours compare with the 1-writer raw row. CPU s/GB: CPU "
          "seconds of every process of the node (rank processes, or the one raw process) per GB moved, median.")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=2)


if __name__ == "__main__":
    main()
