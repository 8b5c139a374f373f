"""Report of the peers benchmark (``bench_peers.py``) from its saved JSON: a markdown table for
docs/benchmarks.md and three plots (matplotlib, the ``plot`` extra): TTFT CDF per tier, requests/s per
tier, hit ratio per tier against the workload's ideal.

Per tier and phase: requests/s (completed requests over the phase's wall time), TTFT percentiles, the
tokens each cache level served (``cached_tokens_details``), the hit ratio (served / prompt tokens) beside
the ideal (``peer_workloads.ideal_hits``), bytes on disk (du of the tier's storage directories after the
phase) and of them the bytes the page cache held then (``page_cache.resident_bytes``: DRAM a tier that
writes and reads through the page cache serves from beyond the host pool every tier is given), what the
storage's block device read and wrote during the phase (``block_io``: the whole device's counters), CPU seconds of the server's process tree and of the tier's side services, and output ids against
the reference tier (the first tier, in run order, with the phase): requests whose ids differ, of those
compared. With ``kv_sensitive`` the run also counts first tokens that are the prompt's most frequent
token (the shaped model's answer when the prefix KV is right). Below the table, the deltas of each
server's storage counters over the phase (``STORAGE_COUNTERS``, read from ``/metrics``).

Where the hits went (``shortfall``), when the saved prompts carry their block ids: of each answered
request's ideal, the tokens *in flight* (ideal, but the prompt holding them had not answered when this
one was sent: no tier could have had them) and *lost* (reachable at send -- a prompt that had answered
held them -- and not served: evicted from every level, never written, or declined by the prefetch);
``peer_workloads.reachable_at_send`` says how. A tier whose hit ratio trails the ideal with nothing lost
lost nothing: the replay's concurrency kept those blocks out of every tier.
"""

from __future__ import annotations

import math
import os

from benchmark.hicache import peer_workloads as wl
from benchmark.support import ram_hold  # the holder's step, for its goal's slack

GB = 1e9
PHASES = ("replay", "restart")
FILES = ("peers.md", "peers_ttft_cdf.png", "peers_throughput.png", "peers_hit_ratio.png")


