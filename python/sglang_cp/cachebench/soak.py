"""``sglang-cp cachebench --soak MINUTES``: the request stream for MINUTES under GC pressure, with
graceful rank restarts and SIGKILLed ranks, and the invariants checked after every epoch.

An epoch is one ``run_ranks`` (rank processes with upstream's controller and our L3) serving the next
requests of the stream, taken cyclically, on the same L3 directory, whose capacity is a fraction of the
working set (``--soak-capacity``, default 0.5) so GC reclaims all the time. Epoch kinds:
  fresh    the first, cold start ``clear``;
  restart  ranks finish their requests and exit (close); the next epoch starts with ``load``;
  kill     once rank 0 answered half of the epoch's requests the parent SIGKILLs the last rank
           (``run_ranks`` then stops the others); the next epoch starts with ``load`` and first retries
           the request that was in flight.
MINUTES > 0: fresh, restart, kill, restart, kill, ... while the time lasts, always ending with a graceful
epoch; MINUTES = 0: kill, restart (the CI smoke). The epoch size is chosen from the measured request
rate (``--soak-epoch-s``); every decision a rank takes stays a function of the replicated workload, so
ranks never diverge.

Invariants (printed, and the exit code): every request answered (the one in flight at a kill retried and
counted); every reloaded byte equal to what was written, ranks agreeing; per rank and graceful epoch
``spilled - spill_replaced - gc_reclaimed - bad_pages_dropped == live growth``; no error counter moved
and every ``load`` after a kill dropped nothing; memory bounded (RSS within an epoch and across epochs,
staging back to 0 and under its limit, the LMDB file within its map); ``l3 fsck`` clean after the final
stop. Design and figures: docs_internal/cachebench.md, "Soak".
"""

from __future__ import annotations

import json
import os
import signal
import time

from rich.markup import escape
from rich.table import Table

from sglang_cp.cachebench.cp_testbed import RANK_START, RankDied, run_ranks
from sglang_cp.display import rel

from .rank_program import run_phases

# Store counters that must not move in a soak without injected faults.
ERROR_COUNTERS = ("write_errors", "read_errors", "crc_errors", "header_errors", "foreign_blobs", "short_reads",
                  "index_errors", "read_timeouts", "write_timeouts", "clear_errors", "mapfull", "bad_pages_dropped")
# RSS may grow this much within an epoch, and from the first graceful epoch to the last (fraction, bytes).
RSS_GROWTH = (0.25, 64 << 20)
MIN_EPOCH_REQUESTS = 8


def soak_capacity_gb(need_bytes: int, fraction: float, floor_bytes: int) -> float:
    """The L3 capacity: ``fraction`` of the working set, never below ``floor_bytes`` (a few requests)."""
    return round(max(fraction * need_bytes, floor_bytes) / 1e9, 4)


def plan_kinds(minutes: float) -> list[str]:
    """The fixed head of the epoch sequence; more epochs follow while time lasts (``_next_kind``)."""
    return ["kill", "restart"] if minutes <= 0 else ["fresh", "restart", "kill", "restart"]


def _next_kind(done: list[str]) -> str:
    return "kill" if done[-1] == "restart" else "restart"


class _Epoch:
    """The parent's view of one epoch, fed by the ranks' events (kept when a rank is killed)."""

    def __init__(self, k: int, kind: str, planned: int, world: int):
        self.k, self.kind, self.planned, self.world = k, kind, planned, world
        self.pids: dict[int, int] = {}
        self.served = self.l2 = self.l3 = self.computed = 0
        self.errors: list[str] = []
        self.t0 = time.monotonic()
        self.first_served_s = self.killed_after_s = None
        self.kill_at = planned // 2 if kind == "kill" else None

    def on_event(self, rank: int, ev) -> None:
        if ev[0] == "pid":
            self.pids[rank] = ev[1]
        elif ev[0] == "error":
            self.errors.append(f"epoch {self.k} rank {rank}: {ev[1]}")
        elif ev[0] == "served":
            self.served += 1
            self.l2, self.l3, self.computed = self.l2 + ev[3], self.l3 + ev[4], self.computed + ev[5]
            if self.first_served_s is None:
                self.first_served_s = time.monotonic() - self.t0
            if self.kill_at is not None and self.served == self.kill_at and self.killed_after_s is None:
                victim = self.world - 1
                os.kill(self.pids[victim], signal.SIGKILL)
                self.killed_after_s = time.monotonic() - self.t0


