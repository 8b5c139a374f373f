"""Our L3 tier beside what users would pick instead, on one real SGLang server per tier.

Every tier (``peer_tiers.py``: no HiCache, HiCache L2 only, upstream's ``file``, ``nixl``, Mooncake
Store, LMCache, ours with each read engine) runs the same workload (``peer_workloads.py``) on the same
model (dummy weights, ``bench_server_ttft.MODELS``), device pool, host DRAM, disk budget and prefetch
policy, through the same harness as ``bench_server_ttft.py`` (``benchmark.support.server_process``: streaming
``/generate`` with ``input_ids``, ``meta_info.cached_tokens_details``). Before the first tier a server
with HiCache's host pool and no storage serves the workload's shortest, median and longest prompt
lengths twice (``warm_up``;
``--no-warm-up`` skips it), so kernels compiled at their first use on this machine are not charged to
whichever tier runs first. Per tier, two phases:

1. ``replay``: the tier's storage emptied, a fresh server (warmed with one unrelated prompt), the
   workload once: ``--concurrency`` clients each replaying whole conversations, a turn after the last
   one's answer (``--loop sessions``), or taking requests in trace order (``closed``), or open loop at
   the trace's compressed timestamps (``open``);
2. ``restart`` (tiers with storage; without, a restarted server is the replay's fresh one): that server
   stopped, a new one started on the same storage (our tier with cold start
   ``load``; side services kept, or restarted too with ``--restart-services``), the workload again with
   no warm-up: its startup time, the time from its first send to the first answer served from storage,
   the tokens storage served.

Recorded per tier and phase (``peer_report.py``): requests/s, TTFT p50/p90/p99, tokens served from
device/host/storage, hit ratio against the ideal and where the rest went (in flight / lost), bytes on
disk (du), CPU seconds of the server's process tree and of the side services, output ids against the
first tier's, and the server's storage counters (``/metrics``: written, dropped, found, loaded, found but
not loaded) over the phase; with ``--forward-metrics``, every forward pass as upstream publishes it
(``forward_passes.py``). A tier whose package is missing keeps its row with the exact import error and what it
would take.

    python -m benchmark.hicache.bench_peers run --model small --workload trace --trace conversation_trace.jsonl \\
        --conversations 40 --block-tokens 128 --max-input-tokens 16384 --concurrency 8 \\
        --work-dir /path/on/nvme --out-dir out/peers
    python -m benchmark.hicache.bench_peers run --model small --workload storm --doc-tokens 16384 \\
        --suffixes 4 --requests 200 --concurrency 16 --work-dir /path/on/nvme --out-dir out/peers-storm
    python -m benchmark.hicache.bench_peers commands --model small --work-dir /path/on/nvme   # command lines only
    python -m benchmark.hicache.bench_peers report out/peers/peers.json --out-dir out/peers
    python -m benchmark.hicache.bench_peers report out/a/peers.json out/b/peers.json --out-dir out/ab  # one table

``run`` writes ``peers.json`` (after every tier), ``peers.md`` and the PNGs; ``report`` rewrites the
table and plots from a saved JSON, or from several runs of one workload that each measured some tiers
(``--tiers``; merged into ``peers_merged.json``, the table saying the tiers came from consecutive runs);
``report --trace FILE`` rebuilds the block ids of a run saved without them. Nothing here needs a GPU
except ``run``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

if not __package__:  # run as a file: the repository root is not on sys.path, so benchmark.* is not importable
    sys.exit("bench_peers: run it from the repository root as a module: python -m benchmark.hicache.bench_peers")

from benchmark.hicache import bench_server_ttft as ttft  # the shared harness: models, KV sizes, L3 config
from benchmark.hicache import forward_passes  # --forward-metrics: upstream's per-forward GPU spans
from benchmark.hicache import peer_report, peer_tiers
from benchmark.hicache.peer_tiers import du_bytes  # bytes a tier's storage holds
from benchmark.hicache import peer_workloads as wl
from benchmark.support import block_io  # what its disk read and wrote in a phase
from benchmark.support import page_cache  # what of a tier's storage the page cache holds
from benchmark.support import ram_hold  # --free-ram-gb: the host's spare RAM held, alike for every tier
from benchmark.support import server_process as harness  # the real-server harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GB = 1e9
KV_SENSITIVE_DIR = os.path.join(REPO, "test", "gpu", "kv_sensitive")


def log(*a):
    print(*a, flush=True)


# ---- workload -------------------------------------------------------------------------------------
LOOPS = {"closed": "closed loop at {c}",
         "sessions": "closed loop of conversations at {c} (a conversation's turns in order, each after the last "
                     "one's answer)",
         "open": "open loop, time / {t:g}"}


def build_workload(args, model_dir: str) -> tuple:
    """(prompts, one-line description)."""
    cfg = ttft.model_config(model_dir)
    if args.workload == "trace":
        if not args.trace:
            raise SystemExit("--workload trace needs --trace FILE (Mooncake FAST'25 JSON Lines)")
        reqs, prompts = trace_workload(args, args.trace)
        conv = len({p.conversation for p in prompts})
        desc = (f"trace {os.path.basename(args.trace)}: {len(prompts)} of {len(reqs)} requests, {conv} whole "
                f"conversations (seed {args.seed}), {args.block_tokens} tokens per block, input cap "
                f"{args.max_input_tokens or '-'}, " + LOOPS[args.loop].format(c=args.concurrency, t=args.time_compression))
    else:
        bpt = ttft.kv_bytes_per_token(model_dir)
        need = wl.storm_docs_needed(args.device_tokens, int(args.hicache_size * GB), bpt, args.doc_tokens)
        docs = args.docs or need
        if docs < need and not args.allow_small_storm:
            raise SystemExit(f"--docs {docs}: the documents' KV fits in device + host pools; use --docs >= {need} "
                             "(or leave it out), or --allow-small-storm")
        prompts = wl.storm(docs, args.suffixes, args.requests, args.zipf, args.seed, args.doc_tokens,
                           args.suffix_tokens, args.block_tokens, args.max_new_tokens or 1)
        ws = wl.distinct_tokens(prompts, args.block_tokens) * bpt
        desc = (f"storm: {docs} documents x {args.suffixes} suffixes, Zipf {args.zipf}, {args.requests} requests "
                f"(seed {args.seed}), {args.doc_tokens}+{args.suffix_tokens} tokens, {args.concurrency} clients, "
                f"working set {ws / GB:.1f} GB vs pools {(args.device_tokens * bpt) / GB + args.hicache_size:.1f} GB")
        args.loop = "closed"
        note = wl.device_pool_note(args.device_tokens, args.concurrency, args.doc_tokens + args.suffix_tokens,
                                   args.max_new_tokens or 1)
        if note:
            desc += f"; {note}"
    for note in pool_notes(args, model_dir, prompts):
        desc += f"; {note}"
    if cfg.get("vocab_size") is None:
        raise SystemExit(f"{model_dir}/config.json has no vocab_size: the prompts' token ids need it")
    return prompts, desc


def default_device_tokens(prompts: list) -> int:
    """The device pool when --device-tokens is not given: two of the longest request, answer included."""
    return 2 * max(p.tokens + p.output_tokens for p in prompts) + 2 * wl.PAGE


def pool_notes(args, model_dir: str, prompts: list) -> list:
    """``host_pool_notes`` when the run has a tier with a HiCache host pool. The device pool is
    --device-tokens or ``model_setup``'s default."""
    names = tier_names(args)
    if not args.hicache_size or (names is not None and not peer_report.has_hicache_host_pool(names)):
        return []
    device = args.device_tokens or default_device_tokens(prompts)
    return wl.host_pool_notes(int(args.hicache_size * GB), device, ttft.kv_bytes_per_token(model_dir, indexer=False),
                              args.concurrency, [p.tokens for p in prompts])