def percentile(xs: list, q: float):
    """Linear interpolation between closest ranks (numpy's default); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ok(rows: list) -> list:
    return [r for r in rows if not r.get("error")]


REFERENCE_PHASE = "replay"  # every run has it (bench_peers refuses --phases without it)


def reference_tier(result: dict):
    """The tier whose replay answers every row is compared with, in every phase: the prompts and greedy
    decoding are the same in a restart, so its right answers are the replay's. (Comparing a restart with
    the first tier that has one would make a storage tier's restart the unchecked reference: tiers without
    storage have no restart.)"""
    for t in result["tiers"]:
        if REFERENCE_PHASE in (t.get("phases") or {}):
            return t
    return None


def mismatches(ref_rows: list, rows: list) -> tuple:
    """(requests whose output ids differ from the reference's, requests compared): both answered."""
    ref = {r["i"]: r["output_ids"] for r in _ok(ref_rows)}
    both = [(ref[r["i"]], r["output_ids"]) for r in _ok(rows) if r["i"] in ref]
    return sum(a != b for a, b in both), len(both)


def first_storage_hit_s(rows: list):
    """Seconds from the phase's first send to the end of the first request served partly from storage."""
    hits = [r["sent_s"] + r["latency_s"] for r in _ok(rows) if r.get("storage")]
    return min(hits) if hits else None


# Counters the run reads from each server's /metrics (--enable-metrics) before and after a phase; the
# report prints their deltas. Upstream's HiCache controller keeps the token counters for every storage
# backend alike, so they say per tier where storage tokens went: written, dropped before they reached
# storage, found by the hit query, loaded, found but not loaded (declined, timed out, no host memory),
# deferred. Ours add pages written and reclaimed by L3's GC, and failed writes.
STORAGE_COUNTERS = {
    "sglang:backuped_tokens_total": "backed up",
    "sglang:hicache_backup_dropped_tokens_total": "backup dropped",
    "sglang:storage_prefetch_hit_tokens_total": "storage hit (query)",
    "sglang:prefetched_tokens_total": "prefetched",
    "sglang:storage_prefetch_unfulfilled_tokens_total": "hit, not loaded",
    # ... and why, by upstream's reason label (UnifiedRadixCache; attempt-level: a request whose prefetch is
    # retried counts each attempt): host_capacity = no room in the host pool for the hit
    **{f'sglang:storage_prefetch_unfulfilled_tokens_total{{reason="{r}"}}': f"not loaded: {r.replace('_', ' ')}"
       for r in ("host_capacity", "below_threshold", "anchor_lost", "deadline", "storage_transfer",
                 "device_overlap", "cache_admission_shortfall", "aux_window_trim", "device_covered",
                 "device_capacity", "dropped")},
    "sglang:storage_prefetch_deferred_tokens_total": "deferred",
    "sglang:cp_l3_spill_pages_total": "L3 pages written",
    "sglang:cp_l3_gc_reclaimed_total": "L3 pages reclaimed",
    "sglang:cp_l3_write_errors_total": "L3 write errors",
    # upstream's own prefetch outcomes, which only our tier exports (integration/cp_l3/prefetch_outcomes.py):
    # why a prefix storage held was not fetched
    'sglang:cp_l3_prefetch_outcomes_total{outcome="declined_too_short"}': "prefetch declined: too short",
    'sglang:cp_l3_prefetch_outcomes_total{outcome="declined_rate_limited"}': "prefetch declined: rate limited",
    'sglang:cp_l3_prefetch_outcomes_total{outcome="declined_anchor_lost"}': "prefetch declined: anchor lost",
    'sglang:cp_l3_prefetch_outcomes_total{outcome="revoked_insufficient"}': "prefetch revoked: short hit",
    'sglang:cp_l3_prefetch_outcomes_total{outcome="revoked_full_miss"}': "prefetch revoked: miss",
}


def split_counter(name: str):
    """A STORAGE_COUNTERS key -> (metric, label name, label value), the last two None for a metric summed
    over all its series."""
    metric, _, rest = name.partition("{")
    if not rest:
        return metric, None, None
    label, _, value = rest.rstrip("}").partition("=")
    return metric, label, value.strip('"')


def counters_table(result: dict) -> str:
    """Per tier and phase, the deltas of ``STORAGE_COUNTERS`` ('' when no phase has them); a counter no
    tier moved is left out."""
    rows = [(label(t), phase, ph["storage_counters"]) for t in result["tiers"]
            for phase, ph in (t.get("phases") or {}).items() if ph.get("storage_counters")]
    names = [n for n in STORAGE_COUNTERS if any(c.get(n) for _, _, c in rows)]
    if not rows or not names:
        return ""
    head = ["tier", "phase"] + [STORAGE_COUNTERS[n] for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for tier, phase, c in rows:
        lines.append("| " + " | ".join([tier, phase] + [f"{c.get(n, 0):,.0f}" for n in names]) + " |")
    return "\n".join(lines)


def forward_passes_table(result: dict) -> str:
    """Per tier and phase, the forward passes ``bench_peers run --forward-metrics`` recorded ('' when no
    phase has them): forward_passes.py says what a span is and why it is read."""
    rows = [(label(t), phase, ph["forward_passes"]) for t in result["tiers"]
            for phase, ph in (t.get("phases") or {}).items() if ph.get("forward_passes")]
    if not rows:
        return ""

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = ["| tier | phase | forwards (lost / undecodable) | prefill forwards: n, new / cached tokens | prefill "
             "spans s, ms per 1K new tokens | decode-only forwards: n, span p50 / p90 ms | spans / phase wall |",
             "|" + " --- |" * 7]
    for tier, phase, f in rows:
        p, d = f["prefill"], f["decode"]
        if not f.get("connected", True):  # zeros here would read as a measurement
            lines.append(f"| {tier} | {phase} | not connected: the server's publisher never accepted the "
                         "subscriber | - | - | - | - |")
            continue
        lines.append(f"| {tier} | {phase} | {f['forwards']:,} ({f['lost']:,} / {f.get('undecodable', 0):,}) | "
                     f"{p['n']:,}, {p['tokens']:,} / "
                     f"{p['kv_tokens']:,} | {p['span_s']:.2f}, {num(p['ms_per_1k_tokens'], '.1f')} | {d['n']:,}, "
                     f"{num(d['p50_ms'], '.1f')} / {num(d['p90_ms'], '.1f')} | {num(f['busy_share'], '.2f')} |")
    return "\n".join(lines)


# upstream's default prefetch_threshold (HiCacheController), the run's unless it set --prefetch-threshold: a
# storage hit shorter than this many tokens is not fetched, so a request that misses only such a tail lost
# it to the threshold.
PREFETCH_THRESHOLD = 256


def threshold_of(result: dict) -> int:
    """The prefetch threshold every storage tier of the run had."""
    t = result.get("meta", {}).get("prefetch_threshold")
    return PREFETCH_THRESHOLD if t is None else t


def shortfall(result: dict, phase: str, rows: list):
    """{"in_flight", "lost", "lost_short"} tokens over a phase's answered requests (module docstring;
    ``lost_short``: the lost tokens of requests that lost fewer than the run's prefetch threshold), or None
    when the saved prompts have no block ids."""
    saved = result["prompts"]
    if not saved or not all("block_ids" in p for p in saved):
        return None
    prompts = [wl.Prompt(tuple(p["block_ids"]), p["tokens"], p["output_tokens"]) for p in saved]
    block_tokens = result["meta"]["block_tokens"]
    warm = prompts if phase == "restart" else ()  # the restart finds what the replay wrote
    ideal = wl.ideal_hits(prompts, block_tokens, warm=warm)["per_prompt_tokens"]
    ok = [r for r in _ok(rows) if r.get("ttft_s") is not None]
    sends: list = [None] * len(prompts)
    for r in ok:
        sends[r["i"]] = (r["sent_s"], r["sent_s"] + r["ttft_s"])
    reach = wl.reachable_at_send(prompts, sends, block_tokens, warm=warm)
    in_flight = lost = lost_short = 0
    threshold = threshold_of(result)
    for r in ok:
        i, served = r["i"], sum(r.get(k) or 0 for k in ("device", "host", "storage"))
        missed = max(0, reach[i] - served)
        lost += missed
        lost_short += missed if missed < threshold else 0
        in_flight += max(0, ideal[i] - max(served, reach[i]))
    return {"in_flight": in_flight, "lost": lost, "lost_short": lost_short}


COLD = " (restart on a cold page cache)"  # on both of its rows: the replay ran as any other

# Tiers whose DRAM tier lives in a side service, not in the SGLang server (bench_peers keeps side services
# across a restart unless --restart-services).
SERVICE_DRAM = {"lmcache": "its LMCache server's L1", "lmcache-raw-block": "its LMCache server's L1",
                "mooncake-standalone": "its mooncake_client's DRAM segment"}


def kept_service_dram(result: dict, tier: dict) -> bool:
    """Whether ``tier``'s restart ran beside DRAM that outlived its server (runs saved before the tier
    record said so are read from the run's argv)."""
    if tier["name"] not in SERVICE_DRAM or "restart" not in (tier.get("phases") or {}):
        return False
    restarted = tier.get("restart_services")
    if restarted is None:
        restarted = "--restart-services" in (result.get("meta", {}).get("argv") or ())
    return not restarted


def label(tier: dict) -> str:
    """A tier's name in the table: its restart on a dropped page cache is a different measurement."""
    return tier["name"] + (COLD if tier.get("restart_drop_caches") == "dropped" else "")


COLD_MARK = " *"  # a plot's short form of COLD; the figure's footnote says what it means
COLD_NOTE = "* restart on a cold page cache (synced and dropped before the restart)"


def plot_label(tier: dict) -> str:
    """A tier's name on a plot: COLD spelled out on every tick and legend entry crowds the axes."""
    return tier["name"] + (COLD_MARK if tier.get("restart_drop_caches") == "dropped" else "")


def summarize(result: dict) -> list:
    prompts = result["prompts"]
    ref = reference_tier(result)
    out = []
    for t in result["tiers"]:
        if t.get("error") and not t.get("phases"):
            out.append({"tier": label(t), "phase": None, "error": t["error"], "needs": t.get("needs")})
            continue
        for phase, ph in (t.get("phases") or {}).items():
            rows = ph.get("requests", [])
            ok = _ok(rows)
            ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
            served = {k: sum(r.get(k) or 0 for r in ok) for k in ("device", "host", "storage")}
            tokens = sum(prompts[r["i"]]["tokens"] for r in ok)
            is_ref = ref is t and phase == REFERENCE_PHASE
            diff, compared = (0, len(ok)) if is_ref else mismatches(ref["phases"][REFERENCE_PHASE]["requests"], rows)
            row = {"tier": label(t), "phase": phase, "n": len(rows), "errors": len(rows) - len(ok),
                   "rps": len(ok) / ph["wall_s"] if ph.get("wall_s") else None,
                   "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
                   **served, "prompt_tokens": tokens,
                   "hit_ratio": sum(served.values()) / tokens if tokens else None,
                   "ideal_ratio": (result.get("ideal") or {}).get(phase, {}).get("token_ratio"),
                   **(shortfall(result, phase, rows) or {"in_flight": None, "lost": None, "lost_short": None}),
                   "disk_bytes": (ph.get("du") or {}).get("allocated"),
                   "page_cache_bytes": (ph.get("page_cache") or {}).get("resident"),
                   "disk_read_bytes": (ph.get("disk_io") or {}).get("read"),
                   "disk_written_bytes": (ph.get("disk_io") or {}).get("written"),
                   "cpu_server_s": ph.get("cpu_server_s"), "cpu_services_s": ph.get("cpu_services_s"),
                   "ids_differ": diff, "ids_compared": compared, "reference": label(ref), "is_reference": is_ref,
                   "startup_s": ph.get("startup_s"), "first_storage_hit_s": first_storage_hit_s(rows),
                   **time_split_medians(ok)}
            if result.get("meta", {}).get("kv_sensitive"):
                want = [(prompts[r["i"]].get("mode"), (r.get("output_ids") or [None])[0]) for r in ok]
                want = [(m, o) for m, o in want if m is not None]
                row["mode_ok"], row["mode_checked"] = sum(m == o for m, o in want), len(want)
            out.append(row)
    return out


TIME_SPLIT = ("queue_s", "prefetch_wait_s", "staging_wait_s")  # bench_peers.time_split's fields


def time_split_medians(ok: list) -> dict:
    """Per ``TIME_SPLIT`` field, its median and mean over the answered rows that carry it (None when none
    does: runs saved before the rows kept upstream's time stats)."""
    out = {}
    for k in TIME_SPLIT:
        xs = [r[k] for r in ok if r.get(k) is not None]
        out[f"{k}_p50"] = percentile(xs, 50)
        out[f"{k}_mean"] = sum(xs) / len(xs) if xs else None
    return out


def time_split_table(rows: list) -> str:
    """Where the time to first token went, per tier and phase ('' when no row has upstream's time stats)."""
    have = [r for r in rows if r.get("phase") and r.get("queue_s_p50") is not None]
    if not have:
        return ""
    head = ["tier", "phase", "TTFT p50 s", "queue p50 s", "queue mean s", "waiting for the storage prefetch, mean s",
            "waiting for staging, mean s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in have:
        lines.append("| " + " | ".join([r["tier"], r["phase"], _f(r["ttft_p50"]), _f(r["queue_s_p50"]),
                                         _f(r["queue_s_mean"]), _f(r["prefetch_wait_s_mean"]),
                                         _f(r["staging_wait_s_mean"])]) + " |")
    return "\n".join(lines)


SERVED_FROM = ("storage", "host", "device", "none")  # a request's class: the deepest level that served its prefix
SERVED_FROM_HEAD = {"storage": "storage hit", "host": "host pool hit, no storage", "device": "device pool hit only",
                    "none": "no hit (whole prompt computed)", "unknown": "cached, level not reported"}


def served_from(req: dict) -> str:
    """The deepest level that served part of an answered request's prompt: storage, host, device, none, or
    unknown (cached tokens the server did not break down by level)."""
    for level in SERVED_FROM[:3]:
        if req.get(level):
            return level
    return "unknown" if req.get("cached") else "none"


def served_from_table(result: dict) -> str:
    """Per tier and phase, the answered requests' TTFT by where their prefix came from (count: p50 / mean s):
    the storage class is where storage tiers differ; the no-hit class is the same compute on every tier and
    sets the run's tail; an "unknown" column only where a server reported cached tokens without their level.
    '' when no phase has requests."""
    classes = SERVED_FROM + ("unknown",)
    rows = []
    for t in result["tiers"]:
        for phase, ph in (t.get("phases") or {}).items():
            by: dict = {k: [] for k in classes}
            for req in ph.get("requests") or ():
                if not req.get("error") and req.get("ttft_s") is not None:
                    by[served_from(req)].append(req["ttft_s"])
            if any(by.values()):
                rows.append((label(t), phase, by))
    if not rows:
        return ""
    shown = [k for k in classes if k != "unknown" or any(by["unknown"] for _, _, by in rows)]
    head = ["tier", "phase"] + [f"{SERVED_FROM_HEAD[k]}: n, p50 / mean s" for k in shown]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, phase, by in rows:
        cells = [f"{len(by[k])}: {percentile(by[k], 50):.3f} / {sum(by[k]) / len(by[k]):.3f}" if by[k] else "0"
                 for k in shown]
        lines.append("| " + " | ".join([name, phase] + cells) + " |")
    return "\n".join(lines)


def _f(v, fmt="{:.3f}"):
    return "-" if v is None else fmt.format(v)


def table(rows: list, threshold: int = PREFETCH_THRESHOLD) -> str:
    head = ["tier", "phase", "req/s", "errors", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s", "device tok", "host tok",
            "storage tok", "hit ratio (ideal)", "in flight tok", f"lost tok (< {threshold})", "disk GB (in page cache)", "disk read / written GB", "CPU s server + services", "ids differ / compared",
            "startup s", "first storage hit s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if r["phase"] is None:
            lines.append("| " + " | ".join([r["tier"], "-", "not run: " + r["error"].replace("|", "/")]
                                          + ["-"] * (len(head) - 3)) + " |")
            continue
        cpu = "-" if r["cpu_server_s"] is None else (f"{r['cpu_server_s']:.1f} + {r['cpu_services_s'] or 0:.1f}")
        lines.append("| " + " | ".join([
            r["tier"], r["phase"], _f(r["rps"], "{:.2f}"), f"{r['errors']} / {r['n']}", _f(r["ttft_p50"]), _f(r["ttft_p90"]), _f(r["ttft_p99"]),
            f"{r['device']:,}", f"{r['host']:,}", f"{r['storage']:,}",
            f"{_f(r['hit_ratio'], '{:.3f}')} ({_f(r['ideal_ratio'], '{:.3f}')})",
            _f(r["in_flight"], "{:,}"),
            "-" if r["lost"] is None else f"{r['lost']:,} ({r['lost_short']:,})",
            _f(None if r["disk_bytes"] is None else r["disk_bytes"] / GB, "{:.2f}")
            + ("" if r.get("page_cache_bytes") is None else f" ({r['page_cache_bytes'] / GB:.2f})"),
            "-" if r.get("disk_read_bytes") is None else
            f"{r['disk_read_bytes'] / GB:.2f} / {r['disk_written_bytes'] / GB:.2f}", cpu,
            f"{r['ids_differ']} / {r['ids_compared']}" + (" (ref)" if r["is_reference"] else ""),
            _f(r["startup_s"], "{:.1f}"), _f(r["first_storage_hit_s"], "{:.2f}")]) + " |")
    return "\n".join(lines)


NO_HICACHE_HOST_POOL = {"no-hicache", "lmcache", "lmcache-raw-block"}  # tiers without upstream's HiCache host pool


def has_hicache_host_pool(tier_names) -> bool:
    """Whether any of these tiers runs upstream's HiCache host pool (whose limits pool_limits names)."""
    return bool(set(tier_names) - NO_HICACHE_HOST_POOL)
MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")


def pool_limits(result: dict) -> list:
    """``peer_workloads.host_pool_notes`` of a saved run (its host pool, device pool, clients and prompts),
    for the runs with a HiCache tier; [] when it has none or the run does not say enough. Runs saved before
    ``meta.host_bytes_per_token`` take it from their model's config in ``benchmark/hicache/models``."""
    meta = result.get("meta", {})
    if not meta.get("host_gb") or not meta.get("device_tokens") or not result.get("prompts"):
        return []
    if not has_hicache_host_pool(t["name"] for t in result["tiers"]):
        return []
    bpt = meta.get("host_bytes_per_token")
    if bpt is None:
        model_dir = os.path.join(MODELS_DIR, meta.get("model") or "-")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            return []
        from benchmark.hicache.bench_server_ttft import kv_bytes_per_token
        bpt = kv_bytes_per_token(model_dir, indexer=False)
    return wl.host_pool_notes(int(meta["host_gb"] * GB), meta["device_tokens"], bpt, meta.get("concurrency") or 1,
                              [p["tokens"] for p in result["prompts"]])


def ram_hold_problems(held: dict) -> list:
    """What kept a phase from running at its --free-ram-gb goal, one line each ([] when it did). A phase
    with more than the goal available (holder dead, goal not reached, time above it) gave a page-cache tier
    more DRAM than the others; one far below it (the processes alone, or a holder step racing a server's
    growth) gave every tier less."""
    leave = held.get("leave") or 0
    gb = leave / GB
    out = []
    if not held.get("alive"):
        out.append("the RAM holder died in the phase (the OOM killer's first pick): more page cache than "
                   f"{gb:g} GB was possible")
    if not held.get("reached", True):
        out.append(f"the RAM holder had not reached its goal ({gb:g} GB available) when the phase began")
    if (held.get("above_goal_s") or 0) > ABOVE_GOAL_NOTED_S:
        out.append(f"{held['above_goal_s']:.1f} s of the phase ran above the goal (up to "
                   f"{(held.get('available_max') or 0) / GB:.1f} GB available) while the holder took memory back")
    low = held.get("available_min")
    if held.get("alive") and low is not None:
        if not held.get("held") and low < leave - ram_hold.SLACK:
            out.append(f"the processes alone left less than {gb:g} GB available ({low / GB:.1f} GB): this phase "
                       "had less RAM than the goal")
        elif held.get("held") and low < leave / 2:
            out.append(f"available RAM fell to {low / GB:.1f} GB, under half the goal, before the holder gave way")
    return out


ABOVE_GOAL_NOTED_S = 2.0  # seconds above the goal a phase may spend before its row is flagged


def ram_held_lines(result: dict) -> list:
    """The paragraph a ``--free-ram-gb`` run gets: the RAM every phase had beyond what its processes held,
    and each phase that ran otherwise (holder dead, goal not reached, time above it, or processes that
    alone left less), with why."""
    gb = result.get("meta", {}).get("free_ram_gb")
    if not gb:
        return []
    out = [f"Every phase ran with {gb:g} GB of the host's RAM available beyond what its processes held "
           "(`--free-ram-gb`: a holder process took the rest, as on a host whose working set is larger than its "
           "RAM; available = free memory and the page cache the kernel can reclaim)"]
    bad = []
    for t in result["tiers"]:
        for ph, v in (t.get("phases") or {}).items():
            h = v.get("ram_hold")
            problems = ["not held"] if h is None else ram_hold_problems(h)
            bad += [f"`{label(t)}` {ph}: {p}" for p in problems]
    out[0] += ", except as listed below." if bad else "."
    if bad:
        out.append("Phases that ran otherwise: " + "; ".join(bad) + ".")
    return out


def markdown(result: dict, rows: list) -> str:
    meta = result.get("meta", {})
    threshold = threshold_of(result)
    parts = [f"Workload: {meta.get('workload', '-')}", ""]
    limits = pool_limits(result)
    if limits and limits[0] not in meta.get("workload", ""):  # runs saved before the run said it
        parts += ["Pool limits (upstream's, alike on every HiCache tier): " + "; ".join(limits), ""]
    parts += [table(rows, threshold), ""]
    ref = reference_tier(result)
    if ref is not None:
        parts += [f"`ids differ / compared`: each row's output ids against `{label(ref)}`'s replay (the same "
                  "prompts, greedy decoding: a restart's right answers are the replay's). `errors`: requests "
                  "not answered / sent; req/s and the TTFT percentiles count answered requests only.", ""]
    kept = [t for t in result["tiers"] if kept_service_dram(result, t)]
    if kept:
        parts += ["Restarts beside DRAM that outlived the server (`--restart-services` restarts it too): "
                  + "; ".join(f"`{label(t)}`: {SERVICE_DRAM[t['name']]} ran on across the SGLang restart, so its "
                              "restart could serve from that DRAM as well as from its disk" for t in kept)
                  + ". A HiCache tier's host pool restarts empty with its server.", ""]
    if any(r["tier"].endswith(COLD) for r in rows):
        parts += [f"`{COLD.strip()}`: the page cache was synced and dropped before that tier's restart, so its storage "
                  "was read from the disk (as after a host restart, or with a working set larger than RAM); the "
                  "other rows restarted with whatever the page cache still held.", ""]
    held = ram_held_lines(result)
    if held:
        parts += held + [""]
    if any(r.get("lost") is not None for r in rows):
        parts += ["`in flight`: prompt tokens of the ideal whose prompt had not answered when the request was sent "
                  "(no tier could hold them yet: the replay's own concurrency); `lost`: tokens a prompt that had "
                  "answered held, not served (evicted from every level, never written, or declined by the "
                  "prefetch); in parentheses, the part lost by requests that each lost fewer than "
                  f"{threshold} tokens (the run's prefetch_threshold: a storage hit that short is "
                  "not fetched). Ideal - hit ratio is at most (in flight + lost) / prompt tokens.", ""]
    split = time_split_table(rows)
    if split:
        parts += ["Where the time to first token went (upstream's per-request time stats: time in the waiting "
                  "queue, and of it the time the scheduler skipped the request because its storage prefetch, "
                  "or its staged span, was not ready):", "", split, ""]
    by_source = served_from_table(result)
    if by_source:
        parts += ["Time to first token by where each request's prefix came from (the deepest level that served "
                  "part of it; answered requests):", "", by_source, ""]
    counters = counters_table(result)
    if counters:
        parts += ["Storage counters from each server's `/metrics` (deltas over the phase; tokens unless named "
                  "pages; upstream's HiCache controller counts the same for every storage backend):", "",
                  counters, ""]
    forwards = forward_passes_table(result)
    if forwards:
        parts += ["Forward passes as each server published them (`--forward-metrics`: upstream's "
                  "`--enable-forward-pass-metrics`; a span is the GPU time of the model's forward call, first "
                  "kernel start to last kernel end, gaps between kernels included, so where the GPU runs out of "
                  "queued kernels, as in small decode batches, a scheduler thread kept from its launches (the GIL "
                  "held by storage work, or otherwise) lengthens it; a pool hit's prefill span also holds the "
                  "waits for its KV's transfer; the wall time less the spans is scheduling, batch setup, sampling "
                  "and idle time; `lost`: gaps in the publisher's sequence numbers):", "", forwards, ""]
    m = meta.get("machine") or {}
    if m:
        parts += [f"Machine: {m.get('gpu') or 'GPU unknown'} on {m.get('host')}; code "
                  + (f"{m['commit']}{' with changes to its sources' if m.get('commit_differs') else ''}, "
                     if m.get("commit") else "") + f"sources {m.get('source_digest')}; "
                  + ", ".join(f"{k} {v}" for k, v in sorted((m.get("versions") or {}).items())) + ".", ""]
    if len(meta.get("runs") or ()) > 1:
        warm = meta.get("warm_up_per_run") or []
        parts += [f"Tiers measured in {len(meta['runs'])} consecutive runs at the same code and settings "
                  f"(started {', '.join(str(x) for x in meta['runs'])})"
                  + ("" if not warm or all(warm) else
                     "; the runs started " + ", ".join(str(x) for x, w in zip(meta["runs"], warm) if not w)
                     + " had no warm-up server of their own (`--no-warm-up`: for a run that follows another on "
                     "the same host, whose kernels are compiled already)")
                  + ".", ""]
    if any("mode_ok" in r for r in rows):
        parts += ["First token = the prompt's most frequent token (KV-sensitive weights): " + ", ".join(
            f"{r['tier']} {r['phase']} {r['mode_ok']}/{r['mode_checked']}" for r in rows if "mode_ok" in r), ""]
    dram = sorted({t["name"] for t in result["tiers"] if t["name"] in STORAGE_INCLUDES_DRAM and t.get("phases")})
    if dram:
        parts += ["Storage tokens of " + ", ".join(f"`{n}`" for n in dram) + " include hits in the tier's own DRAM "
                  "(Mooncake's segment, LMCache's L1): upstream counts every token its storage backend returns.", ""]
    parts.append("How each tier was configured:")
    parts += [f"- `{label(t)}`: {t['how']}" for t in result["tiers"]]
    used = [t for t in result["tiers"] if t.get("fs_at_start")]
    if used:
        parts += ["", "Storage filesystem in use (percent, as statvfs and nixl's cleaner count it: every file on "
                  "that disk), at each tier's start and after each phase:"]
        parts += [f"- `{label(t)}`: {t['fs_at_start']['used_pct']:.0f} % at its start"
                  + "".join(f", {ph} {v['fs_used_pct']:.0f} %" for ph, v in (t.get("phases") or {}).items()
                            if v.get("fs_used_pct") is not None) for t in used]
    warned = [w for t in result["tiers"] for w in t.get("warnings") or ()]
    if warned:
        parts += ["", "Warnings (the rows they name were measured under them):"] + [f"- {w}" for w in warned]
    missing = [t for t in result["tiers"] if t.get("error")]
    if missing:
        parts += ["", "Not run (or stopped) on this host:"]
        parts += [f"- `{label(t)}`: {t['error']} -- needs {t.get('needs') or '-'}" for t in missing]
    return "\n".join(parts) + "\n"


def log_ticks(values) -> list:
    """Tick positions 1, 2, 5 x 10^k spanning ``values`` (positive), at least the two around them: a log
    axis's labels that neither overlap nor leave a range under a decade unlabelled."""
    xs = [v for v in values if v and v > 0]
    if not xs:
        return []
    lo, hi = min(xs), max(xs)
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    steps = [m * 10.0 ** e for e in range(e0, e1 + 1) for m in (1, 2, 5)]
    inside = [t for t in steps if lo <= t <= hi]
    below = [t for t in steps if t < lo][-1:]
    above = [t for t in steps if t > hi][:1]
    ticks = inside if len(inside) >= 2 else below + inside + above
    return [float(f"{t:.6g}") for t in ticks]


def plots(result: dict, rows: list, out_dir: str) -> list:
    """The three PNGs; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ran = [t for t in result["tiers"] if t.get("phases")]
    phases = [p for p in PHASES if any(p in (t.get("phases") or {}) for t in ran)]
    paths = []
    cold = any(label(t) != plot_label(t) for t in ran)

    def layout(fig):
        if cold:  # what the mark on a tier's name means, under the axes
            fig.text(0.01, 0.01, COLD_NOTE, fontsize=8, ha="left", va="bottom")
        fig.tight_layout(rect=(0, 0.05 if cold else 0, 1, 1))

    fig, axes = plt.subplots(1, max(1, len(phases)), figsize=(6.5 * max(1, len(phases)), 4.5), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for t in ran:
            xs = sorted(r["ttft_s"] for r in _ok((t.get("phases") or {}).get(phase, {}).get("requests", []))
                        if r.get("ttft_s") is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=plot_label(t))
        ax.set_xscale("log")
        xs = [x for line in ax.get_lines() for x in line.get_xdata() if x > 0]
        ticks = log_ticks(xs)
        if ticks:  # labels 1-2-5 in seconds; matplotlib's own minor labels overlap on a range under a decade
            from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

            ax.set_xlim(min(ticks[0], min(xs)) / 1.05, max(ticks[-1], max(xs)) * 1.05)
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF, {phase}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    layout(fig)
    paths.append(os.path.join(out_dir, FILES[1]))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    ran_rows = [r for r in rows if r["phase"] is not None]
    names = [label(t) for t in ran]  # the rows' keys
    ticks = [plot_label(t) for t in ran]
    width = 0.8 / max(1, len(phases))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names)), 4.5))
    for k, phase in enumerate(phases):
        by = {r["tier"]: r["rps"] or 0.0 for r in ran_rows if r["phase"] == phase}
        ax.bar([i + k * width for i in range(len(names))], [by.get(n, 0.0) for n in names], width, label=phase)
    ax.set_xticks([i + width * (len(phases) - 1) / 2 for i in range(len(names))], ticks, rotation=30, ha="right")
    ax.set_ylabel("requests/s")
    ax.set_title("Throughput per tier")
    ax.legend()
    layout(fig)
    paths.append(os.path.join(out_dir, FILES[2]))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, max(1, len(phases)), figsize=(max(6.0, 1.1 * len(names)) * max(1, len(phases)), 4.5),
                             squeeze=False)
    for ax, phase in zip(axes[0], phases):
        by = {r["tier"]: r for r in ran_rows if r["phase"] == phase}
        bottom = [0.0] * len(names)
        levels = ("device", "host", "storage") + (("lost", "in_flight") if any(
            by[n].get("lost") is not None for n in by) else ())
        style = {"lost": {"color": "tab:red", "alpha": 0.5}, "in_flight": {"color": "0.8", "hatch": "//"}}
        for level in levels:
            vals = [((by[n].get(level) or 0) / by[n]["prompt_tokens"]) if n in by and by[n]["prompt_tokens"] else 0.0
                    for n in names]
            ax.bar(range(len(names)), vals, 0.6, bottom=bottom, label=level.replace("_", " "), **style.get(level, {}))
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, n in enumerate(names):
            if n not in by:  # e.g. a tier without storage: its restarted server would be the replay's fresh one
                ax.text(i, 0.02, f"no {phase} phase", ha="center", va="bottom", fontsize=8, rotation=90)
        ideal = (result.get("ideal") or {}).get(phase, {}).get("token_ratio")
        if ideal is not None:
            ax.axhline(ideal, color="black", linestyle="--", label=f"ideal {ideal:.3f}")
        ax.set_xticks(range(len(names)), ticks, rotation=30, ha="right")
        ax.set_ylim(0, 1)
        ax.set_ylabel("cached tokens / prompt tokens")
        ax.set_title(f"Hit ratio by tier, {phase}")
        # Beside the axes, not on them: inside, the legend covers a bar once the tiers fill the width.
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    layout(fig)
    paths.append(os.path.join(out_dir, FILES[3]))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# What must agree for tiers measured in separate runs to share one table: the same prompts and the same
# settings every tier runs under.
_SAME = ("model", "workload", "kv_sensitive", "block_tokens", "device_tokens", "host_gb", "disk_gb",
         "prefetch_policy", "prefetch_threshold", "loop", "concurrency", "phases")
# bench_peers run options that may differ between merged runs: which tiers, where, bounds on waiting, and
# what is labelled per tier anyway (a restart on a dropped page cache is its own row; kept side services
# are noted per tier). Any other option (layout, write policy, attention backend, --server-arg, ...) is a
# setting every tier must share.
ARGV_MAY_DIFFER = {"tiers", "out_dir", "work_dir", "warm_up", "drop_caches", "keep_storage", "restart_services",
                   "request_timeout", "startup_timeout", "service_timeout"}


def run_settings(meta: dict):
    """The options of the ``bench_peers run`` behind ``meta`` (its saved argv) that merged runs must share;
    None when the run saved no argv or one this version cannot parse."""
    argv = meta.get("argv")
    if argv is None:
        return None
    from benchmark.hicache import bench_peers  # here: bench_peers imports this module

    try:
        ns = vars(bench_peers.parser().parse_args(argv))
    except SystemExit:
        return None
    return {k: v for k, v in ns.items() if k not in ARGV_MAY_DIFFER}


# tiers whose "storage" tokens include their own DRAM: upstream counts whatever the backend returns
STORAGE_INCLUDES_DRAM = ("mooncake", "mooncake-strict", "mooncake-standalone", "lmcache", "lmcache-raw-block")
MACHINE_SAME = ("gpu", "source_digest")  # bench_peers.machine(): what runs merged into one table must share


def merge(results: list) -> dict:
    """One result from runs of the same workload and settings, each holding some of the tiers (a tier
    given twice keeps its last run; a restart on a dropped page cache is its own row). Raises ValueError
    naming the first field that differs."""
    if not results:
        raise ValueError("merge: no results given")
    base = results[0]
    first = run_settings(base["meta"])
    for i, r in enumerate(results[1:], 2):
        for k in _SAME:
            if r["meta"].get(k) != base["meta"].get(k):
                raise ValueError(f"result {i}: meta.{k} = {r['meta'].get(k)!r} differs from the first's "
                                 f"{base['meta'].get(k)!r}; merge only runs of one workload and settings")
        for k in ("ideal", "prompts"):
            if r[k] != base[k]:
                raise ValueError(f"result {i}: {k} differs from the first's; merge only runs of one workload")
        for k in MACHINE_SAME:  # runs saved before they recorded their machine are not checked
            m, f = (r["meta"].get("machine") or {}).get(k), (base["meta"].get("machine") or {}).get(k)
            if m is not None and f is not None and m != f:
                raise ValueError(f"result {i}: machine.{k} = {m!r} differs from the first's {f!r}; merge only "
                                 "runs on one kind of GPU at the same code (run the other tiers again there)")
        mine = run_settings(r["meta"])
        if mine is not None and first is not None and mine != first:
            k = next(k for k in sorted(set(mine) | set(first)) if mine.get(k) != first.get(k))
            raise ValueError(f"result {i}: --{k.replace('_', '-')} = {mine.get(k)!r} differs from the first's "
                             f"{first.get(k)!r}; merge only runs whose settings differ in "
                             + ", ".join(f"--{x.replace('_', '-')}" for x in sorted(ARGV_MAY_DIFFER)))
    tiers: dict = {}
    for r in results:
        for t in r["tiers"]:
            tiers.pop(label(t), None)
            tiers[label(t)] = t
    meta = dict(base["meta"])
    meta["runs"] = [x for r in results for x in (r["meta"].get("runs") or [r["meta"].get("started")])]  # a merged input keeps its runs
    meta["warm_up_per_run"] = [x for r in results  # one flag per run, as "runs": a merged input keeps its own
                               for x in (r["meta"].get("warm_up_per_run") or [bool(r["meta"].get("warm_up"))])]
    return {**base, "meta": meta, "tiers": list(tiers.values())}


def write_report(result: dict, out_dir: str) -> list:
    """peers.md and the PNGs in ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, mode=0o700, exist_ok=True)
    rows = summarize(result)
    md = os.path.join(out_dir, FILES[0])
    with open(md, "w") as f:
        f.write(markdown(result, rows))
    return [md] + plots(result, rows, out_dir)