def run(ns, console, cfg: str, requests: list, l2_pages: int, layers: int, host_pages: int, sidecars: bool,
        logs: str, info: dict) -> int:
    budget = ns.soak * 60.0
    t_start = time.monotonic()
    kinds = plan_kinds(ns.soak)
    epochs, pos, rate = [], 0, None
    while True:
        k = len(epochs)
        if k < len(kinds):
            kind = kinds[k]
        else:
            left = budget - (time.monotonic() - t_start)
            last = epochs[-1]
            if last["kind"] != "kill" and left < last["wall_s"]:
                break
            kind = _next_kind([e["kind"] for e in epochs])
        n = len(requests) if rate is None else max(MIN_EPOCH_REQUESTS, int(rate * ns.soak_epoch_s))
        if kind == "kill":
            n = max(n, 4)
        batch = [requests[(pos + j) % len(requests)] for j in range(n)]
        cold = "clear" if k == 0 else "load"
        ep = _Epoch(k, kind, n, ns.cp_size)
        console.print(f"soak epoch {k} ({kind}): {n} requests from #{pos}, cold start '{cold}'"
                      + (f", SIGKILL of rank {ns.cp_size - 1} after {ep.kill_at}" if ep.kill_at else ""))
        results, died = None, None
        try:
            results = run_ranks(ns.cp_size, run_phases,
                                (cfg, [(f"e{k}", batch)], l2_pages, layers, cold, host_pages, sidecars, logs,
                                 ns.prefetch_threshold, True),
                                timeout=ns.timeout, on_event=ep.on_event, start=RANK_START)
        except (RankDied, TimeoutError) as e:
            died = str(e)
        wall = time.monotonic() - ep.t0
        rec = _epoch_record(ep, cold, pos, results, died, wall, cfg)
        epochs.append(rec)
        pos += rec["answered"]
        if results is not None and ep.first_served_s is not None:
            serving = wall - ep.first_served_s
            rate = max(1e-3, (ep.served - 1) / serving) if serving > 0 and ep.served > 1 else rate
        if died is not None and kind != "kill":
            console.print(f"[bold red]soak: epoch {k} failed: {escape(died)}[/] (rank logs: "
                          f"{escape(rel(logs.format(rank='N')))})", soft_wrap=True)
            break
    result = _check(ns, epochs, cfg, time.monotonic() - t_start, info)
    if not console.is_terminal:  # a log or a pipe: rich would squeeze the table into 80 columns
        from rich.console import Console

        console = Console(width=180)
    _print(console, result)
    path = os.path.join(ns.out_dir, "soak.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    console.print(f"wrote {rel(path)}", soft_wrap=True)
    return 0 if result["ok"] else 1


def _epoch_record(ep: _Epoch, cold: str, pos: int, results, died, wall: float, cfg: str) -> dict:
    from sglang_cp.l3 import load_l3_config

    killed = ep.kind == "kill" and died is not None
    answered = ep.served if results is None else len(results[0]["records"])
    rec = {"epoch": ep.k, "kind": ep.kind, "cold_start": cold, "first_request": pos, "planned": ep.planned,
           "answered": answered, "retried": 1 if killed else 0, "killed": killed, "died": died,
           "wall_s": round(wall, 2), "first_served_s": ep.first_served_s, "killed_after_s": ep.killed_after_s,
           "pages": ep.l2 + ep.l3 + ep.computed, "l2_pages": ep.l2, "l3_pages": ep.l3,
           "computed_pages": ep.computed, "errors": list(ep.errors), "ranks": []}
    mdb = os.path.join(load_l3_config(cfg).index_dir, "data.mdb")
    rec["lmdb_file_bytes"] = os.path.getsize(mdb) if os.path.exists(mdb) else 0
    if results is None:
        return rec
    first = results[0]["records"]
    rec["divergent_requests"] = sum(1 for r in results[1:] for a, b in zip(first, r["records"])
                                    if (a["l2"], a["l3"], a["computed"]) != (b["l2"], b["l3"], b["computed"]))
    errs = rec["errors"] = []  # the ranks' own lists (the events carry the same, for a killed epoch)
    for r in results:
        c0, c1 = r["counters_start"], r["counters"]
        d = {key: c1[key] - c0[key] for key in c1}
        balance = d["spill_pages"] - d["spill_replaced"] - d["gc_reclaimed"] - d["bad_pages_dropped"]
        errs += [f"epoch {ep.k} rank {r['rank']}: {e}" for e in r["errors"]]
        rec["ranks"].append({
            "rank": r["rank"], "spilled": d["spill_pages"], "spill_replaced": d["spill_replaced"],
            "gc_reclaimed": d["gc_reclaimed"], "bad_pages_dropped": d["bad_pages_dropped"],
            "reloaded": d["reload_hits"], "live_start": r["live_start"], "live_end": r["live_end"],
            "balance": balance, "error_counters": {e: d[e] for e in ERROR_COUNTERS if d[e]},
            "cold_start": {x: r["cold_start"].get(x) for x in ("mode", "live", "dropped", "seconds")},
            "rss": r["rss"], "staging_max": r["staging_max"], "staging_end": r["staging_end"],
            "staging_limit": r["staging_limit"], "map_size": r["index"]["map_size"],
            "max_map_size": r["index"]["max_map_size"]})
    return rec


def _check(ns, epochs: list[dict], cfg: str, wall: float, info: dict) -> dict:
    from sglang_cp.l3 import load_l3_config
    from sglang_cp.l3.tools import fsck

    checks = []

    def check(name, ok, detail):
        checks.append({"invariant": name, "ok": bool(ok), "detail": detail})

    graceful = [e for e in epochs if not e["killed"]]
    total = sum(e["answered"] for e in epochs)
    unfinished = [e["epoch"] for e in graceful if e["answered"] != e["planned"] or e["died"]]
    kills = sum(e["killed"] for e in epochs)
    check("every request answered", not unfinished and epochs and not epochs[-1]["killed"],
          f"{total} answered over {len(epochs)} epochs, {kills} in flight at a SIGKILL retried"
          + (f"; epochs {unfinished} did not finish" if unfinished else ""))
    errors = [x for e in epochs for x in e["errors"]]
    divergent = sum(e.get("divergent_requests", 0) for e in graceful)
    check("bytes checked, ranks agree", not errors and not divergent,
          f"{len(errors)} error(s), {divergent} rank-divergent request(s)" + (f": {errors[:3]}" if errors else ""))
    bad = [(e["epoch"], r["rank"], r["live_end"] - r["live_start"], r["balance"]) for e in graceful
           for r in e["ranks"] if r["live_end"] - r["live_start"] != r["balance"]]
    check("spilled - spill_replaced - gc_reclaimed - bad_pages_dropped == live growth", not bad,
          f"{sum(len(e['ranks']) for e in graceful)} rank-epochs" + (f"; off (epoch, rank, growth, balance): {bad}"
                                                                  if bad else ""))
    moved = {(e["epoch"], r["rank"]): r["error_counters"] for e in graceful for r in e["ranks"] if r["error_counters"]}
    dropped = [(e["epoch"], r["rank"], r["cold_start"]["dropped"]) for e in graceful for r in e["ranks"]
               if r["cold_start"]["mode"] == "load" and r["cold_start"]["dropped"]]
    check("no error counter moved; no load dropped a page", not moved and not dropped,
          f"moved: {moved or 'none'}; dropped at load: {dropped or 'none'}")
    reclaimed = sum(r["gc_reclaimed"] for e in graceful for r in e["ranks"])
    check("GC under pressure", reclaimed > 0, f"{reclaimed} pages reclaimed (capacity {ns.soak_capacity:g} x "
                                                "working set)")
    frac, slack = RSS_GROWTH
    rss_bad = [(e["epoch"], r["rank"]) for e in graceful for r in e["ranks"]
               if max(r["rss"]) > r["rss"][0] * (1 + frac) + slack]
    ends = [max(r["rss"]) for r in graceful[0]["ranks"]] if graceful else []
    last = [max(r["rss"]) for r in graceful[-1]["ranks"]] if graceful else []
    across = all(b <= a * (1 + frac) + slack for a, b in zip(ends, last))
    staging_bad = [(e["epoch"], r["rank"]) for e in graceful for r in e["ranks"]
                   if r["staging_end"] or r["staging_max"] > r["staging_limit"]]
    maps = [r for e in graceful for r in e["ranks"]]
    lmdb = max((e["lmdb_file_bytes"] for e in epochs), default=0)
    map_ok = all(r["map_size"] <= r["max_map_size"] and lmdb <= r["map_size"] for r in maps)
    check("memory bounded (RSS, staging, LMDB map)", not rss_bad and across and not staging_bad and map_ok,
          f"RSS max per rank first/last epoch {[_mb(x) for x in ends]} / {[_mb(x) for x in last]} MB; "
          f"staging in use at request ends max {max((r['staging_max'] for r in maps), default=0)} of "
          f"{max((r['staging_limit'] for r in maps), default=0)} pages, 0 at every epoch end: {not staging_bad}; "
          f"LMDB file {_mb(lmdb)} MB of a {_mb(max((r['map_size'] for r in maps), default=0))} MB map"
          + (f"; RSS grew in {rss_bad}" if rss_bad else ""))
    l3cfg = load_l3_config(cfg)
    owners = fsck.live_owners(l3cfg)
    rep = fsck.check(l3cfg)
    check("l3 fsck clean after the final stop", not owners and rep.problems() == 0,
          f"{rep.entries} entries, {rep.live} live, problems {rep.problems()}, findings {dict(rep.counts())}"
          + (f"; still owned: {owners}" if owners else ""))
    return {"info": dict(info, soak_minutes=ns.soak, soak_capacity=ns.soak_capacity, soak_epoch_s=ns.soak_epoch_s),
            "wall_s": round(wall, 1), "epochs": epochs, "checks": checks, "ok": all(c["ok"] for c in checks)}


def _mb(b) -> float:
    return round(b / 1e6, 1)


def _print(console, result: dict) -> None:
    t = Table(title=f"cachebench soak: {len(result['epochs'])} epochs, {result['wall_s']:.0f} s")
    for col in ("epoch", "kind", "cold start", "answered", "L2 / L3 / computed", "spilled", "reloaded",
                "reclaimed", "live (end)", "load: live, dropped, s", "to first answer", "RSS max MB"):
        t.add_column(col, justify="right", no_wrap=True)
    for e in result["epochs"]:
        pages = max(1, e["pages"])
        rs = e["ranks"]
        s = lambda key: str(sum(r[key] for r in rs)) if rs else "-"  # noqa: E731
        cs = ", ".join(f"{r['cold_start']['live']}/{r['cold_start']['dropped']}/{r['cold_start']['seconds']:.2f}"
                       for r in rs) if e["cold_start"] == "load" and rs else "-"
        answered = f"{e['answered']}/{e['planned']}" + (" (killed)" if e["killed"] else "")
        t.add_row(str(e["epoch"]), e["kind"], e["cold_start"], answered,
                  f"{e['l2_pages'] / pages:.0%} / {e['l3_pages'] / pages:.0%} / {e['computed_pages'] / pages:.0%}",
                  s("spilled"), s("reloaded"), s("gc_reclaimed"), s("live_end"), cs,
                  "-" if e["first_served_s"] is None else f"{e['first_served_s']:.1f} s",
                  ", ".join(f"{_mb(max(r['rss'])):.0f}" for r in rs) or "-")
    console.print(t)
    for c in result["checks"]:
        mark = "[green]ok[/]" if c["ok"] else "[bold red]FAIL[/]"
        console.print(f"{mark} {escape(c['invariant'])}: {escape(c['detail'])}", soft_wrap=True)