def trace_workload(args, trace: str) -> tuple:
    """(the trace's requests, the prompts of the sample the run's flags pick)."""
    reqs = wl.read_trace(trace)
    sample = wl.sample_conversations(reqs, args.conversations, args.sample_fraction, args.seed)
    return reqs, wl.trace_prompts(sample, args.block_tokens, args.time_compression, args.max_input_tokens,
                                  args.max_new_tokens, prefix=wl.system_prefix(reqs))


def add_block_ids(result: dict, trace: str) -> bool:
    """Give a saved trace run's prompts their block ids (``block_ids``; runs saved before the report's
    in-flight / lost split kept only counts), rebuilt from ``trace`` with the run's own flags (its argv).
    False when they were there already. Refuses a run that was not a trace replay, or prompts that come
    out different from the saved ones (another trace, or other sampling code)."""
    if all("block_ids" in p for p in result["prompts"]):
        return False
    args = parser().parse_args(result["meta"]["argv"])
    if args.cmd != "run" or args.workload != "trace":
        raise SystemExit(f"report --trace: the run was not a trace replay (argv {shlex.join(result['meta']['argv'])})")
    prompts = trace_workload(args, trace)[1]
    got = [(p.tokens, len(p.blocks), p.output_tokens) for p in prompts]
    want = [(p["tokens"], p["blocks"], p["output_tokens"]) for p in result["prompts"]]
    if got != want:
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise SystemExit(f"report --trace {trace}: rebuilt prompt {k} differs from the saved run's "
                         f"({got[k] if k < len(got) else 'none'} vs {want[k] if k < len(want) else 'none'}: "
                         "(tokens, blocks, output tokens)); give the trace file that run read")
    for p, ids in zip(result["prompts"], wl.block_numbers(prompts)):
        p["block_ids"] = ids
    return True


def ideal(prompts: list, block_tokens: int) -> dict:
    out = {}
    for phase, warm in (("replay", ()), ("restart", prompts)):
        h = wl.ideal_hits(prompts, block_tokens, warm=warm)
        h.pop("per_prompt_tokens")
        out[phase] = h
    return out


