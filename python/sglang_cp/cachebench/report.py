"""cachebench output: progress bars per phase, the summary table, result JSON and the PNG plot."""

from __future__ import annotations

import json
import os

from sglang_cp.cachebench.cp_testbed import PAGE

PHASES = ("warm-up", "pressure", "reload", "restart")


class PhaseProgress:
    """One rich progress bar per phase, advanced by rank 0's events from its process."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("requests"), TimeElapsedColumn(), console=console)
        self.task = None

    def __enter__(self):
        self.progress.start()
        self._spinner = self.progress.add_task("starting ranks", total=None)
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def note(self, text: str) -> None:
        self.progress.console.print(text)
        self._spinner = self.progress.add_task("restarting", total=None)

    def on_event(self, rank: int, event) -> None:
        if event[0] == "phase":
            if self._spinner is not None:
                self.progress.remove_task(self._spinner)
                self._spinner = None
            self.task = self.progress.add_task(event[1], total=event[2])
        elif event[0] == "tick":
            self.progress.advance(self.task, event[1])


def _sum_causes(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def summarize(info: dict, raw: dict, ranks: list[dict], wall: float) -> dict:
    phases = {}
    for name in PHASES:
        per_rank = [[x for x in r["records"] if x["phase"] == name] for r in ranks]
        if not per_rank[0]:
            continue
        recs0 = per_rank[0]
        pages = sum(x["pages"] for x in recs0)
        l2 = sum(x["l2"] for x in recs0)
        l3 = sum(x["l3"] for x in recs0)
        comp = sum(x["computed"] for x in recs0)
        rd = sum(x["read_bytes"] for rr in per_rank for x in rr)
        wr = sum(x["write_bytes"] for rr in per_rank for x in rr)
        # Ranks move their stripes concurrently: aggregate bytes over the slowest rank's time.
        t_rd = max(sum(x["t_read"] for x in rr) for rr in per_rank)
        t_wr = max(sum(x["t_write"] for x in rr) for rr in per_rank)
        divergent = sum(1 for rr in per_rank[1:] for a, b in zip(recs0, rr)
                        if (a["l2"], a["l3"], a["computed"]) != (b["l2"], b["l3"], b["computed"]))
        phases[name] = {
            "requests": len(recs0), "pages": pages, "l2_hit_pages": l2, "l3_hit_pages": l3,
            "computed_pages": comp, "l2_hit_rate": l2 / pages if pages else 0.0,
            "l3_hit_rate": l3 / pages if pages else 0.0, "l3_read_bytes": rd, "l3_write_bytes": wr,
            "l3_read_gbps": rd / t_rd / 1e9 if t_rd else None, "l3_write_gbps": wr / t_wr / 1e9 if t_wr else None,
            "recompute_avoided_tokens": l3 * PAGE,
            # prefetch_threshold replay: misses too short to look up, and agreed hits revoked as too short.
            "l3_declined_pages": sum(x.get("l3_declined", 0) for x in recs0),
            "l3_revoked_pages": sum(x.get("l3_revoked", 0) for x in recs0),
            # Agreed hits that read short (damage found at read time, e.g. after a `load` restart): misses,
            # not errors; causes summed over the ranks (under sharding the damaged page has one owner).
            "l3_partial_requests": sum(1 for x in recs0 if x.get("l3_partial", 0)),
            "l3_partial_pages": sum(x.get("l3_partial", 0) for x in recs0),
            "l3_partial_causes": _sum_causes(x.get("l3_partial_causes", {}) for rr in per_rank for x in rr),
            "errors": sum(x["store_errors"] for rr in per_rank for x in rr) + divergent,
            "rank_divergent_requests": divergent,
            "seconds": max(sum(x["dt"] for x in rr) for rr in per_rank),
        }
    rank_errors = [e for r in ranks for e in r["errors"]]
    total_errors = len(rank_errors) + sum(p["errors"] for p in phases.values())
    return {"config": info, "raw_disk": raw, "phases": phases, "wall_seconds": wall,
            "errors": total_errors, "error_samples": rank_errors[:5],
            "restart_cold_start": [r["restart_cold_start"] for r in ranks],
            "occupancy_after_restart": [r["occupancy_after_restart"] for r in ranks]}


def print_table(console, result: dict) -> None:
    from rich.table import Table

    raw = result["raw_disk"]
    cfg = result["config"]
    t = Table(title=f"cachebench: CP={cfg['cp_size']}{' sharded' if cfg['sharded'] else ''}, "
                    f"{cfg['requests']} requests, working set {cfg['working_set_pages']} pages, "
                    f"L2 {cfg['l2_pages']} pages; raw disk write {raw['write_gbps']:.2f} / "
                    f"read {raw['read_gbps']:.2f} GB/s (measured in this run)")
    for col in ("phase", "requests", "L2 hit (pages)", "L3 hit (pages)", "computed (pages)", "L3 read GB",
                "L3 write GB",
                "L3 read GB/s (x raw)", "L3 write GB/s (x raw)", "recompute avoided (tokens)", "errors"):
        t.add_column(col, justify="right")

    def rate(gbps, raw_gbps):
        return "-" if gbps is None else f"{gbps:.2f} ({gbps / raw_gbps:.2f}x)"
    for name, p in result["phases"].items():
        def share(n):
            return f"{n / p['pages']:.1%} ({n})" if p["pages"] else "-"
        t.add_row(name, str(p["requests"]), share(p["l2_hit_pages"]), share(p["l3_hit_pages"]),
                  share(p["computed_pages"]),
                  f"{p['l3_read_bytes'] / 1e9:.3f}", f"{p['l3_write_bytes'] / 1e9:.3f}",
                  rate(p["l3_read_gbps"], raw["read_gbps"]), rate(p["l3_write_gbps"], raw["write_gbps"]),
                  f"{p['recompute_avoided_tokens']:,}", str(p["errors"]))
    if not console.is_terminal:  # a log or a pipe: do not squeeze the table into 80 columns
        from rich.console import Console

        console = Console(width=160)
    console.print(t)
    thr = cfg.get("prefetch_threshold", 0)
    console.print(f"prefetch_threshold {thr} tokens (replayed as the scheduler applies it): " + (", ".join(
        f"{name} {p['l3_declined_pages']} page(s) not looked up, {p['l3_revoked_pages']} hit page(s) revoked"
        for name, p in result["phases"].items()) if thr else "off"), soft_wrap=True)
    partial = {n: p for n, p in result["phases"].items() if p.get("l3_partial_pages")}
    if partial:
        console.print("partial L3 hits (agreed, then fewer pages read: dropped as misses, no wrong byte): " + ", ".join(
            f"{n} {p['l3_partial_pages']} page(s) in {p['l3_partial_requests']} request(s), cause "
            + (", ".join(f"{k} {v}" for k, v in p["l3_partial_causes"].items()) or "none counted")
            for n, p in partial.items()), soft_wrap=True)
    cs = result["restart_cold_start"]
    console.print("restart: cold start 'load' found " + ", ".join(
        f"rank {i}: {c.get('live', 0)} live / {c.get('dropped', 0)} dropped" for i, c in enumerate(cs))
        + f"; total wall {result['wall_seconds']:.0f} s", soft_wrap=True)


def write_outputs(out_dir: str, result: dict, ranks: list[dict]) -> dict:
    js = os.path.join(out_dir, "cachebench.json")
    with open(js, "w") as f:
        json.dump(dict(result, ranks=[{"rank": r["rank"], "records": r["records"], "errors": r["errors"],
                                        "page_bytes": r["page_bytes"]} for r in ranks]), f, indent=1)
    png = os.path.join(out_dir, "cachebench.png")
    plot(ranks, png, raw=result.get("raw_disk"))
    return {"json": js, "png": png}


def _rolling(xs, w):
    out, acc = [], []
    for x in xs:
        acc.append(x)
        if len(acc) > w:
            acc.pop(0)
        out.append(acc[:])
    return out


def _serving_clock(recs: list[dict]) -> tuple[list[float], float]:
    """Seconds since the first request with the restart's downtime cut out (the ranks are
    down then: nothing to plot), and how long that downtime was."""
    t0 = recs[0]["t"]
    gap, xs, prev_end, prev_phase = 0.0, [], None, None
    for x in recs:
        if prev_phase is not None and x["phase"] == "restart" and prev_phase != "restart":
            gap = x["t"] - prev_end - 0.5
        xs.append(x["t"] + x["dt"] - t0 - gap)
        prev_end, prev_phase = x["t"] + x["dt"], x["phase"]
    return xs, gap


def rolling_gbps(ranks: list[dict], idx: list[int], window: int, kind: str) -> list:
    """The table's L3 GB/s over a rolling window of requests: bytes of every rank over the slowest
    rank's I/O time (``kind`` "read" or "write"); None where the window moved nothing. Ranks serve
    the same requests in the same order, so request i is record i on each."""
    out = []
    for k in range(len(idx)):
        win = idx[max(0, k - window + 1):k + 1]
        nbytes = sum(r["records"][i][f"{kind}_bytes"] for r in ranks for i in win)
        secs = max(sum(r["records"][i][f"t_{kind}"] for i in win) for r in ranks)
        out.append(nbytes / secs / 1e9 if nbytes and secs > 0 else None)
    return out


def plot(ranks: list[dict], path: str, window: int = 8, raw: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    styles = ["-", "--", ":", "-."]
    gap = 0.0
    present = [n for n in PHASES if any(x["phase"] == n for x in ranks[0]["records"])]
    for r in ranks:
        recs = r["records"]
        xs, gap = _serving_clock(recs)
        ls = styles[r["rank"] % len(styles)]
        for name in PHASES:  # one segment per phase: the rolling window restarts with each
            idx = [i for i, x in enumerate(recs) if x["phase"] == name]
            if not idx:
                continue
            win = _rolling([recs[i] for i in idx], window)
            ts = [xs[i] for i in idx]
            hit = [sum(x["l2"] + x["l3"] for x in w) / max(1, sum(x["pages"] for x in w)) for w in win]
            l3 = [sum(x["l3"] for x in w) / max(1, sum(x["pages"] for x in w)) for w in win]
            first = name == present[0]
            ax1.plot(ts, hit, ls, color="C0", label=f"rank {r['rank']}: L2+L3 hit rate" if first else None)
            ax1.plot(ts, l3, ls, color="C3", label=f"rank {r['rank']}: L3 hit rate" if first else None)
    recs0 = ranks[0]["records"]
    xs0, _ = _serving_clock(recs0)
    for name in PHASES:  # the table's quantity: all ranks' bytes over the slowest rank's I/O time
        idx = [i for i, x in enumerate(recs0) if x["phase"] == name]
        if not idx:
            continue
        ts = [xs0[i] for i in idx]
        first = name == present[0]
        for kind, color, ls in (("read", "C2", "-"), ("write", "C1", "--")):
            ax2.plot(ts, rolling_gbps(ranks, idx, window, kind), ls, color=color, marker=".",
                     label=f"L3 {kind} GB/s, all ranks" if first else None)
    if raw:
        ax2.axhline(raw["read_gbps"], color="C2", ls=":", lw=1, label=f"raw O_DIRECT read {raw['read_gbps']:.2f} GB/s")
        ax2.axhline(raw["write_gbps"], color="C1", ls=":", lw=1,
                    label=f"raw O_DIRECT write {raw['write_gbps']:.2f} GB/s")
    for k, name in enumerate(PHASES):
        idx = [i for i, x in enumerate(recs0) if x["phase"] == name]
        if idx:
            a, b = xs0[idx[0]] - recs0[idx[0]]["dt"], xs0[idx[-1]]
            for ax in (ax1, ax2):
                ax.axvspan(a, b, alpha=0.08, color="C%d" % (k + 4))
            ax1.text((a + b) / 2, 1.03, name, fontsize=9, ha="center")
    ax1.set_ylim(0, 1.12)
    ax1.set_ylabel(f"hit rate (rolling {window} requests)")
    ax1.legend(fontsize=8, loc="lower right")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel(f"L3 GB/s, as the table's columns\n(bytes of all ranks / slowest rank's\nI/O time, rolling {window} requests)")
    ax2.set_xlabel(f"seconds of serving (the {gap:.0f} s restart of all ranks is cut out)")
    ax2.legend(fontsize=8)
    fig.suptitle("sglang-cp cachebench: hit rate per CP rank; L3 read and write GB/s of the node")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
