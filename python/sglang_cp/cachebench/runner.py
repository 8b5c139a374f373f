"""``sglang-cp cachebench``: phases, rank processes, progress bars, results.

Phases (same workload, same L3 directory):
  warm-up   the first fifth of the request stream, caches empty;
  pressure  the rest of the stream: the working set is several times the host pool (L2),
            so prefixes are evicted from L2 and come back from L3 or are recomputed;
  reload    the whole stream again in the same processes;
  restart   every rank process exits; new ones start with ``--cp-l3-cold-start load``
            (L2 empty) and replay the whole stream once more.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

from rich.markup import escape

from sglang_cp.cachebench.cp_testbed import PAGE, RANK_START, RankDied, run_ranks
from sglang_cp.display import rel
from sglang_cp.l3 import load_l3_config
from sglang_cp.l3.format.blob import ALIGN
from sglang_cp.l3.reads import READ_IO_BYTES
from sglang_cp.l3.recovery import COLD_START_MODES, DEFAULT_COLD_START

from . import rawdisk, report, soak
from .rank_program import run_phases
from .workload import TraceError, WorkloadSpec, generate, read_trace, unique_pages


KV_ROW_BYTES = (512 + 64) * 2  # GLM-5 MLA latent + rope, bf16, per token per layer
INDEXER_ROW_BYTES, DRAFT_ROW_BYTES = 132, 656

QUICK = dict(system_prompts=2, system_tokens=512, documents=12, doc_tokens_min=512, doc_tokens_max=1536,
             sessions=16, turns=3, turn_tokens=256, layers=8)
# The default run has GLM-5's 78 layers (6.45 MB logical pages with the testbed's BF16 rows and the
# sidecars; GLM-5's own FP8 page is 3.3 MB): at 8-16 layers (0.7-1.4 MB) each prefetch moves so few
# bytes that upstream's per-request fixed costs (the hit query's gloo MIN, thread hand-offs) dominate
# and "L3 read x raw" measures them, not the storage path (profile: docs_internal/cachebench.md).
# The token workload is --quick's shape, so the working set stays ~2.4 GB. `make demo` runs this profile.
DEFAULT = dict(system_prompts=2, system_tokens=512, documents=12, doc_tokens_min=512, doc_tokens_max=1536,
               sessions=16, turns=3, turn_tokens=256, layers=78)
_SPEC_FIELDS = ("system_prompts", "system_tokens", "documents", "doc_tokens_min", "doc_tokens_max",
                "sessions", "turns", "turn_tokens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp-size", type=int, default=2, help="CP ranks (processes joined by gloo); >1 shards KV")
    p.add_argument("--quick", action="store_true", help="smaller workload (about a minute on 2 cores)")
    p.add_argument("--out-dir", default="out/cachebench", help="results, plot, and the L3 directory")
    p.add_argument("--trace", default=None, help="replay this JSONL trace instead of the synthetic workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of document popularity")
    for f in _SPEC_FIELDS:
        p.add_argument("--" + f.replace("_", "-"), type=int, default=None,
                       help=f"default {DEFAULT[f]} ({QUICK[f]} with --quick)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"MLA layers per page (GLM-5 has 78; default {DEFAULT['layers']}, {QUICK['layers']} quick)")
    p.add_argument("--l2-pages", type=int, default=None,
                   help="host pool (L2) capacity in 64-token pages; default a quarter of the working set")
    p.add_argument("--no-sidecars", action="store_true",
                   help="target KV only (default: with the DSA indexer-K and MTP draft KV payloads)")
    p.add_argument("--raw-mb", type=int, default=None, help="size of the raw O_DIRECT probe (MB)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds before ranks count as hung")
    p.add_argument("--cp-l3-config", default=None, metavar="PATH",
                   help="replay against this existing L3 config and its directories; nothing is deleted "
                        "(default: a fresh L3 directory under --out-dir, deleted and recreated each run)")
    p.add_argument("--cp-l3-cold-start", choices=COLD_START_MODES, default=DEFAULT_COLD_START,
                   help="what the first rank processes do with pages already on disk: 'clear' (default) starts "
                        "empty; 'load' / 'verify' replay against them (without --cp-l3-config: the L3 directory "
                        "an earlier run left under --out-dir, kept as it is). The restart phase always uses 'load'")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                   help="soak: serve the stream for MINUTES (0: one SIGKILL and one restart) with L3 capacity below "
                        "the working set, graceful rank restarts and SIGKILLed ranks, checking the invariants "
                        "after every epoch (--quick sizes unless given; soak.json)")
    p.add_argument("--soak-capacity", type=float, default=0.5, metavar="FRACTION",
                   help="soak: L3 capacity as a fraction of the working set (GC pressure below 1)")
    p.add_argument("--soak-epoch-s", type=float, default=30.0, metavar="SECONDS",
                   help="soak: serving time per epoch after the first, from the measured request rate")
    p.add_argument("--prefetch-threshold", type=int, default=256,
                   help="replay the scheduler's prefetch_threshold in tokens (upstream default 256; 0 = off): "
                        "shorter misses issue no L3 lookup, shorter agreed hits are revoked")


def _page_bytes(layers: int, sidecars: bool) -> int:
    b = PAGE * KV_ROW_BYTES * layers
    if sidecars:
        b += PAGE * INDEXER_ROW_BYTES * layers + PAGE * DRAFT_ROW_BYTES
    return b


def _existing_l3_config(ns) -> str:
    """(config path, first disk's directory) to replay against without deleting anything (--cp-l3-config,
    or a non-clear cold start on the directory an earlier run left under --out-dir); ValueError names the
    flag and the fix."""
    from sglang_cp.l3 import L3ConfigError, load_l3_config

    path = ns.cp_l3_config or os.path.join(ns.out_dir, "l3", "l3.toml")
    if not ns.cp_l3_config and not os.path.isfile(path):
        raise ValueError(f"--cp-l3-cold-start {ns.cp_l3_cold_start}: no L3 directory from an earlier run at "
                         f"{rel(os.path.dirname(path))}; run once with the default 'clear', or pass --cp-l3-config")
    try:
        cfg = load_l3_config(path)
    except L3ConfigError as e:
        raise ValueError(f"--cp-l3-config {path}: {e}") from None
    return os.path.abspath(path), cfg.disks[0].path


def _l3_config(root: str, need_bytes: int, capacity_gb: float | None = None) -> str:
    from sglang_cp.demo_config import write_demo_config

    shutil.rmtree(root, ignore_errors=True)
    # Room for the working set below GC's watermark (the soak: its own, smaller capacity); slabs are
    # preallocated to this size.
    cap = round(2 * need_bytes / 1e9 + 0.2, 2) if capacity_gb is None else capacity_gb
    return write_demo_config(root, capacity_gb=cap, writer="`sglang-cp cachebench` for its L3 directory "
                             "(deleted and recreated by each run without --cp-l3-config)")


def run(ns) -> int:
    from rich.console import Console

    console = Console()
    sizes = QUICK if ns.quick or ns.soak is not None else DEFAULT
    try:
        if ns.soak is not None and (ns.soak < 0 or not 0 < ns.soak_capacity or ns.soak_epoch_s <= 0):
            raise ValueError("--soak MINUTES must be >= 0, --soak-capacity > 0 and --soak-epoch-s > 0")
        if ns.soak is not None and (ns.cp_l3_config is not None or ns.cp_l3_cold_start != "clear"):
            raise ValueError("--soak starts from a fresh L3 directory of its own; drop --cp-l3-config and "
                             "--cp-l3-cold-start")
        if ns.cp_size < 1:
            raise ValueError(f"--cp-size: must be >= 1, got {ns.cp_size}")
        if ns.prefetch_threshold < 0:
            raise ValueError(f"--prefetch-threshold: must be >= 0 tokens (0 = off), got {ns.prefetch_threshold}")
        layers = ns.layers or sizes["layers"]
        if layers < 1:
            raise ValueError(f"--layers: must be >= 1, got {layers}")
        if ns.trace:
            requests = read_trace(ns.trace)
        else:
            spec = WorkloadSpec(seed=ns.seed, zipf_s=ns.zipf_s, **{
                f: getattr(ns, f) if getattr(ns, f) is not None else sizes[f] for f in _SPEC_FIELDS})
            requests = generate(spec)
        max_req = max(len(r.tokens(PAGE)) // PAGE for r in requests)
        if max_req == 0:
            raise ValueError("workload: every request is shorter than one 64-token page; nothing to cache")
        working = unique_pages(requests, PAGE)
        l2_pages = ns.l2_pages if ns.l2_pages is not None else max(max_req + 1, working // 4)
        if l2_pages < max_req:
            raise ValueError(f"--l2-pages: {l2_pages} cannot hold the longest request ({max_req} pages); "
                             f"use at least {max_req}")
        reuse = ns.cp_l3_config is not None or ns.cp_l3_cold_start != "clear"
        cfg, disk_dir = _existing_l3_config(ns) if reuse else (None, None)
    except (TraceError, ValueError) as e:
        console.print(f"[bold red]cachebench: {e}[/]", soft_wrap=True)
        return 2
    sidecars = not ns.no_sidecars
    page_bytes = _page_bytes(layers, sidecars)
    os.makedirs(ns.out_dir, exist_ok=True)
    if cfg is None:
        need = working * (page_bytes + 3 * ALIGN)
        cap = None if ns.soak is None else soak.soak_capacity_gb(need, ns.soak_capacity,
                                                                  2 * max_req * (page_bytes + 3 * ALIGN))
        cfg = _l3_config(os.path.join(os.path.abspath(ns.out_dir), "l3"), need, cap)
        disk_dir = os.path.dirname(cfg)
    host_pages = l2_pages + max_req + 1

    split = max(1, len(requests) // 5)
    phases = [("warm-up", requests[:split]), ("pressure", requests[split:]), ("reload", requests)]
    info = {"cp_size": ns.cp_size, "sharded": ns.cp_size > 1, "layers": layers, "sidecars": sidecars,
            "requests": len(requests), "working_set_pages": working, "l2_pages": l2_pages,
            "logical_page_bytes": page_bytes, "max_request_pages": max_req, "l3_config": cfg,
            "trace": ns.trace, "quick": ns.quick, "prefetch_threshold": ns.prefetch_threshold,
            "cold_start": ns.cp_l3_cold_start, "l3_reused": reuse}
    console.print(f"cachebench: {ns.cp_size} rank(s){' sharded' if ns.cp_size > 1 else ''}, {len(requests)} "
                  f"requests, working set {working} pages ({working * page_bytes / 1e9:.2f} GB), "
                  f"L2 {l2_pages} pages, {layers} layers, L3 config {rel(cfg)}"
                  + (f" (reused as it is, cold start '{ns.cp_l3_cold_start}')" if reuse else ""), soft_wrap=True)

    logs = os.path.join(os.path.abspath(ns.out_dir), "rank{rank}.log")
    l3 = load_l3_config(cfg)
    if ns.soak is not None:  # no raw-disk probe: the soak checks invariants, it does not rate the disk
        info.update(l3_capacity_gb=l3.disks[0].capacity_bytes / 1e9)
        for r in range(ns.cp_size):
            open(logs.format(rank=r), "w").close()
        console.print(f"rank logs: {rel(logs.format(rank='N'))}; L3 capacity {info['l3_capacity_gb']} GB "
                      f"({ns.soak_capacity:g} x the working set)", soft_wrap=True)
        return soak.run(ns, console, cfg, requests, l2_pages, layers, host_pages, sidecars, logs, info)
    raw_bytes = (ns.raw_mb or min(512, max(64, int(working * page_bytes / ns.cp_size / 1e6)))) * 10**6
    with console.status("measuring the raw disk (O_DIRECT, same directory)"):
        # As the ranks do: every rank's io.threads requests in flight, reads of the store's coalesced size.
        raw = rawdisk.measure(disk_dir, raw_bytes, threads=ns.cp_size * l3.io.threads,
                              read_block=READ_IO_BYTES, keep=True)
    console.print(f"raw disk: write {raw['write_gbps']:.2f} GB/s, read {raw['read_gbps']:.2f} GB/s "
                  f"({raw['bytes'] / 1e6:.0f} MB, O_DIRECT, {raw['block_bytes'] >> 20} MiB writes / "
                  f"{raw['read_block_bytes'] >> 20} MiB reads x {raw['threads']})", soft_wrap=True)

    for r in range(ns.cp_size):
        open(logs.format(rank=r), "w").close()
    console.print(f"rank logs: {rel(logs.format(rank='N'))}", soft_wrap=True)
    t0 = time.time()
    try:
        first, second = _run_both(ns, console, cfg, phases, requests, l2_pages, layers, host_pages, sidecars, logs)
        raw = rawdisk.reread(raw)  # the second read pass, then the probe file deleted
    except (RankDied, TimeoutError) as e:
        console.print(f"[bold red]cachebench: {escape(str(e))}[/] (rank logs: {escape(rel(logs.format(rank='N')))})",
                      soft_wrap=True)
        return 1
    finally:
        rawdisk.discard(raw)  # a failed run's probe file (nothing left after a reread)
    console.print(f"raw disk read again after the phases: {raw['read_gbps_passes'][1]:.2f} GB/s; the table's raw "
                  f"read is the faster pass", soft_wrap=True)
    wall = time.time() - t0
    return _finish(ns, console, info, raw, first, second, wall)


def _run_both(ns, console, cfg, phases, requests, l2_pages, layers, host_pages, sidecars, logs):
    with report.PhaseProgress(console) as progress:
        first = run_ranks(ns.cp_size, run_phases,
                          (cfg, phases, l2_pages, layers, ns.cp_l3_cold_start, host_pages, sidecars, logs,
                           ns.prefetch_threshold),
                          timeout=ns.timeout, on_event=progress.on_event, start=RANK_START)
        progress.note("restart: all ranks exit; new processes, --cp-l3-cold-start load")
        second = run_ranks(ns.cp_size, run_phases,
                           (cfg, [("restart", requests)], l2_pages, layers, "load", host_pages, sidecars, logs,
                            ns.prefetch_threshold),
                           timeout=ns.timeout, on_event=progress.on_event, start=RANK_START)
    return first, second


def _finish(ns, console, info, raw, first, second, wall) -> int:
    ranks = [dict(a, records=a["records"] + b["records"], errors=a["errors"] + b["errors"],
                  restart_cold_start=b["cold_start"], counters_after_restart=b["counters"],
                  occupancy_after_restart=b["occupancy"]) for a, b in zip(first, second)]
    result = report.summarize(info, raw, ranks, wall)
    report.print_table(console, result)
    paths = report.write_outputs(ns.out_dir, result, ranks)
    console.print(f"wrote {rel(paths['json'])} and {rel(paths['png'])}", soft_wrap=True)
    if result["errors"]:
        console.print(f"[bold red]{result['errors']} error(s)[/]: " + escape("; ".join(result["error_samples"])))
        return 1
    return 0