# ---- side services, CPU, disk ---------------------------------------------------------------------
class RunningService:
    def __init__(self, svc: peer_tiers.Service, log_path: str, timeout_s: float):
        self.svc = svc
        self.log = open(log_path, "ab")
        self.log.write(("\n$ " + shlex.join(svc.argv) + "\n").encode())
        self.log.flush()
        # its own process group (stop() signals the group), and dead with the harness: a harness killed
        # at a call's time limit must not leave a Mooncake master or an LMCache server holding its DRAM
        self.proc = subprocess.Popen(svc.argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **svc.env}, start_new_session=True,
                                     preexec_fn=harness._die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                with open(log_path, "rb") as f:
                    tail = f.read().decode(errors="replace")[-2000:]
                raise harness.ServerStartError(f"{svc.name} exited with {self.proc.returncode}:\n{tail}")
            with socket.socket() as s:
                s.settimeout(1.0)
                if s.connect_ex(("127.0.0.1", svc.port)) == 0 and self.proc.poll() is None:
                    return  # listening, and still ours (not another process on a port picked earlier)
            time.sleep(0.3)
        self.stop()
        raise harness.ServerStartError(f"{svc.name} did not listen on port {svc.port} within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 15.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        if not self.log.closed:
            self.log.close()


def tree_cpu_s(pids: list):
    """User + system CPU seconds of the processes ``pids`` and their live descendants; None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
            except psutil.Error:
                continue
    return total


def drop_page_cache() -> str:
    """sync, then drop clean page-cache pages, so the restart reads storage from the disk (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return f"not dropped ({e.strerror}: needs root)"
    return "dropped"


# ---- requests -------------------------------------------------------------------------------------
def conversation_turns(prompts: list) -> list:
    """Prompt indices grouped by conversation, each group in prompt order, groups in order of their first
    prompt; a prompt without a conversation is a group of its own."""
    groups: dict = {}
    for i, p in enumerate(prompts):
        groups.setdefault(("conversation", p.conversation) if p.conversation is not None else ("prompt", i), []).append(i)
    return list(groups.values())


# Upstream's per-request time stats in the answer's meta_info (servers with --enable-metrics, as every
# tier runs): seconds in the waiting queue; of them, skipped by the scheduler because the request's storage
# prefetch was not done (its first blocked poll to its ready poll) or its staged span not ready.
TIME_SPLIT = {"queue_s": "queue_time", "prefetch_wait_s": "storage_prefetch_wait",
              "staging_wait_s": "storage_staging_wait"}


def time_split(meta_info: dict) -> dict:
    """The row's share of ``TIME_SPLIT`` that the answer carried (a field it lacks is left out)."""
    return {k: float(meta_info[m]) for k, m in TIME_SPLIT.items() if isinstance(meta_info.get(m), (int, float))}


def drive(srv, prompts: list, tokens, loop: str, concurrency: int, timeout_s: float, max_inflight: int) -> tuple:
    """Send every prompt once (streaming, greedy): (rows in prompt order, wall seconds). ``closed``:
    ``concurrency`` clients take the prompts in order; ``sessions``: ``concurrency`` clients each replay
    whole conversations, a turn only after the previous turn's answer (a chat user waits for it);
    ``open``: each prompt at its offset ``at_s``, at most ``max_inflight`` in flight."""
    rows: list = [None] * len(prompts)
    t0 = time.monotonic()

    def one(i: int) -> None:
        sent = time.monotonic() - t0
        row = {"i": i, "sent_s": sent}
        if loop == "open":
            row["late_s"] = sent - prompts[i].at_s
        try:
            r = srv.generate_stream(tokens.prompt(prompts[i]), prompts[i].output_tokens, timeout_s)
            row.update(ttft_s=r.ttft_s, latency_s=r.latency_s, device=r.device_tokens, host=r.host_tokens,
                       storage=r.storage_tokens, cached=r.meta_info.get("cached_tokens"), output_ids=r.output_ids,
                       **time_split(r.meta_info))
        except Exception as e:  # HTTP, stream, JSON or any other failure of one request: its row says which
            row.update(error=f"{type(e).__name__}: {e}"[:500], latency_s=time.monotonic() - t0 - sent)
        rows[i] = row

    # A run stopped meanwhile (SIGTERM at a call's limit: SystemExit here) cancels the requests not yet
    # sent instead of sending them all first; the ones in flight end when the caller stops the server.
    ex = ThreadPoolExecutor(max(1, concurrency if loop in ("closed", "sessions") else max_inflight))
    try:
        if loop == "closed":
            list(ex.map(one, range(len(prompts))))
        elif loop == "sessions":  # each client replays one conversation at a time, a turn after the last one's answer
            def session(turns: list) -> None:
                for i in turns:
                    one(i)

            list(ex.map(session, conversation_turns(prompts)))
        else:
            futures = []
            for i, p in enumerate(prompts):
                delay = t0 + p.at_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                futures.append(ex.submit(one, i))
            for f in futures:
                f.result()
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    return rows, time.monotonic() - t0


def storage_counters(srv):
    """The server's storage counters (``peer_report.STORAGE_COUNTERS``, summed over ranks) from its
    ``/metrics``, or None when it cannot be read (the row then says nothing, rather than zeros)."""
    try:
        text = srv.metrics_text(timeout_s=10)
    except (OSError, ValueError, http.client.HTTPException):
        return None
    by_label: dict = {None: harness.parse_metrics(text)}
    out = {}
    for name in peer_report.STORAGE_COUNTERS:
        metric, label, value = peer_report.split_counter(name)
        if label not in by_label:
            by_label[label] = harness.parse_metrics(text, by_label=label)
        got = by_label[label].get(metric, 0.0 if label is None else {})
        out[name] = got if label is None else got.get(value, 0.0)
    return out


counter_deltas = block_io.delta  # {counter: after - before}, None when either read failed


COUNTER_SETTLE_S = 2.0  # our L3 counters reach /metrics from a 1 s publisher thread
# Before a storage tier's server stops, every tier alike gets at least this long (off the clock) to put its
# last pages on its disk (Mooncake's offload runs on its heartbeat, 1 s here), and then as long as its
# backups still move (upstream's backed-up tokens, our L3 page writes), up to STORAGE_SETTLE_MAX_S: a
# slower writer's backlog is written, not counted as lost at the restart.
STORAGE_SETTLE_S = 5.0
STORAGE_SETTLE_MAX_S = 60.0
SETTLE_POLL_S = 2.0
BACKUP_PROGRESS = ("sglang:backuped_tokens_total", "sglang:cp_l3_spill_pages_total")


def settle(srv, tier: peer_tiers.Tier) -> float:
    """Wait, off the clock, until the phase's counters are on /metrics and a storage tier's backups have
    stopped moving (at least STORAGE_SETTLE_S, at most STORAGE_SETTLE_MAX_S); the seconds waited."""
    t0 = time.monotonic()
    time.sleep(COUNTER_SETTLE_S)
    if not tier.storage:
        return time.monotonic() - t0

    def progress():
        c = storage_counters(srv)
        return None if c is None else tuple(c.get(k) for k in BACKUP_PROGRESS)

    last = progress()
    while time.monotonic() - t0 < STORAGE_SETTLE_MAX_S:
        time.sleep(SETTLE_POLL_S)
        now = progress()
        if time.monotonic() - t0 >= STORAGE_SETTLE_S and now == last:
            break
        last = now
    return time.monotonic() - t0


def run_phase(srv, services: list, tier: peer_tiers.Tier, prompts: list, tokens, args,
              hold: Optional[ram_hold.RamHold] = None,
              forwards: Optional[forward_passes.Listener] = None) -> dict:
    """One measured pass of the workload on a started server. With ``hold`` (``--free-ram-gb``) the host's
    spare RAM is held down to its goal first and given back room after the settle, so the phase and the
    backups it started run on the same page-cache room in every tier. With ``forwards``
    (``--forward-metrics``) the phase's forward passes, as the server published them, are summarized."""
    held = None
    before = forwards.quiet(FPM_QUIET_MAX_S) if forwards is not None else None  # the warm request's, off the clock
    try:
        tightened = hold.tighten() if hold is not None else None
        if tightened is not None:
            log(f"[{tier.name}] RAM held: {tightened['held'] / GB:.1f} GB, {ram_hold.available() / GB:.1f} GB "
                f"left available (goal {hold.leave / GB:.1f}; {tightened['wait_s']:.1f} s to reach it)")
        pids = [srv.proc.pid]
        spids = [s.proc.pid for s in services]
        cpu0, scpu0 = tree_cpu_s(pids), tree_cpu_s(spids)
        counters0 = storage_counters(srv)
        disk = tier.storage_dirs[0] if tier.storage_dirs else None
        io0 = block_io.counters(disk) if disk else None
        rows, wall = drive(srv, prompts, tokens, args.loop, args.concurrency, args.request_timeout,
                           args.max_inflight)
        settled = settle(srv, tier)
        taken = forwards.take() if forwards is not None else None  # the settle let the last spans arrive
        if hold is not None:
            held = {**hold.phase_stats(), "wait_s": tightened["wait_s"], "reached": tightened["reached"]}
    finally:  # whatever ends the phase, the next start (this tier's restart, the next tier) gets its room
        if hold is not None:
            hold.loosen(start_room(args))
    if held is not None:
        for problem in peer_report.ram_hold_problems(held):
            log(f"[{tier.name}] WARNING {problem}")
    disk_io = counter_deltas(io0, block_io.counters(disk) if disk else None)
    cpu1, scpu1 = tree_cpu_s(pids), tree_cpu_s(spids)  # after the settle: the backups' work is charged too
    counters = counter_deltas(counters0, storage_counters(srv))
    ok = [r for r in rows if not r.get("error")]
    served = {k: sum(r[k] for r in ok) for k in ("storage", "host", "device")}
    log(f"[{tier.name}] {len(ok)}/{len(rows)} answered in {wall:.1f} s; tokens served from "
        + ", ".join(f"{k} {v:,}" for k, v in served.items()))
    fs = peer_tiers.fs_use(disk) if disk else None
    du = du_bytes(tier.storage_dirs)
    cached = page_cache.resident_bytes(tier.storage_dirs) if tier.storage_dirs else None
    if tier.storage_dirs:
        log(f"[{tier.name}] storage {du['allocated'] / GB:.2f} GB on disk, "
            + ("page cache not measurable here" if cached is None else
               f"{cached['resident'] / GB:.2f} GB of it in the page cache"
               + (f" ({cached['unread']} files not readable)" if cached["unread"] else "")))
    fwd = None
    if taken is not None:
        fwd = {**forward_passes.summarize(taken, wall), "messages_before": before["messages"],
               "connected": forwards.connected}
        log(f"[{tier.name}] {fwd['forwards']} forward passes published ({fwd['lost']} lost), "
            f"{fwd['busy_s']:.1f} s of GPU spans in the {wall:.1f} s phase")
        if not fwd["forwards"]:
            log(f"[{tier.name}] WARNING no forward pass reached {forwards.endpoint} "
                f"({before['messages']} before the phase): the server's log says whether it bound it")
    if disk_io:
        log(f"[{tier.name}] its disk read {disk_io['read'] / GB:.2f} GB and wrote {disk_io['written'] / GB:.2f} GB "
            "in the phase")
    return {"wall_s": wall, "requests": rows, "startup_s": srv.startup_s, "settle_s": settled, "du": du,
            "page_cache": cached, "disk_io": disk_io,
            "fs_used_pct": None if fs is None else fs["used_pct"],
            "cpu_server_s": None if cpu0 is None else cpu1 - cpu0,
            "cpu_services_s": None if scpu0 is None or not spids else scpu1 - scpu0,
            "storage_counters": counters, **({"ram_hold": held} if held is not None else {}),
            **({"forward_passes": fwd} if fwd is not None else {})}


def start_room(args) -> int:
    """Bytes left available beyond --free-ram-gb while a server or a side service starts: its host pool,
    Mooncake's DRAM segment and the processes' own memory (imports, CUDA context) need room that reclaiming
    the page cache cannot make, and a start squeezed below it is killed, not slowed."""
    return int((args.hicache_size + args.mooncake_segment_gb + START_ROOM_GB) * GB)


# The processes of one server and its side services, beyond its host pool and segment: on the GPU hosts a
# storm server held about 5 GB beyond its 9 GB pool. Each phase waits while the holder takes this room back
# (about 1 GB/s there: 19-28 s a phase at 24 GB), so it is sized at about twice what a start needs.
START_ROOM_GB = 12.0


def warm_up(prompts: list, tokens, args, model: str, model_flags: list, common: dict, base_env: dict) -> dict:
    """One server with HiCache's host pool and no storage (the ``hicache-l2`` tier's flags) serves
    ``peer_workloads.warm_up_prompts`` before the first tier, so the kernels that compile at their first use
    on this machine (prefill, prefix extend, the host pool's transfers) do so off every tier's clock: a
    run's first tier otherwise paid them in its first requests (its first eight answers 2-3 s later than
    the tiers' after it). It stores nothing, so no tier's storage sees its prompts."""
    warm = wl.warm_up_prompts(prompts, args.block_tokens)
    tier = peer_tiers.tier_hicache_l2(settings(args))
    env = server_env(tier, args, base_env)
    srv = harness.ServerProcess(model, model_flags + tier.args, env=env,
                                log_path=os.path.join(args.out_dir, "warm-up.log"), **common)
    t0 = time.monotonic()
    srv.start()
    try:
        rows, wall = drive(srv, warm, tokens, "closed", min(args.concurrency, len(warm) // 2), args.request_timeout,
                           args.max_inflight)
    finally:
        srv.stop()
    errors = [r["error"] for r in rows if r.get("error")]
    log(f"[warm-up] {len(warm)} prompts of {sorted({p.tokens for p in warm})} tokens in {wall:.1f} s "
        f"({time.monotonic() - t0:.1f} s with the server's start and stop)" + (f"; errors: {errors}" if errors else ""))
    return {"prompt_tokens": [p.tokens for p in warm], "wall_s": wall, "startup_s": srv.startup_s, "errors": errors}


def server_env(tier: peer_tiers.Tier, args, base: dict) -> dict:
    env = {**os.environ, **base, **tier.env}
    if args.kv_sensitive:  # test-only weight shaping: the answer is read from the prefix KV
        env["SGLANG_CP_TEST_KV_SENSITIVE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (KV_SENSITIVE_DIR, env.get("PYTHONPATH")) if p)
    return env


def start_services(tier: peer_tiers.Tier, args, into: list) -> None:
    """Start the tier's side services in order, each appended to ``into`` once running, so the caller's
    cleanup stops every one that started even when a later one fails."""
    for x in tier.services:
        into.append(RunningService(x, os.path.join(args.out_dir, f"{tier.name}-service.log"), args.service_timeout))


FPM_CONNECT_S = 10.0  # bound on a started server's forward-pass publisher accepting our subscriber
# launch_server flags that start more than one data-parallel scheduler (each publishes on its own socket)
DP_FLAGS = ("--dp-size", "--dp", "--data-parallel-size", "--enable-dp-attention")
FPM_QUIET_MAX_S = 10.0  # bound on waiting for the forwards before a phase to stop arriving


def subscribed(listener: Optional[forward_passes.Listener], tier: peer_tiers.Tier) -> None:
    """--forward-metrics: wait (bounded) until a started server's publisher has our subscriber; a phase run
    without it says so in its row (forwards 0) and in the log."""
    if listener is not None and not listener.wait_connected(FPM_CONNECT_S):
        log(f"[{tier.name}] WARNING the server's forward-pass publisher at {listener.endpoint} did not accept a "
            f"subscriber in {FPM_CONNECT_S:g} s")


def close_listener(listener: Optional[forward_passes.Listener], tier: peer_tiers.Tier) -> None:
    """A listener's end never ends the tier: a failure to close is logged, and the tier goes on."""
    if listener is None:
        return
    try:
        listener.close()
    except Exception as e:
        log(f"[{tier.name}] WARNING closing the forward-pass listener at {listener.endpoint}: {e}")


def run_tier(tier: peer_tiers.Tier, s: peer_tiers.TierSettings, prompts: list, tokens, args, model: str,
             model_flags: list, common: dict, base_env: dict, saved=lambda rec: None,
             hold: Optional[ram_hold.RamHold] = None) -> dict:
    """One tier: replay, then (storage tiers) restart, each phase handed to ``saved`` once measured. Any
    failure ends the tier with an error row, never the run; its services stop and its storage goes."""
    rec = {"name": tier.name, "how": tier.how, "env": tier.env, "services": [x.argv for x in tier.services],
           "error": tier.error, "needs": tier.needs, "phases": {}}
    if tier.error:
        log(f"[{tier.name}] not run: {tier.error}")
        return rec
    peer_tiers.prepare(tier, s)
    if tier.storage_dirs:
        fs = peer_tiers.fs_use(tier.storage_dirs[0])
        rec["fs_at_start"] = fs
        band, warning = peer_tiers.cleaner_band(tier, fs, s.disk_gb * GB)
        if band:
            peer_tiers.with_extra_config(tier, band)
            rec["cleaner_band_pct"] = band
            log(f"[{tier.name}] its cleaner's band on this filesystem: {band}")
        if warning:
            rec["warnings"] = [warning]
            log(f"[{tier.name}] WARNING {warning}")
    if args.drop_caches and tier.services and tier.storage and not args.restart_services:
        note = (f"{tier.name}: its side services keep their DRAM across the restart (no --restart-services): "
                "the dropped page cache is not a host restart for this tier")
        rec.setdefault("warnings", []).append(note)
        log(f"[{tier.name}] WARNING {note}")
    env = server_env(tier, args, base_env)
    services: list = []
    warm_tokens = min(8, max(p.output_tokens for p in prompts))  # decode steps compile off the clock too

    # --forward-metrics: each server publishes to its own socket in a private directory; the listener
    # subscribes before the server starts, so no forward of the phase is missed.
    fpm_dir = tempfile.mkdtemp(prefix="cpl3-fpm-") if args.forward_metrics else None
    listeners: dict = {}

    def server(flags, tag):
        if fpm_dir is not None:
            endpoint = f"ipc://{fpm_dir}/{tag}"
            listeners[tag] = forward_passes.Listener(endpoint)
            flags = flags + forward_passes.server_flags(endpoint)
        return harness.ServerProcess(model, model_flags + flags, env=env,
                                     log_path=os.path.join(args.out_dir, f"{tier.name}-{tag}.log"), **common)

    try:
        start_services(tier, args, services)
        srv = server(tier.args, "replay")
        rec["command"] = srv.command()
        srv.start()
        subscribed(listeners.get("replay"), tier)
        try:
            warm = wl.BlockTokens(64, tokens.vocab, seed=tokens.seed + 1)
            srv.generate(warm.prompt(wl.Prompt(("warm/0", "warm/1"), 128, 1)), warm_tokens)  # off the clock
            rec["phases"]["replay"] = run_phase(srv, services, tier, prompts, tokens, args, hold,
                                                listeners.get("replay"))
        finally:
            srv.stop()
            close_listener(listeners.pop("replay", None), tier)
        saved(rec)
        if "restart" in args.phases and not tier.storage:
            # No storage: a restarted server starts empty, which the replay phase (a fresh server) measured.
            log(f"[{tier.name}] restart: not run (no storage; a restarted server is the replay's fresh one)")
        elif "restart" in args.phases:
            rec["restart_services"] = bool(args.restart_services)
            if args.restart_services:
                while services:
                    services.pop().stop()
                start_services(tier, args, services)
            if args.drop_caches:
                rec["restart_drop_caches"] = drop_page_cache()
                log(f"[{tier.name}] page cache before the restart: {rec['restart_drop_caches']}")
            srv = server(tier.restart_args or tier.args, "restart")
            rec["restart_command"] = srv.command()
            srv.start()
            subscribed(listeners.get("restart"), tier)
            try:
                rec["phases"]["restart"] = run_phase(srv, services, tier, prompts, tokens, args, hold,
                                                     listeners.get("restart"))
            finally:
                srv.stop()
    except harness.ServerStartError as e:
        rec["error"] = "did not start: " + str(e).splitlines()[0]
        rec["log"] = str(e)[-3000:]
        log(f"[{tier.name}] {rec['error']}")
    except Exception as e:  # one tier's failure is its row; the run goes on to the next tier
        rec["error"] = f"failed: {type(e).__name__}: {e}"[:500]
        rec["log"] = traceback.format_exc()[-3000:]
        log(f"[{tier.name}] {rec['error']}")
    finally:
        for x in services:
            x.stop()
        for x in listeners.values():
            close_listener(x, tier)
        if fpm_dir is not None:
            shutil.rmtree(fpm_dir, ignore_errors=True)
        if tier.storage_dirs and not args.keep_storage:
            log(f"[{tier.name}] storage removed ({peer_tiers.free_storage(tier) / GB:.1f} GB), so the next tier "
                "finds the disk as this one did")
    return rec


# ---- CLI ------------------------------------------------------------------------------------------
def switch_interval_ms(text: str) -> float:
    """``--gil-switch-interval-ms``: 0 or a value the L3 config takes, checked here rather than at the
    first cp-l3 tier's server start."""
    from sglang_cp.l3.config import MAX_SWITCH_INTERVAL_MS, MIN_SWITCH_INTERVAL_MS

    try:
        ms = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: milliseconds, e.g. 0.5") from None
    if ms != 0 and not MIN_SWITCH_INTERVAL_MS <= ms <= MAX_SWITCH_INTERVAL_MS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: 0 (the interpreter's own) or {MIN_SWITCH_INTERVAL_MS}-{MAX_SWITCH_INTERVAL_MS} ms")
    return ms


def positive_gb(text: str) -> float:
    try:
        gb = float(text)
    except ValueError:
        gb = 0.0
    if not gb > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size in GB greater than 0, e.g. 6")
    return gb


def settings(args, model: Optional[str] = None) -> peer_tiers.TierSettings:
    """The tiers' shared settings; ``model`` (its directory) sizes what depends on its KV bytes per token."""
    return peer_tiers.TierSettings(work_dir=args.work_dir, host_gb=args.hicache_size, disk_gb=args.disk_gb,
                                   free_port=harness.free_port, prefetch_policy=args.prefetch_policy,
                                   prefetch_threshold=args.prefetch_threshold,
                                   write_policy=args.write_policy, mem_layout=args.mem_layout,
                                   io_threads=args.io_threads,
                                   gil_switch_interval_ms=args.gil_switch_interval_ms,
                                   mooncake_segment_gb=args.mooncake_segment_gb,
                                   kv_bytes_per_token=lmcache_bytes_per_token(model, getattr(args, "kv_cache_dtype", "")),
                                   l3_toml=ttft.write_l3_toml)


def lmcache_bytes_per_token(model: Optional[str], kv_cache_dtype: Optional[str]) -> int:
    """KV bytes one token takes in an LMCache chunk: the KV row at the cache's dtype (bf16 unless an fp8
    ``--kv-cache-dtype``) plus a DSA model's indexer row, which LMCache keeps in the same object; 0 where
    the model's config cannot be read (a name that is not a model directory: the tier that needs it says so)."""
    if not model:
        return 0
    try:
        kv = ttft.kv_bytes_per_token(model, indexer=False)
        indexer = ttft.kv_bytes_per_token(model, indexer=True) - kv
    except (OSError, ValueError, KeyError):
        return 0
    return (kv // 2 if kv_cache_dtype and kv_cache_dtype.startswith("fp8") else kv) + indexer


def tier_names(args):
    """The tiers --tiers names, in its order; None for every tier."""
    return [t.strip() for t in args.tiers.split(",") if t.strip()] if args.tiers else None


def select_tiers(args, s) -> list:
    tiers = peer_tiers.all_tiers(s)
    want = tier_names(args)
    if want is not None:
        names = [t.name for t in tiers]
        bad = [w for w in want if w not in names]
        if bad:
            raise SystemExit(f"--tiers: unknown {', '.join(bad)}; choose from {', '.join(names)}")
        tiers = [t for w in want for t in tiers if t.name == w]
    return tiers


def model_setup(args, model: str, prompts: list) -> tuple:
    """(model flags, ServerProcess settings, base environment) shared by every tier."""
    longest = max(p.tokens + p.output_tokens for p in prompts)
    if not args.device_tokens:
        args.device_tokens = default_device_tokens(prompts)
    flags = list(args.server_arg or [])
    if args.kv_cache_dtype:
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    common = dict(context_length=longest + 256, max_total_tokens=args.device_tokens,
                  mem_fraction_static=args.mem_fraction, startup_timeout_s=args.startup_timeout,
                  attention_backend=args.attention_backend)
    env: dict = {}
    if ttft.is_dsa(model):
        ns = argparse.Namespace(dsa_prefill_backend="fa3", dsa_decode_backend="fa3")
        dsa_flags, dsa_env = ttft.dsa_server(ns)
        flags += dsa_flags
        env = {k: v for k, v in dsa_env.items() if os.environ.get(k) != v}
        common["attention_backend"] = "dsa"
    return flags, common, env


def write_private_json(path: str, obj) -> None:
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(obj, f, indent=1)


def _terminated(signum, _frame):
    raise SystemExit(128 + signum)


def machine() -> dict:
    """What the run ran on and at which code, so runs merged into one table can be checked for it: the
    GPU (nvidia-smi), the host, the git commit when the checkout has one, a digest of the product and
    benchmark sources (a copy without .git still says which code), and the serving packages' versions."""
    import hashlib
    import importlib.metadata as md
    import platform

    def run(cmd):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    digest = hashlib.sha256()
    for sub in ("python/sglang_cp", "benchmark"):
        for dirpath, dirs, names in sorted(os.walk(os.path.join(REPO, sub))):
            for n in sorted(names):
                if n.endswith((".py", ".c", ".toml")):
                    path = os.path.join(dirpath, n)
                    digest.update(os.path.relpath(path, REPO).encode() + b"\0")
                    with open(path, "rb") as f:
                        digest.update(f.read())
    versions = {}
    for pkg in ("sglang", "torch", "sglang-cp", "nixl", "mooncake-transfer-engine", "lmcache",
                "lmcache-rust-raw-block-io"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    gpu = run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    commit = run(["git", "rev-parse", "--short", "HEAD"])
    # A copy whose sources differ from its HEAD (a working tree sent without its newest commits, or edits
    # not committed) is not that commit: the digest says which code ran, and the table says HEAD is not it.
    changed = run(["git", "status", "--porcelain", "--untracked-files=all", "--", "python/sglang_cp", "benchmark"])
    return {"gpu": gpu.splitlines()[0] if gpu else None, "host": platform.node(),
            "commit": commit, "commit_differs": bool(commit and changed), "source_digest": digest.hexdigest()[:16],
            "versions": versions}


def cmd_run(args) -> int:
    model = ttft.MODELS.get(args.model, args.model)
    if args.workload == "storm" and not args.device_tokens:
        raise SystemExit("--workload storm needs --device-tokens (the device pool it must outgrow)")
    prompts, desc = build_workload(args, model)
    flags, common, base_env = model_setup(args, model, prompts)
    vocab = ttft.model_config(model)["vocab_size"]
    tokens = wl.BlockTokens(args.block_tokens, vocab, args.seed)
    os.makedirs(args.out_dir, mode=0o700, exist_ok=True)
    os.makedirs(args.work_dir, mode=0o700, exist_ok=True)
    s = settings(args, model)
    tiers = select_tiers(args, s)
    result = {"schema": 1,
              "meta": {"model": os.path.basename(model), "workload": desc, "kv_sensitive": args.kv_sensitive,
                       "host_bytes_per_token": ttft.kv_bytes_per_token(model, indexer=False),
                       "block_tokens": args.block_tokens, "device_tokens": args.device_tokens,
                       "host_gb": args.hicache_size, "disk_gb": args.disk_gb, "prefetch_policy": args.prefetch_policy,
                       "prefetch_threshold": args.prefetch_threshold,
                       "loop": args.loop, "concurrency": args.concurrency, "phases": args.phases,
                       "drop_caches": args.drop_caches,
                       "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S")},
              "ideal": ideal(prompts, args.block_tokens),
              "prompts": [{"tokens": p.tokens, "blocks": len(p.blocks), "output_tokens": p.output_tokens,
                           "at_s": p.at_s, "mode": wl.prompt_mode(tokens.prompt(p)), "block_ids": ids}
                          for p, ids in zip(prompts, wl.block_numbers(prompts))],
              "tiers": []}
    log(f"{desc}; ideal token hit ratio {result['ideal']['replay']['token_ratio']:.3f} "
        f"(restart {result['ideal']['restart']['token_ratio']:.3f})")
    result["meta"]["machine"] = machine()
    out_json = os.path.join(args.out_dir, "peers.json")
    # A call's time limit (timeout's SIGTERM) ends the run through every cleanup (servers, side services,
    # storage) instead of killing it where it stands; what was measured by then is already saved.
    signal.signal(signal.SIGTERM, _terminated)
    if args.warm_up and any(not t.error for t in tiers):
        try:
            result["meta"]["warm_up"] = warm_up(prompts, tokens, args, model, flags, common, base_env)
        except harness.ServerStartError as e:  # the tiers' own starts will say what is wrong
            result["meta"]["warm_up"] = {"error": "did not start: " + str(e).splitlines()[0]}
            log(f"[warm-up] {result['meta']['warm_up']['error']}")
    def saved(rec):  # a tier's finished phases, saved before its next one
        write_private_json(out_json, {**result, "tiers": result["tiers"] + [rec]})

    hold = None
    try:
        if args.free_ram_gb:  # after the warm-up, which measures nothing; the holder grows in the background
            hold = ram_hold.RamHold(int(args.free_ram_gb * GB))
            hold.start()
            hold.loosen(start_room(args))
            result["meta"]["free_ram_gb"] = args.free_ram_gb
            log(f"RAM holder started: each phase runs with {args.free_ram_gb:g} GB available beyond what the "
                f"processes hold ({ram_hold.available() / GB:.1f} GB available now, swap "
                f"{ram_hold.meminfo().get('SwapTotal', 0) / GB:.1f} GB)")
        for i, tier in enumerate(tiers):
            result["tiers"].append(run_tier(tier, s, prompts, tokens, args, model, flags, common, base_env, saved,
                                            hold))
            write_private_json(out_json, result)
            if i < len(tiers) - 1:  # the last tier's table is the final one, written below
                peer_report.write_report(result, args.out_dir)  # the table so far, should the run be stopped
    finally:
        if hold is not None:
            hold.stop()
    for path in peer_report.write_report(result, args.out_dir):
        log(f"wrote {path}")
    print(open(os.path.join(args.out_dir, "peers.md")).read(), flush=True)
    return 0


def cmd_commands(args) -> int:
    """Each tier's side services and launch_server command line, as a shell would run them."""
    model = ttft.MODELS.get(args.model, args.model)
    s = settings(args, model)
    for t in select_tiers(args, s):
        print(f"# {t.name}: {t.how}")
        if t.error:
            print(f"#   not runnable here: {t.error}; needs {t.needs}")
        if t.storage_dirs:  # prepare() makes them; Mooncake's client refuses to start without its directory
            print(f"mkdir -p -m 700 {shlex.join(t.storage_dirs)}")
        for path, text in t.files.items():
            print(f"cat > {shlex.quote(path)} <<'EOF'\n{text}EOF")
        for path, size in t.presized.items():  # a new file, as prepare() makes it: no index of an earlier run
            print(f"rm -f {shlex.quote(path)} && fallocate -l {size} {shlex.quote(path)}")
        if t.name.startswith("cp-l3-"):
            print(f"# {t.args[t.args.index('--cp-l3-config') + 1]}: written by bench_server_ttft.write_l3_toml")
        for x in t.services:  # with the environment run() gives it (Mooncake's client takes its SSD offload there)
            print(" ".join(_env_words(x.env) + [shlex.join(x.argv), "&"]))
        cmd = harness.ServerProcess(model, t.args, context_length=args.context_length,
                                    max_total_tokens=args.device_tokens or 65536, port=30000,
                                    mem_fraction_static=args.mem_fraction,
                                    attention_backend=args.attention_backend).command()
        print(" ".join(_env_words(t.env) + ["python"] + [shlex.quote(c) for c in cmd[1:]]) + "\n")
    return 0


def _env_words(env: dict) -> list:
    return [f"{k}={shlex.quote(v)}" for k, v in env.items()]


def cmd_report(args) -> int:
    results = []
    for path in args.json:
        with open(path) as f:
            results.append(json.load(f))
    added = [add_block_ids(r, args.trace) for r in results] if args.trace else []
    try:
        result = peer_report.merge(results)
    except ValueError as e:
        raise SystemExit(f"report: {e}")
    os.makedirs(args.out_dir, mode=0o700, exist_ok=True)
    if len(results) > 1 or any(added):  # the one table's data, beside the inputs it came from
        write_private_json(os.path.join(args.out_dir, "peers_merged.json"), result)
    for path in peer_report.write_report(result, args.out_dir):
        log(f"wrote {path}")
    return 0


def add_tier_args(p) -> None:
    p.add_argument("--model", default="small", help="NAME in %s or a model directory" % sorted(ttft.MODELS))
    p.add_argument("--work-dir", required=True, help="directory on the disk under test: each tier's storage goes here")
    p.add_argument("--tiers", default="", help="comma-separated tier names (default: all)")
    p.add_argument("--hicache-size", type=int, default=8, help="host DRAM for KV, GB: HiCache's pool, LMCache's L1")
    p.add_argument("--disk-gb", type=float, default=64.0, help="storage budget of every tier, GB")
    p.add_argument("--device-tokens", type=int, default=0,
                   help="device pool (--max-total-tokens); default 2 x the longest request")
    p.add_argument("--prefetch-policy", default="wait_complete", choices=["best_effort", "wait_complete", "timeout"])
    p.add_argument("--prefetch-threshold", type=int, default=None, metavar="TOKENS",
                   help="upstream's prefetch_threshold for every HiCache storage tier alike (a storage hit shorter "
                        "than this is not fetched; default: upstream's 256)")
    p.add_argument("--write-policy", default="write_through",
                   choices=["write_back", "write_through", "write_through_selective"])
    p.add_argument("--mem-layout", default="page_first", choices=["page_first", "layer_first", "page_first_direct"])
    p.add_argument("--io-threads", type=int, default=8, help="our L3's I/O threads")
    p.add_argument("--gil-switch-interval-ms", type=switch_interval_ms, default=0.0, metavar="MS",
                   help="our L3's io.gil_switch_interval_ms (default 0: the interpreter's 5 ms; the configuration "
                        "guide sets 0.5 for drives faster than about 2 GB/s)")
    p.add_argument("--mooncake-segment-gb", type=float, default=4.0, help="Mooncake's DRAM segment, GB")
    p.add_argument("--mem-fraction", type=float, default=0.8, help="--mem-fraction-static of every server")
    p.add_argument("--attention-backend", default="triton", help="upstream's --attention-backend (fa3 on sm90)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmark.hicache.bench_peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the workload on every tier (needs a GPU)")
    add_tier_args(r)
    r.add_argument("--out-dir", default="out/peers")
    r.add_argument("--workload", choices=["trace", "storm"], default="trace")
    r.add_argument("--trace", help="Mooncake FAST'25 JSON Lines trace")
    r.add_argument("--conversations", type=int, default=None, help="sample this many whole conversations")
    r.add_argument("--sample-fraction", type=float, default=None, help="or this fraction of the conversations")
    r.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block (the trace's own: 512)")
    r.add_argument("--time-compression", type=float, default=1.0, help="open loop: the trace's gaps / this")
    r.add_argument("--max-input-tokens", type=int, default=None, help="cap on a prompt's length")
    r.add_argument("--max-new-tokens", type=int, default=8, help="cap on the tokens each request generates")
    r.add_argument("--loop", choices=sorted(LOOPS), default="sessions",
                   help="sessions: clients replay whole conversations, turn after answer; closed: clients take "
                        "requests in trace order; open: at the trace's (compressed) timestamps")
    r.add_argument("--concurrency", type=int, default=8, help="closed loops: clients (storm: clients)")
    r.add_argument("--max-inflight", type=int, default=256, help="open loop: bound on requests in flight")
    r.add_argument("--docs", type=int, default=0, help="storm documents (default: sized past the pools)")
    r.add_argument("--allow-small-storm", action="store_true", help="accept --docs whose KV fits in the pools")
    r.add_argument("--suffixes", type=int, default=4)
    r.add_argument("--requests", type=int, default=200)
    r.add_argument("--zipf", type=float, default=1.1, help="storm document popularity exponent")
    r.add_argument("--doc-tokens", type=int, default=16384)
    r.add_argument("--suffix-tokens", type=int, default=256)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--phases", default="replay,restart", help="replay, or replay,restart")
    r.add_argument("--keep-storage", action="store_true",
                   help="keep each tier's stored KV after it has run (default: removed, so a later tier, or a "
                        "later run on the same --work-dir, is not measured on a fuller disk)")
    r.add_argument("--drop-caches", action="store_true",
                   help="sync and drop the page cache before each restart (root): storage read from the disk, as "
                        "after a host restart or with a working set larger than RAM")
    r.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="skip the warm-up server (HiCache L2, no storage) that serves the workload's prompt "
                        "lengths before the first tier "
                        "(kernels compiled at first use then count in the first tier's first requests)")
    r.add_argument("--free-ram-gb", type=positive_gb, default=None, metavar="GB",
                   help="hold the host's spare RAM during each phase so that only this many GB stay available "
                        "(free memory plus reclaimable page cache), alike for every tier: a host whose working set "
                        "is larger than its RAM, where a tier reading through the page cache gets no more DRAM than "
                        "its host pool and this (default: off; the holder is the first the OOM killer takes)")
    r.add_argument("--restart-services", action="store_true",
                   help="restart the side services too (Mooncake master, LMCache server) at the restart")
    r.add_argument("--kv-sensitive", action="store_true",
                   help="test-only weights whose answer is read from the prefix KV (DeepSeek-family models)")
    r.add_argument("--kv-cache-dtype", default="")
    r.add_argument("--forward-metrics", action="store_true",
                   help="record every forward pass's GPU span as upstream publishes it (--enable-forward-pass-"
                        "metrics): whether storage work in the server process slows its forwards")
    r.add_argument("--server-arg", action="append", metavar="ARG", help="one more launch_server argument")
    r.add_argument("--request-timeout", type=float, default=600)
    r.add_argument("--startup-timeout", type=float, default=900)
    r.add_argument("--service-timeout", type=float, default=120)
    c = sub.add_parser("commands", help="print each tier's command lines (no GPU)")
    add_tier_args(c)
    c.add_argument("--context-length", type=int, default=65536)
    p = sub.add_parser("report", help="table and plots from saved peers.json files (several: one table)")
    p.add_argument("json", nargs="+", help="peers.json of one run, or of runs that each measured some tiers")
    p.add_argument("--out-dir", default="out/peers")
    p.add_argument("--trace", help="the trace a run read: rebuilds the block ids a run saved before they were "
                                   "kept (the in-flight / lost split needs them)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "report":
        return cmd_report(args)
    if args.cmd == "commands":
        return cmd_commands(args)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not set(args.phases) <= set(peer_report.PHASES) or "replay" not in args.phases:
        raise SystemExit(f"--phases {','.join(args.phases)}: give replay or replay,restart")
    dp = [a for a in args.server_arg or () if a.split("=")[0] in DP_FLAGS]
    if args.forward_metrics and dp:
        raise SystemExit(f"--forward-metrics with --server-arg {dp[0]}: it listens to data-parallel rank 0 "
                         "only; drop one of them")
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
