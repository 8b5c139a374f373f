"""Time to first token on a real SGLang server: recompute vs L2 (host) hit vs L3 restore.

For each model and prompt length, in one run:

1. the raw O_DIRECT read (and write) speed of the L3 disk directory, measured before the
   servers start and again at the end (``sglang_cp.cachebench.rawdisk``);
2. server A (``--enable-hierarchical-cache --enable-cp-l3``, cold start ``clear``):
   every prompt once (**recompute**), then every prompt again after the device pool has
   evicted it (``--max-total-tokens`` holds about one longest prompt): **L2 hit**, the KV
   comes back from the host pool; every page is spilled to L3 (write-through);
3. server A stops (the whole process exits), server B starts with cold start ``load`` and
   an empty host pool: every prompt again, **L3 restore** (prefetch from L3 into the host
   pool, then to the device), then once more as a pure device hit (the compute floor: the
   time a request takes when its KV is already on the GPU).

TTFT is the latency of a ``/generate`` with ``max_new_tokens=1``. Each request's
``cached_tokens_details`` says where its cache came from; a row counts only requests that
came from the path it names. The restore rate is the bytes read from L3 for a request
divided by its restore time (L3-restore TTFT minus the compute floor of the same prompt),
also shown against the raw disk read speed of the same run. Each restore is split twice: the store's
own share (its counters around the request: time inside its reads and hit queries) and upstream's
per-request time stages (``meta_info`` under ``--enable-metrics``: arrival -> forward start, of it the
prefetch wait, the forward with its host pool -> GPU load, the rest), printed as a second table beside
the device hit's stages of the same prompt.

    python -m benchmark.hicache.bench_server_ttft run --model glm5:8192,32768 \\
        --model small:8192,32768,131072 --work-dir /path/on/nvme --out-dir out/ttft
    python -m benchmark.hicache.bench_server_ttft report out/a/ttft.json out/b/ttft.json --out-dir out/ttft

``--pd-cp N``: servers A and B are each a PD pair (``benchmark.support.pd_pair``) on N GPUs: a CP-sharded prefill
worker (TP = CP = N, KV sharding, HiCache and L3: each rank persists its own stripe) and a decode worker on
the same GPUs, every request sent to both with one bootstrap room. TTFT is then the decode worker's
answer (the prefix computed or restored on the prefill worker, sent over the transfer engine, one decode
step), and the cache details, counters and stages are the prefill worker's.

``--decode-load N``: server B's restores and device hits are timed while N clients keep requests
decoding (``benchmark.support.decode_load``: one shared short prompt, ``--decode-load-tokens`` greedy
tokens each, one request after another): a server under load, whose scheduler and prefetch threads
contend for the GIL, instead of an idle one. The device pool is sized for those requests too; the rows
are labelled with the load and the clients' decode rate in the same window.

``run`` writes ``ttft.json``, ``ttft.png`` and prints the table; ``report`` merges the
JSON of several runs (e.g. one model per run) into one table and plot.

``--profile``: one more prompt per length, restored on server B under py-spy (every thread of the
server's processes, waits included; ``pyspy_profile.py``) after the timed ones, so the table's rows stay
unprofiled: ``profile-<model>-<tokens>.json`` (py-spy's chrometrace: open it in ui.perfetto.dev) in
``--out-dir``, a summary per thread role (where the restore's time went) and the restore's timeline
(when each thread was inside which function, from the scheduler's receipt of the request), printed and
kept in the JSON under ``profiles``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import time

if not __package__:  # run as a file: the repository root is not on sys.path, so benchmark.* is not importable
    sys.exit("bench_server_ttft: run it from the repository root as a module: "
             "python -m benchmark.hicache.bench_server_ttft")

from benchmark.support.busy_thread import switch_interval_list  # noqa: E402
from benchmark.support.decode_load import DecodeLoad  # noqa: E402  (after the package check)

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {
    "glm5": os.path.join(HERE, "models", "glm5-shaped-78l"),
    "glm5-dsa": os.path.join(HERE, "models", "glm5-dsa-78l"),
    "small": os.path.join(HERE, "models", "mla-h4096-32l"),
}
INDEXER_ROW_B = 128 + 4  # DSA indexer-K per token per layer: fp8 key + fp32 scale
PAGE = 64
GB = 1e9
DECODE_LOAD_PROMPT = 256  # --decode-load: the clients' shared prompt, in tokens


def log(*a):
    print(*a, flush=True)


def model_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def is_dsa(model_dir: str) -> bool:
    return "index_topk" in model_config(model_dir)  # upstream's own test (configs/model_config.py)


def kv_bytes_per_token(model_dir: str, indexer: bool = True) -> int:
    """Bytes of KV one token leaves per layer x layers (bf16; MLA latent row or K+V), plus the DSA
    indexer-K row of a DSA model unless ``indexer`` is False (upstream sizes the host pool by
    ``--hicache-size`` on the KV alone and gives the indexer's host pool the same tokens)."""
    c = model_config(model_dir)
    layers = c["num_hidden_layers"]
    if "kv_lora_rank" in c:
        row = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    else:
        row = 2 * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"])
    return (2 * row + (INDEXER_ROW_B if indexer and "index_topk" in c else 0)) * layers


def dsa_server(args) -> tuple[list, dict]:
    """Flags and environment of a DSA server: the DSA backends on both sides, and upstream's torch
    indexer logits where DeepGEMM is not installed (the GPU machine's kit has none)."""
    import importlib.util

    flags = ["--dsa-prefill-backend", args.dsa_prefill_backend, "--dsa-decode-backend", args.dsa_decode_backend]
    env = dict(os.environ)
    if importlib.util.find_spec("deep_gemm") is None:
        env["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] = "1"
    return flags, env


def prompt(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


def write_l3_toml(root: str, capacity_gb: float, threads: int, read_engine: str = "python",
                  switch_ms: float = 0.0, name: str = "l3.toml") -> str:
    index, data = os.path.join(root, "index"), os.path.join(root, "data")
    for d in (index, data):
        os.makedirs(d, mode=0o700, exist_ok=True)
    path = os.path.join(root, name)
    with open(path, "w") as f:
        f.write(f'[index]\ndir = "{index}"\nmap_size_gb = 1.0\nmax_map_size_gb = 8.0\n'
                f'[durability]\nplp_policy = "ignore"\n'
                f'[io]\nthreads = {threads}\nmax_inflight_pages = 256\nread_engine = "{read_engine}"\n'
                + (f"gil_switch_interval_ms = {switch_ms}\n" if switch_ms else "") +
                f'[[disks]]\nname = "d0"\npath = "{data}"\ncapacity_gb = {capacity_gb:.1f}\n')
    return path


def med(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def check_pd_args(args) -> None:
    """--pd-cp's (and --decode-load's) constraints, each named with its fix (before any server starts)."""
    if args.decode_load < 0:
        raise SystemExit(f"--decode-load {args.decode_load}: the number of decoding clients, >= 0 (0: an idle server)")
    if args.decode_load_tokens < 1:
        raise SystemExit(f"--decode-load-tokens {args.decode_load_tokens}: tokens per load request, >= 1")
    if args.mem_fraction is None:
        args.mem_fraction = 0.5 if args.pd_cp else 0.8
    if not args.pd_cp:
        return
    if args.pd_cp < 2:
        raise SystemExit(f"--pd-cp {args.pd_cp}: a CP-sharded prefill worker needs at least 2 GPUs (or leave it out)")
    if args.profile:
        raise SystemExit("--profile attaches py-spy to one server; it is not available with --pd-cp")
    if args.mem_fraction + args.pd_decode_mem_fraction > 0.9:
        raise SystemExit(f"--mem-fraction {args.mem_fraction} + --pd-decode-mem-fraction {args.pd_decode_mem_fraction} "
                         "> 0.9: the prefill and decode workers share the GPUs; lower one of them")


def make_server(model: str, tag: str, flags: list, model_flags: list, common: dict, args, ServerProcess):
    """Server A or B: one ServerProcess, or with --pd-cp a PdPair (sharded prefill worker with ``flags``,
    decode worker with the model's own flags only: L3 lives on the prefill side)."""
    log_path = os.path.join(args.out_dir, f"{tag}.log")
    if not args.pd_cp:
        return ServerProcess(model, flags, log_path=log_path, **common)
    from benchmark.support.pd_pair import PdPair, decode_args, sharded_prefill_args
    from benchmark.support.server_process import free_port

    bport = free_port()
    prefill = ServerProcess(model, flags + sharded_prefill_args(args.pd_cp, bport, args.pd_transfer_backend),
                            log_path=log_path, **common)
    decode = ServerProcess(model, model_flags + decode_args(args.pd_cp, args.pd_transfer_backend),
                           log_path=os.path.join(args.out_dir, f"{tag}-decode.log"),
                           **{**common, "mem_fraction_static": args.pd_decode_mem_fraction})
    return PdPair(prefill, decode, bport)


def run_model(name: str, lengths: list, args, ServerProcess, rawdisk) -> dict:
    model = MODELS.get(name, name)
    per_tok = kv_bytes_per_token(model)
    lengths = sorted(lengths)
    reps = args.reps
    work = os.path.join(args.work_dir, f"ttft-{os.path.basename(model)}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, mode=0o700)
    # --profile spills one more prompt per length: it counts, or GC reclaims the timed prompts' first pages
    # (oldest first) and their restores become recomputes
    working_set = sum(lengths) * (reps + (1 if args.profile else 0)) * per_tok
    capacity = max(4.0, 1.3 * working_set / GB)
    free = shutil.disk_usage(work).free / GB
    if free < capacity + 5:
        raise SystemExit(f"--work-dir {args.work_dir}: {free:.0f} GB free, the L3 slabs need {capacity:.0f} GB")
    host_gb = args.hicache_size or max(4, int(1.25 * working_set / GB) + 2)
    switches = args.gil_switch_interval_ms
    # one L3 config per switch interval, all on one data directory: server A spills with the first, and
    # each server B restores the same pages with its own
    cfgs = [write_l3_toml(work, capacity, args.io_threads, args.read_engine, ms,
                          name="l3.toml" if i == 0 else f"l3-switch{i}.toml") for i, ms in enumerate(switches)]
    from sglang_cp.l3 import L3ConfigError, load_l3_config
    try:  # a bad --io-threads or --gil-switch-interval-ms stops here, not in a server's startup
        for cfg in cfgs:
            load_l3_config(cfg)
    except L3ConfigError as e:
        raise SystemExit(f"the L3 config these flags make is refused: {e}") from None
    data_dir = os.path.join(work, "data")
    res = {"model": os.path.basename(model), "kv_bytes_per_token": per_tok, "lengths": lengths, "reps": reps,
           "host_pool_gb": host_gb, "l3_capacity_gb": round(capacity, 1), "mem_layout": args.mem_layout,
           "attention_backend": args.attention_backend, "read_engine": args.read_engine, "pd_cp": args.pd_cp,
           "gil_switch_interval_ms": switches[0] or None, "switch_compared": len(switches) > 1,
           "decode_load": ({"clients": args.decode_load, "new_tokens": args.decode_load_tokens}
                           if args.decode_load else None)}

    log(f"[{name}] raw disk probe ({args.raw_gib} GiB O_DIRECT, {args.io_threads} threads) in {data_dir}")
    raw0 = rawdisk.measure(data_dir, int(args.raw_gib * (1 << 30)), threads=args.io_threads)
    log(f"[{name}] raw: write {raw0['write_gbps']:.2f} GB/s, read {raw0['read_gbps']:.2f} GB/s")

    P = {L: [prompt(L, 1000 * L + i) for i in range(reps)] for L in lengths}
    # --profile: one more prompt per length, spilled with the others, restored under py-spy after them
    extra = {L: prompt(L, 1000 * L + 999) for L in lengths} if args.profile else {}
    # --decode-load: each client's request holds its prompt and its decode tokens on the GPU meanwhile
    load_tokens = args.decode_load * (DECODE_LOAD_PROMPT + args.decode_load_tokens + PAGE)
    max_total = int(max(lengths) * 1.25) + 2 * PAGE + load_tokens
    common = dict(context_length=max(lengths) + 256, max_total_tokens=max_total,
                  mem_fraction_static=args.mem_fraction, startup_timeout_s=args.startup_timeout,
                  attention_backend=args.attention_backend)
    model_flags = list(args.server_arg or [])
    if args.kv_cache_dtype:
        model_flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    if is_dsa(model):
        dsa_flags, common["env"] = dsa_server(args)
        model_flags += dsa_flags
        common["attention_backend"] = "dsa"
    res["attention_backend"] = common["attention_backend"]
    res["server_flags"] = model_flags + ["--attention-backend", common["attention_backend"]]

    def flags(cold, cfg):
        return model_flags + ["--enable-hierarchical-cache", "--hicache-size", str(host_gb),
                "--hicache-mem-layout", args.mem_layout,
                "--hicache-write-policy", "write_through",
                "--hicache-storage-prefetch-policy", "wait_complete",
                "--enable-cp-l3", "--cp-l3-config", cfg, "--cp-l3-cold-start", cold]

    def warm(s):  # JIT-compile the no-prefix and the prefix kernels before timing
        w = prompt(512, 7)
        s.generate(w, 1)
        s.generate(w + [5] * PAGE, 1)

    def rec(r, L):
        return {"tokens": L, "ttft_s": r.latency_s, "first_token": (r.output_ids or [None])[0],
                "device": r.device_tokens, "host": r.host_tokens, "storage": r.storage_tokens,
                **request_stages(r)}

    rows = {"recompute": [], "l2": []}  # server A's; each server B adds its "l3" and "device" rows
    a = make_server(model, f"{name}-A", flags("clear", cfgs[0]), model_flags, common, args, ServerProcess)
    a.start()
    res["startup_s_A"] = round(a.startup_s, 1)
    try:
        warm(a)
        for L in lengths:
            for i, p in enumerate(P[L]):
                r = a.generate(p, 1)
                rows["recompute"].append(rec(r, L))
                log(f"[{name}] recompute {L} #{i}: {r.latency_s:.3f} s {r.cached_details}")
        for L in lengths:
            for i, p in enumerate(P[L]):
                r = a.generate(p, 1)
                rows["l2"].append(rec(r, L))
                log(f"[{name}] re-send   {L} #{i}: {r.latency_s:.3f} s {r.cached_details}")
        for L, p in extra.items():
            a.generate(p, 1)
        want = sum((L - 1) // PAGE for L in lengths) * (reps + (1 if extra else 0))
        t = time.monotonic()
        # The target-KV payload's pages (a DSA page also spills an indexer-K payload page).
        deadline = t + args.spill_timeout
        spilled = a.metric_by_label("sglang:cp_l3_payload_spill_pages_total", "payload").get("kv", 0.0)
        while spilled < want and time.monotonic() < deadline:
            time.sleep(0.5)
            spilled = a.metric_by_label("sglang:cp_l3_payload_spill_pages_total", "payload").get("kv", 0.0)
        res["spill"] = {"pages_wanted": want, "pages_spilled": spilled, "wait_s": round(time.monotonic() - t, 1)}
        res["metrics_A"] = {k: v for k, v in a.metrics().items() if k.startswith("sglang:cp_l3")}
        log(f"[{name}] spilled {spilled:.0f}/{want} pages")
    finally:
        a.stop()

    per_switch = []
    for k, (ms, cfg) in enumerate(zip(switches, cfgs)):
        per_switch.append(restore_with(model, name if k == 0 else f"{name}-switch{ms:g}", flags("load", cfg),
                                       model_flags, common, args, ServerProcess, P, lengths, extra, rec, warm))
    raw1 = rawdisk.measure(data_dir, int(args.raw_gib * (1 << 30)), threads=args.io_threads)
    log(f"[{name}] raw (end): write {raw1['write_gbps']:.2f} GB/s, read {raw1['read_gbps']:.2f} GB/s")
    res["raw"] = [raw0, raw1]
    shutil.rmtree(work, ignore_errors=True)
    out = []
    for ms, b_res in zip(switches, per_switch):
        r = {**res, **b_res, "gil_switch_interval_ms": ms or None}
        r["rows"] = {"recompute": rows["recompute"], "l2": rows["l2"], **b_res["rows"]}
        out.append(r)
    return out


def restore_with(model, name, flags, model_flags, common, args, ServerProcess, P, lengths, extra, rec, warm) -> dict:
    """One server B: started on server A's L3 with ``--cp-l3-cold-start load`` and an empty host pool, each
    prompt restored from L3 and then sent again as a device hit. Its rows, counters and startup time."""
    rows = {"l3": [], "device": []}
    res = {}
    b = make_server(model, f"{name}-B", flags, model_flags, common, args, ServerProcess)
    b.start()
    res["startup_s_B"] = round(b.startup_s, 1)
    try:
        warm(b)
        load = contextlib.nullcontext()
        if args.decode_load:
            load = DecodeLoad(lambda ids, n, t: b.generate(ids, n, timeout_s=t), args.decode_load,
                              prompt(DECODE_LOAD_PROMPT, 424242), args.decode_load_tokens,
                              timeout_s=args.spill_timeout)
            log(f"[{name}] decode load: {args.decode_load} clients x {args.decode_load_tokens} tokens")
        with load:
            restore_rows(b, P, lengths, rows, rec, name)
        if args.decode_load:
            res["decode_load"] = {"clients": args.decode_load, "new_tokens": args.decode_load_tokens, **load.during}
            log(f"[{name}] decode load during the restores: {load.during}")
        if extra:
            try:
                res["profiles"] = profile_restores(b, extra, name, args.out_dir)
            except (OSError, RuntimeError) as e:  # py-spy could not attach: the timed rows still stand
                log(f"[{name}] profile failed: {e}")
                res["profiles"] = {"error": str(e)[-2000:]}
        res["metrics_B"] = {k: v for k, v in b.metrics().items() if k.startswith("sglang:cp_l3")}
    finally:
        b.stop()
    res["rows"] = rows
    return res


def restore_rows(b, P: dict, lengths: list, rows: dict, rec, name: str) -> None:
    """Server B's timed rows: each prompt restored from L3, then again as a device hit (its floor)."""
    for L in lengths:
        for i, p in enumerate(P[L]):
            before = b.metrics_text()
            c0 = server_cpu_s(b)
            r = b.generate(p, 1)
            cpu = server_cpu_s(b) - c0
            row = rec(r, L)
            row["cpu_s"] = cpu
            time.sleep(1.2)  # the cp_l3 counters are published every second
            row.update(store_deltas(before, b.metrics_text()))
            rows["l3"].append(row)
            c0 = server_cpu_s(b)
            d = b.generate(p, 1)
            cpu = server_cpu_s(b) - c0
            rows["device"].append({**rec(d, L), "cpu_s": cpu})
            log(f"[{name}] L3 restore {L} #{i}: {r.latency_s:.3f} s {r.cached_details}, "
                f"{row['reload_bytes'] / GB:.2f} GB; device hit {d.latency_s:.3f} s; stages {stage_line(row)}"
                + ("" if r.storage_tokens else "  NOT SERVED FROM L3 (left out of the table; see metrics_B)"))


def profile_restores(server, prompts: dict, name: str, out_dir: str) -> list:
    """Each prompt's L3 restore under py-spy (chrometrace: every stack change with its time): its TTFT,
    cache sources, a summary per thread role, and the timeline of the restore (when each thread was
    inside the scheduler's, upstream's storage threads' and our backend's functions, from the
    scheduler's receipt of the request)."""
    from benchmark.hicache import pyspy_profile

    out = []
    # The scheduler process alone: it holds the restore (upstream's storage threads, our backend, the
    # forward), and py-spy's clock is finer the fewer threads it visits. Else the whole server.
    sched = pyspy_profile.descendant_named(server.proc.pid, "sglang::scheduler")
    for L, p in prompts.items():
        path = os.path.join(out_dir, f"profile-{name}-{L}.json")
        with pyspy_profile.Recorder(sched or server.proc.pid, path, fmt="chrometrace", subprocesses=sched is None):
            r = server.generate(p, 1)
        summary = pyspy_profile.summarize(path)
        window_ms = 1000 * r.latency_s + 50
        try:
            tl = pyspy_profile.timeline(path, pyspy_profile.RESTORE_FUNCS, pyspy_profile.RESTORE_ANCHOR, window_ms)
            shown = pyspy_profile.format_timeline(tl)
        except ValueError as e:  # the anchor was not sampled: the summary still stands
            tl, shown = None, str(e)
        log(f"[{name}] profiled L3 restore {L}: {r.latency_s:.3f} s {r.cached_details}; {path}\n"
            + pyspy_profile.format_summary(summary) + "\n" + shown)
        out.append({"tokens": L, "ttft_s": r.latency_s, "cached": r.cached_details, "path": path,
                    "summary": summary, "timeline": tl})
    return out


def request_stages(r) -> dict:
    """Where one request's time went, from upstream's own per-request time stats (meta_info under
    --enable-metrics, wall clock): from its arrival at the server (``request_received_ts``, else the
    client's send) to the forward's start (tokenizing, the hit query, the prefetch, its completion
    hand-offs and radix insert, scheduling), of that the wait for the prefetch (upstream polls it once per
    scheduler pass), the forward (for a restore, with the layer-by-layer host pool -> GPU load it waits
    on), and what follows until the client has the answer. Empty where the server did not report them."""
    m = r.meta_info or {}
    start = m.get("request_received_ts") or r.sent_at
    entry, done = m.get("forward_entry_time"), m.get("prefill_finished_time")
    if not (start and entry and done):
        return {}
    return {"to_forward_s": entry - start, "prefetch_wait_s": m.get("storage_prefetch_wait"),
            "forward_s": done - entry,
            "after_forward_s": (r.latency_s - (done - r.sent_at)) if r.sent_at else None}


def stage_line(row: dict) -> str:
    """One restore's stages and store time, in ms, for the run's log."""
    ms = lambda k: "-" if row.get(k) is None else f"{row[k] * 1e3:.1f}"  # noqa: E731
    return (f"to forward {ms('to_forward_s')} (prefetch wait {ms('prefetch_wait_s')}, store reads {ms('read_s')}), "
            f"forward {ms('forward_s')}, after {ms('after_forward_s')} ms")


STAGES = ("to_forward_s", "prefetch_wait_s", "forward_s", "after_forward_s")


# Per restore, the store's own share of it (counter deltas around the request): the bytes, the wall time
# inside our page reads (index lookup, reads, CRC, copy into the host pool) and inside our hit queries.
# What the restore costs beyond a device hit and outside those two is upstream's: its thread hand-offs,
# the hash of the prompt's pages, the host pool -> GPU load and the scheduling around them.
STORE_COUNTERS = {"reload_bytes": "sglang:cp_l3_reload_bytes_total", "read_s": "sglang:cp_l3_read_seconds_total",
                  "read_calls": "sglang:cp_l3_read_calls_total", "hitq_s": "sglang:cp_l3_hit_query_seconds_total"}


# Seconds inside the store: CP ranks spend them side by side, so a request's share is the slowest rank's.
STORE_TIMES = ("read_s", "hitq_s")


def server_cpu_s(server) -> float:
    """CPU seconds (user + system) the server's whole process tree has used so far: the launcher, the
    scheduler with upstream's storage threads and our store's I/O threads, the detokenizer. A restore's
    CPU is the difference around its request, less that of the device hit of the same prompt (the
    scheduler's own loop and the forward run in both)."""
    import psutil

    try:
        root = psutil.Process(server.proc.pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return total


def store_deltas(before_text: str, after_text: str) -> dict:
    """The store's counters for one request, from /metrics before and after it: bytes and calls summed over
    the ranks, seconds the slowest rank's (one rank: the same thing)."""
    from benchmark.support.server_process import parse_metrics

    b, a = parse_metrics(before_text), parse_metrics(after_text)
    b_rank, a_rank = parse_metrics(before_text, by_label="cp_rank"), parse_metrics(after_text, by_label="cp_rank")
    row = {}
    for key, metric in STORE_COUNTERS.items():
        if key in STORE_TIMES:
            after_r, before_r = a_rank.get(metric, {}), b_rank.get(metric, {})
            row[key] = max((v - before_r.get(rank, 0.0) for rank, v in after_r.items()), default=0.0)
        else:
            row[key] = a.get(metric, 0.0) - b.get(metric, 0.0)
    return row


def switch_label(res: dict) -> str:
    """A row's switch interval when it was set, or when the run compared several (then CPython's own, 5 ms,
    is named too)."""
    ms = res.get("gil_switch_interval_ms")
    if ms:
        return f" (switch {ms:g} ms)"
    return " (switch 5 ms, CPython's)" if res.get("switch_compared") else ""


def summarize(res: dict) -> list:
    """One table row per (model, length) from a run_model() result."""
    raw_read = statistics.mean(r["read_gbps"] for r in res["raw"])
    out = []
    for L in res["lengths"]:
        cached = (L - 1) // PAGE * PAGE

        def pick(path, ok):
            return [r for r in res["rows"][path] if r["tokens"] == L and ok(r)]

        rec = pick("recompute", lambda r: r["device"] + r["host"] + r["storage"] == 0)
        l2 = pick("l2", lambda r: r["host"] >= 0.9 * cached)
        l3 = pick("l3", lambda r: r["storage"] >= 0.9 * cached)
        floors = [r for r in res["rows"]["device"] if r["tokens"] == L]
        # each restore served from L3 with the device hit of the same prompt that followed it
        restored = [(r, f) for r, f in zip(pick("l3", lambda r: True), floors) if r["storage"] >= 0.9 * cached]
        rates = [r["reload_bytes"] / max(1e-6, r["ttft_s"] - f["ttft_s"]) / GB
                 for r, f in restored if r["reload_bytes"] > 0]
        # the store's own rate, and the restore's time outside the store (beyond a device hit)
        served = [(r, f) for r, f in restored if r.get("read_s", 0) > 0]
        store_rates = [r["reload_bytes"] / r["read_s"] / GB for r, _f in served]
        outside = [(r["ttft_s"] - f["ttft_s"]) - r["read_s"] - r.get("hitq_s", 0.0) for r, f in served]
        same = [a["first_token"] == b["first_token"]
                for a, b in zip(pick("recompute", lambda r: True), pick("l3", lambda r: True))]
        load = res.get("decode_load") or {}
        out.append({
            "model": res["model"] + (f" (decode load {load['clients']})" if load.get("clients") else "")
            + switch_label(res),
            "tokens": L, "decode_load": load or None,
            "recompute": med([r["ttft_s"] for r in rec]),
            "l2": med([r["ttft_s"] for r in l2]),
            "l3": med([r["ttft_s"] for r in l3]),
            "device_floor": med([r["ttft_s"] for r in floors]),
            "restored_gb": med([r["reload_bytes"] / GB for r in pick("l3", lambda r: True)]),
            "restore_gbps": med(rates),
            "raw_read_gbps": raw_read,
            "restore_x_raw": (statistics.median(rates) / raw_read) if rates else None,
            "store_read_gbps": med(store_rates),
            "store_x_raw": (statistics.median(store_rates) / raw_read) if store_rates else None,
            "read_s": med([r["read_s"] for r, _f in served]),
            "hit_query_s": med([r.get("hitq_s", 0.0) for r, _f in served]),
            "outside_store_s": med(outside),
            # the restore's CPU beyond the device hit of the same prompt, per GB restored (all processes)
            "restore_cpu_s_per_gb": med([(r["cpu_s"] - f["cpu_s"]) / (r["reload_bytes"] / GB)
                                         for r, f in restored if r.get("cpu_s") is not None
                                         and f.get("cpu_s") is not None and r["reload_bytes"] > 0]),
            # upstream's per-request stages of the restores and of the device hits that follow them
            "stages": {path: {k: med([r[k] for r in rows if r.get(k) is not None]) for k in STAGES}
                       for path, rows in (("l3", [r for r, _f in served]), ("device", [f for _r, f in served]))},
            "speedup_l3_vs_recompute": (statistics.median([r["ttft_s"] for r in rec])
                                        / statistics.median([r["ttft_s"] for r in l3])) if rec and l3 else None,
            "same_first_token": all(same) if same else None,
        })
    return out


def fmt(m, unit=""):
    if not m:
        return "-"
    return f"{m['median']:.3f}{unit} ({m['min']:.3f}-{m['max']:.3f})"


def stages_table(rows: list) -> str:
    """The restore against the device hit of the same prompt, stage by stage (upstream's time stats), with
    the store's time inside its reads: what a restore adds is in the 'to forward' and 'forward' columns."""
    have = [r for r in rows if any(m for m in (r.get("stages") or {}).get("l3", {}).values())]
    if not have:
        return ""
    head = ["model", "tokens", "path", "send -> forward s", "of it: prefetch wait s", "of that: store reads s",
            "forward s", "after the forward s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in have:
        for path, label in (("l3", "L3 restore"), ("device", "device hit")):
            st = r["stages"][path]
            lines.append("| " + " | ".join([
                r["model"], f"{r['tokens']:,}", label, fmt(st["to_forward_s"]), fmt(st["prefetch_wait_s"]),
                fmt(r.get("read_s")) if path == "l3" else "-", fmt(st["forward_s"]), fmt(st["after_forward_s"])])
                + " |")
    return "\n".join(lines)


def render(results: list, out_dir: str) -> None:
    rows = [r for res in results for r in summarize(res)]
    head = ["model", "tokens", "recompute TTFT s", "L2 hit TTFT s", "L3 restore TTFT s", "L3 vs recompute",
            "device-hit TTFT s", "restored GB", "restore GB/s", "raw read GB/s", "restore x raw",
            "store read GB/s", "store x raw", "restore - device - store s", "restore CPU s/GB", "same token"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["model"], f"{r['tokens']:,}", fmt(r["recompute"]), fmt(r["l2"]), fmt(r["l3"]),
            f"{r['speedup_l3_vs_recompute']:.2f}x" if r["speedup_l3_vs_recompute"] else "-",
            fmt(r["device_floor"]),
            f"{r['restored_gb']['median']:.2f}" if r["restored_gb"] else "-",
            fmt(r["restore_gbps"]), f"{r['raw_read_gbps']:.2f}",
            f"{r['restore_x_raw']:.2f}x" if r["restore_x_raw"] else "-",
            fmt(r.get("store_read_gbps")), f"{r['store_x_raw']:.2f}x" if r.get("store_x_raw") else "-",
            fmt(r.get("outside_store_s")), fmt(r.get("restore_cpu_s_per_gb")),
            {True: "yes", False: "NO", None: "-"}[r["same_first_token"]]]) + " |")
    table = "\n".join(lines)
    stages = stages_table(rows)
    if stages:
        table += "\n\n" + stages
    print(table, flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ttft.json"), "w") as f:
        json.dump({"runs": results, "summary": rows}, f, indent=1)
    with open(os.path.join(out_dir, "ttft.md"), "w") as f:
        f.write(table + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no PNG")
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        mr = [r for r in rows if r["model"] == m]
        for key, label in (("recompute", "recompute"), ("l2", "L2 (host) hit"), ("l3", "L3 restore after restart"),
                           ("device_floor", "device hit")):
            pts = [(r["tokens"], r[key]) for r in mr if r[key]]
            if pts:
                x = [p[0] for p in pts]
                y = [p[1]["median"] for p in pts]
                lo = [p[1]["median"] - p[1]["min"] for p in pts]
                hi = [p[1]["max"] - p[1]["median"] for p in pts]
                ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s), median, min-max")
        ax.set_title(m)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ttft.png"), dpi=120)
    log(f"wrote {os.path.join(out_dir, 'ttft.json')}, ttft.md and ttft.png")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start servers and measure")
    r.add_argument("--model", action="append", required=True,
                   help="NAME:LEN,LEN,... with NAME in %s or a model directory" % sorted(MODELS))
    r.add_argument("--reps", type=int, default=3, help="distinct prompts per length")
    r.add_argument("--work-dir", required=True, help="directory on the L3 disk (slabs and index go here)")
    r.add_argument("--out-dir", default="out/ttft")
    r.add_argument("--hicache-size", type=int, default=0, help="host pool GB (default: sized to the prompts)")
    r.add_argument("--mem-layout", default="page_first", choices=["page_first", "layer_first"])
    r.add_argument("--mem-fraction", type=float, default=None,
                   help="the (prefill) server's --mem-fraction-static (default 0.8; 0.5 with --pd-cp)")
    r.add_argument("--attention-backend", default="triton",
                   help="upstream's --attention-backend (fa3 on sm90 prefills long prompts much faster)")
    r.add_argument("--kv-cache-dtype", default="", help="upstream's --kv-cache-dtype (default: upstream's choice)")
    r.add_argument("--dsa-prefill-backend", default="fa3",
                   help="for DSA models (upstream's default, flashmla_sparse, needs the flash_mla package)")
    r.add_argument("--dsa-decode-backend", default="fa3", help="for DSA models")
    r.add_argument("--server-arg", action="append", metavar="ARG",
                   help="one more launch_server argument, repeatable (e.g. --server-arg=--chunked-prefill-size=16384)")
    r.add_argument("--io-threads", type=int, default=8)
    r.add_argument("--read-engine", default="python", choices=["python", "native", "uring"],
                   help="io.read_engine of L3")
    r.add_argument("--gil-switch-interval-ms", type=switch_interval_list, default=[0.0], metavar="MS[,MS...]",
                   help="io.gil_switch_interval_ms of L3 (0: the interpreter's own, 5 ms); with several values "
                        "one server B per value restores server A's pages, one row each in the same run")
    r.add_argument("--raw-gib", type=float, default=4.0)
    r.add_argument("--startup-timeout", type=float, default=600)
    r.add_argument("--spill-timeout", type=float, default=300)
    r.add_argument("--decode-load", type=int, default=0, metavar="N",
                   help="time server B's restores while N clients keep requests decoding (default: idle server)")
    r.add_argument("--decode-load-tokens", type=int, default=256, metavar="T",
                   help="with --decode-load: greedy tokens per load request")
    r.add_argument("--profile", action="store_true",
                   help="restore one more prompt per length under py-spy (pip install py-spy)")
    r.add_argument("--pd-cp", type=int, default=0, metavar="N",
                   help="servers A and B as PD pairs on N GPUs: a CP-sharded prefill worker (L3 on it) + a decode "
                        "worker (needs a transfer engine; non-DSA models need --attention-backend fa3 on sm90)")
    r.add_argument("--pd-transfer-backend", default="nixl", help="with --pd-cp: upstream's disaggregation transfer backend")
    r.add_argument("--pd-decode-mem-fraction", type=float, default=0.3,
                   help="with --pd-cp: the decode worker's --mem-fraction-static (the prefill worker takes --mem-fraction)")
    p = sub.add_parser("report", help="merge ttft.json files into one table and plot")
    p.add_argument("json", nargs="+")
    p.add_argument("--out-dir", default="out/ttft")
    args = ap.parse_args(argv)

    if args.cmd == "report":
        results = []
        for path in args.json:
            with open(path) as f:
                results += json.load(f)["runs"]
        render(results, args.out_dir)
        return 0

    check_pd_args(args)
    if args.profile:
        from benchmark.hicache import pyspy_profile

        pyspy_profile.pyspy_binary()  # fails now, with the fix, rather than after the first server
    from sglang_cp.cachebench import rawdisk
    from benchmark.support.server_process import ServerProcess, ServerStartError

    os.makedirs(args.out_dir, exist_ok=True)
    results = []
    for spec in args.model:
        name, _, lens = spec.partition(":")
        lengths = [int(x) for x in lens.split(",") if x] or [8192, 32768, 131072]
        try:
            results += run_model(name, lengths, args, ServerProcess, rawdisk)
        except ServerStartError as e:
            log(f"[{name}] server did not start: {e}")
            results.append({"model": name, "error": str(e)[-3000:]})
        render([x for x in results if "rows" in x], args.out_dir)
        with open(os.path.join(args.out_dir, "ttft-raw.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
