"""The life of a server (issue 27, item 1): concurrent clients for minutes with L3 capacity well below
the working set (GC reclaims while it serves), a small host pool (L3 is read), periodic
``/flush_cache``, a SIGKILL mid-load and a graceful restart, each followed by ``--cp-l3-cold-start
load``; once more with the hugepage L2.

Workload (``soak_support``): shared system prompts, Zipf-popular documents each with its own planted
token, and multi-turn chats built from a reference run's outputs. The model's weights are shaped
(``kv_sensitive/sitecustomize.py``) so that it answers with its prefix's planted token, read from the
prefix KV: a page served from the wrong place changes the output ids.

Invariants, checked and printed per phase (one phase per server lifetime):
- every request answered: those in flight at the SIGKILL are retried on the next server and counted;
  a failed request on a live server is a failure;
- output ids equal to the reference run of the same prompts (a server without HiCache and L3);
- ``sglang:cp_l3_*`` consistent with ``sglang-cp l3 stats --json``: after each graceful phase, once the
  clients are drained and the counters settled, spilled - spill_replaced - gc_reclaimed -
  bad_pages_dropped == used slots at the end - used slots at the start, and used slots == the slots
  ``l3 stats`` counts in the index; after every restart the cold start dropped nothing and its live
  pages are the used slots;
- no error counter moved (no fault is injected);
- memory bounded: the scheduler's RSS (``/proc`` of the server's process group) in the second half of
  a phase within 15 % + 256 MB of the first half, the LMDB file within its map;
- ``sglang-cp l3 fsck`` clean after the final stop.
Reported per phase: requests, pages spilled / reloaded / reclaimed, hit rates, p50/p99 TTFT
(``generate_stream``), and how long the restart took until the first request served from storage.

Duration: ``SGLANG_CP_SOAK_S`` seconds of load for the short variant (default 120: with its four server
starts it fits one 10-minute GPU call), ``SGLANG_CP_SOAK_LONG_S`` for the slow one (default 3600, a kill
and a graceful restart every ``SGLANG_CP_SOAK_CYCLE_S`` = 600 s). ``SGLANG_CP_SOAK_OUT``: where the JSON
report goes (default: the test's directory).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_support import METRIC, base_dir, kv_env, server, write_l3_config
from soak_support import (Schedule, build, chat_turns, expected_answer, fsck_line, fsck_summary, percentile, phase_plan,
                          scheduler_rss)

pytestmark = pytest.mark.gpu
SOAK_S = float(os.environ.get("SGLANG_CP_SOAK_S", "120"))
LONG_S = float(os.environ.get("SGLANG_CP_SOAK_LONG_S", "3600"))
CYCLE_S = float(os.environ.get("SGLANG_CP_SOAK_CYCLE_S", "600"))
CLIENTS = int(os.environ.get("SGLANG_CP_SOAK_CLIENTS", "8"))
FLUSH_EVERY_S = 20.0
NEW = 8                     # output tokens per request
MAX_TOTAL_TOKENS = 16384    # device KV: 256 pages, well under the working set (~1,200 pages)
HICACHE_RATIO = "2"         # host pool twice the device pool: still under the working set, so L3 is read
L3_CAPACITY_GB = 0.1        # ~330 slots of 295 KB pages (tiny-dsv3): about a quarter of the working set
REQUEST_S = 120.0           # bound of one request
DRAIN_S = 120.0             # bound of waiting for the requests in flight to finish
ERROR_COUNTERS = ("read_errors_total", "crc_errors_total", "header_errors_total", "write_errors_total",
                  "index_mapfull_total", "read_timeouts_total", "write_timeouts_total", "clear_errors_total",
                  "bad_pages_dropped_total")
BALANCE = ("spill_pages_total", "spill_replaced_total", "gc_reclaimed_total", "bad_pages_dropped_total")
RSS_SLACK = (0.15, 256 << 20)
_REFERENCE: dict = {}       # one reference run per worker process (the workload is fixed)


def _reference(root: str) -> tuple:
    """(workload, {key: prompt ids}, {key: output ids}) from a server without HiCache and L3."""
    if _REFERENCE:
        return _REFERENCE["w"], _REFERENCE["prompts"], _REFERENCE["ref"]
    w = build()
    prompts = {("q", d, q): ids for (d, q), ids in w.questions.items()}
    ref: dict = {}
    with server("mla", [], root, "reference", env=kv_env(), max_total_tokens=MAX_TOTAL_TOKENS,
                start_priority=True) as s:
        def one_chat(c):
            return c, chat_turns(w, c, lambda ids: s.generate(ids, NEW, REQUEST_S).output_ids)

        with ThreadPoolExecutor(CLIENTS) as pool:
            keys = list(prompts)
            for key, out in zip(keys, pool.map(lambda k: s.generate(prompts[k], NEW, REQUEST_S).output_ids, keys)):
                ref[key] = out
            for c, (turns, outs) in pool.map(one_chat, range(w.sizes.chats)):
                for t, (ids, out) in enumerate(zip(turns, outs)):
                    prompts[("chat", c, t)], ref[("chat", c, t)] = ids, out
    for key, out in ref.items():  # the shaping works: every answer is the prompt's planted token
        assert out and set(out) == {expected_answer(w, key)}, (key, out)
    _REFERENCE.update(w=w, prompts=prompts, ref=ref)
    return w, prompts, ref


def _l3_cli(*args) -> subprocess.CompletedProcess:
    code = "import sys; from sglang_cp.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "l3", *args], capture_output=True, text=True, timeout=300)


def _l3_stats(cfg: str) -> dict:
    out = _l3_cli("stats", "--cp-l3-config", cfg, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _flags(cfg: str, cold: str, l2_flags: list) -> list:
    return ["--enable-hierarchical-cache", "--hicache-ratio", HICACHE_RATIO, "--hicache-write-policy",
            "write_through", "--hicache-storage-prefetch-policy", "wait_complete", "--enable-cp-l3",
            "--cp-l3-config", cfg, "--cp-l3-cold-start", cold, *l2_flags]


class Phase:
    """One server lifetime under load: client threads, a flusher, a memory sampler."""

    def __init__(self, name, srv, prompts, ref, schedule, pending, lmdb_path):
        self.name, self.srv, self.prompts, self.ref, self.schedule = name, srv, prompts, ref, schedule
        self.pending = list(pending)     # retried first: in flight at the previous server's SIGKILL
        self.retried_in = len(self.pending)
        self.retry_out: list = []        # in flight at this server's SIGKILL
        self.results: list = []          # (key, GenResult, t since spawn)
        self.failures: list = []         # failed on a live server
        self.mismatches: list = []
        self.lock = threading.Lock()
        self.inflight = 0
        self.idle = threading.Condition(self.lock)
        self.stopping = threading.Event()   # no new requests
        self.dying = threading.Event()      # the server is being killed: failures are retries
        self.resume = threading.Event()
        self.resume.set()
        self.flushes = [0, 0]               # ok, refused
        self.rss: list = []                 # (t, scheduler RSS)
        self.lmdb: list = []
        self.lmdb_path = lmdb_path

    def _take(self):
        with self.lock:
            if self.pending:
                return self.pending.pop(0)
            return self.schedule.next()

    def client(self) -> None:
        while not self.stopping.is_set():
            if not self.resume.wait(DRAIN_S + 60):
                self.failures.append("client: paused past its bound")
                return
            if self.stopping.is_set():
                return
            key = self._take()
            with self.lock:
                self.inflight += 1
            try:
                res = self.srv.generate_stream(self.prompts[key], NEW, REQUEST_S)
                with self.lock:
                    self.results.append((key, res, time.monotonic() - self.srv.t0))
                    if res.output_ids != self.ref[key]:
                        self.mismatches.append((key, res.output_ids, self.ref[key]))
            except Exception as e:  # noqa: BLE001 (a killed server: reset, refused, incomplete read)
                with self.lock:
                    if self.dying.is_set():
                        self.retry_out.append(key)
                    else:
                        self.failures.append(f"{key}: {type(e).__name__}: {e}")
            finally:
                with self.lock:
                    self.inflight -= 1
                    self.idle.notify_all()

    def drain(self, timeout_s: float) -> bool:
        with self.lock:
            return self.idle.wait_for(lambda: self.inflight == 0, timeout_s)

    def flusher(self) -> None:
        while not self.stopping.wait(FLUSH_EVERY_S):
            self.resume.clear()
            try:
                if not self.drain(DRAIN_S) or self.stopping.is_set():
                    continue
                try:
                    self.srv.flush_cache()
                    self.flushes[0] += 1
                except RuntimeError:  # HTTP 400: upstream found the server busy (backups, prefetches)
                    self.flushes[1] += 1
                except OSError as e:  # the server is being killed, or a failure
                    if not self.dying.is_set():
                        self.failures.append(f"/flush_cache: {type(e).__name__}: {e}")
            finally:
                self.resume.set()

    def sampler(self) -> None:
        while not self.stopping.wait(2.0):
            self.rss.append((time.monotonic() - self.srv.t0, scheduler_rss(self.srv.proc.pid)))
            if os.path.exists(self.lmdb_path):
                self.lmdb.append(os.path.getsize(self.lmdb_path))


def _settle(srv, timeout_s: float = 60.0) -> dict:
    """Metrics once the spill counter stopped moving for 3 s (write-through backups run after a request)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        m = srv.metrics()
        v = m.get(METRIC("spill_pages_total"), 0.0)
        if v != last:
            last, since = v, time.monotonic()
        elif time.monotonic() - since >= 3.0:
            return m
        time.sleep(0.5)
    return srv.metrics()


def _run_phase(k, cold, end, load_s, cfg, root, l2_flags, prompts, ref, schedule, pending) -> tuple:
    lmdb_path = os.path.join(os.path.dirname(cfg), "index", "data.mdb")
    srv = server("mla", _flags(cfg, cold, l2_flags), root, f"soak{k}-{cold}", env=kv_env(),
                 max_total_tokens=MAX_TOTAL_TOKENS, start_priority=True).start()
    ph = Phase(f"{k}:{cold}->{end}", srv, prompts, ref, schedule, pending, lmdb_path)
    rep = {"phase": ph.name, "cold_start": cold, "end": end, "startup_s": round(srv.startup_s, 1)}
    try:
        m0 = srv.metrics()
        text = srv.metrics_text()
        for name in ("spill_replaced_total", "bad_pages_dropped_total", "gc_reclaimed_total", "used_slots"):
            assert METRIC(name) in text, f"{METRIC(name)} missing from /metrics"
        if cold == "load":
            cs = _l3_stats(cfg)["last_cold_start"]
            rep["load"] = {"live": sum(r.get("live", 0) for r in cs), "dropped": sum(r.get("dropped", 0) for r in cs),
                           "seconds": max((r.get("seconds", 0) for r in cs), default=0)}
        rep["used_start"] = m0.get(METRIC("used_slots"), 0.0)
        threads = [threading.Thread(target=ph.client, daemon=True) for _ in range(CLIENTS)]
        threads += [threading.Thread(target=ph.flusher, daemon=True), threading.Thread(target=ph.sampler, daemon=True)]
        for t in threads:
            t.start()
        t_end = time.monotonic() + load_s
        last_m = m0
        while time.monotonic() < t_end:
            time.sleep(min(2.0, max(0.0, t_end - time.monotonic())))
            last_m = srv.metrics()
        if end == "kill":  # mid-load: the clients are still sending
            ph.dying.set()
            ph.stopping.set()
            last_m = srv.metrics()
            srv.kill(signal.SIGKILL)
        else:
            ph.stopping.set()
            ph.resume.set()
        for t in threads:
            t.join(REQUEST_S + DRAIN_S)
        assert not any(t.is_alive() for t in threads), "a client did not finish within its bound"
        if end == "stop":
            while ph.pending:  # requests retried from an earlier kill, not reached in the load time
                key = ph.pending.pop(0)
                res = srv.generate_stream(prompts[key], NEW, REQUEST_S)
                ph.results.append((key, res, time.monotonic() - srv.t0))
                if res.output_ids != ref[key]:
                    ph.mismatches.append((key, res.output_ids, ref[key]))
            last_m = _settle(srv)
            stats = _l3_stats(cfg)
            rep["used_stats"] = sum(r["used"] for r in stats["slabs"])
            rep["map_size"] = stats["index"]["map_size"] if stats["index"] else None
        rep["used_end"] = last_m.get(METRIC("used_slots"), 0.0)
        rep["counters"] = {c: last_m.get(METRIC(c), 0.0) - m0.get(METRIC(c), 0.0) for c in BALANCE + ERROR_COUNTERS}
        rep["counters"]["reload_pages_total"] = last_m.get(METRIC("reload_pages_total"), 0.0)
        rep["errors_moved"] = {c: last_m.get(METRIC(c), 0.0) for c in ERROR_COUNTERS if last_m.get(METRIC(c), 0.0)}
    finally:
        ph.stopping.set()
        ph.resume.set()
        srv.stop()
    toks = [(len(prompts[key]), r) for key, r, _t in ph.results]
    total = max(1, sum(n for n, _ in toks))
    storage_hits = [t for key, r, t in ph.results if r.storage_tokens > 0]
    half = len(ph.rss) // 2
    rep.update(
        answered=len(ph.results), retried_in=ph.retried_in, retry_out=len(ph.retry_out),
        failures=ph.failures[:5], n_failures=len(ph.failures), mismatches=ph.mismatches[:3],
        n_mismatches=len(ph.mismatches), flushes_ok=ph.flushes[0], flushes_refused=ph.flushes[1],
        device_hit=sum(r.device_tokens for _, r in toks) / total, host_hit=sum(r.host_tokens for _, r in toks) / total,
        storage_hit=sum(r.storage_tokens for _, r in toks) / total,
        ttft_p50_s=percentile([r.ttft_s for _, r in toks if r.ttft_s is not None], 50),
        ttft_p99_s=percentile([r.ttft_s for _, r in toks if r.ttft_s is not None], 99),
        first_storage_hit_s=min(storage_hits) if storage_hits else None,
        rss_first_half=max((v for _, v in ph.rss[:half]), default=0),
        rss_second_half=max((v for _, v in ph.rss[half:]), default=0),
        lmdb_max=max(ph.lmdb, default=0))
    return rep, ph.retry_out


def _soak(total_s: float, long: bool, l2_flags: list, root: str, request) -> list:
    cfg = write_l3_config(root, capacity_gb=L3_CAPACITY_GB)
    w, prompts, ref = _reference(root)
    schedule, pending, reports, lines = Schedule(w), [], [], []
    try:
        for k, (cold, end, load_s) in enumerate(phase_plan(total_s, long, CYCLE_S)):
            rep, pending = _run_phase(k, cold, end, load_s, cfg, root, l2_flags, prompts, ref, schedule, pending)
            reports.append(rep)
            lines.append(_phase_line(rep))
            print(lines[-1], flush=True)
    finally:
        # A report section survives what a print does not: pytest-xdist drops a worker's stdout under
        # -s, and the phase figures are the run's result (pass or fail), shown by -rA.
        request.node.add_report_section("call", "soak phases", "\n".join(lines) or "no phase completed")
    fsck = _l3_cli("fsck", "--cp-l3-config", cfg, "--json")
    summary = fsck_summary(fsck.stdout, fsck.returncode)
    request.node.add_report_section("call", "soak fsck", fsck_line(summary))
    out_dir = os.environ.get("SGLANG_CP_SOAK_OUT", root)
    with open(os.path.join(out_dir, f"soak-{os.getpid()}-{int(time.time())}.json"), "w") as f:
        json.dump({"phases": reports, "fsck": summary}, f, indent=1, default=str)
    _check(reports, pending, fsck)
    return reports


def _phase_line(r: dict) -> str:
    c = r["counters"]
    ttft = lambda v: "-" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
    return (f"soak phase {r['phase']}: start {r['startup_s']} s"
          + (f", load live {r['load']['live']} dropped {r['load']['dropped']} in {r['load']['seconds']:.2f} s"
             if "load" in r else "")
          + (f", first storage hit {r['first_storage_hit_s']:.1f} s after spawn" if r["first_storage_hit_s"] else "")
          + f"; {r['answered']} answered ({r['retried_in']} retried from a kill, {r['retry_out']} in flight at "
            f"the end), {r['n_failures']} failed, {r['n_mismatches']} ids differ; hits device {r['device_hit']:.0%} "
            f"host {r['host_hit']:.0%} storage {r['storage_hit']:.0%}; pages spilled {c['spill_pages_total']:.0f} "
            f"replaced {c['spill_replaced_total']:.0f} reclaimed {c['gc_reclaimed_total']:.0f} reloaded "
            f"{c['reload_pages_total']:.0f}; used slots {r['used_start']:.0f} -> {r['used_end']:.0f}"
          + (f" (l3 stats {r['used_stats']})" if "used_stats" in r else "")
          + f"; TTFT p50 {ttft(r['ttft_p50_s'])} p99 {ttft(r['ttft_p99_s'])}; flushes {r['flushes_ok']} "
            f"(+{r['flushes_refused']} refused); scheduler RSS {r['rss_first_half'] / 1e6:.0f} -> "
            f"{r['rss_second_half'] / 1e6:.0f} MB; LMDB file {r['lmdb_max'] / 1e6:.1f} MB")


def _violations(reports: list, pending: list, fsck) -> list:
    """Every broken invariant of the run, not only the first: a soak costs minutes of a GPU."""
    bad = []

    def need(ok, what) -> None:
        if not ok:
            bad.append(str(what))

    need(not pending, f"{len(pending)} request(s) never answered")
    need(sum(r["retry_out"] for r in reports) == sum(r["retried_in"] for r in reports), "retries not balanced")
    for r in reports:
        p = r["phase"]
        need(r["n_failures"] == 0, (p, "failures", r["failures"]))
        need(r["n_mismatches"] == 0, (p, "ids differ", r["mismatches"]))
        need(r["answered"] > 0, (p, "nothing answered"))
        need(not r["errors_moved"], (p, "error counters moved", r["errors_moved"]))
        if "load" in r:
            need(r["load"]["dropped"] == 0 and r["load"]["live"] == r["used_start"], (p, "load", r["load"]))
        if r["end"] == "stop":
            c = r["counters"]
            balance = c["spill_pages_total"] - c["spill_replaced_total"] - c["gc_reclaimed_total"] \
                - c["bad_pages_dropped_total"]
            need(balance == r["used_end"] - r["used_start"], (p, "slot balance", balance, r["used_start"], r["used_end"]))
            need(r["used_stats"] == r["used_end"], (p, "l3 stats vs metrics", r["used_stats"], r["used_end"]))
            need(r["map_size"] is None or r["lmdb_max"] <= r["map_size"], (p, "LMDB past its map", r["lmdb_max"]))
        frac, slack = RSS_SLACK
        if r["rss_first_half"]:
            need(r["rss_second_half"] <= r["rss_first_half"] * (1 + frac) + slack,
                 (p, "scheduler RSS grew", r["rss_first_half"], r["rss_second_half"]))
    need(sum(r["counters"]["gc_reclaimed_total"] for r in reports) > 0, "GC never ran: capacity not below the working set")
    need(sum(r["counters"]["reload_pages_total"] for r in reports) > 0, "nothing was ever read from L3")
    need(any(r["end"] == "kill" for r in reports) and any(r["end"] == "stop" and r["cold_start"] == "load"
                                                          for r in reports), "no kill, or no graceful stop after load")
    need(fsck.returncode == 0, ("fsck", fsck.stdout[-3000:] + fsck.stderr[-2000:]))
    return bad


def _check(reports: list, pending: list, fsck) -> None:
    bad = _violations(reports, pending, fsck)
    assert not bad, f"{len(bad)} soak invariant(s) broken:\n" + "\n".join(bad)


def _l2(kind: str, request) -> list:
    if kind == "pinned":
        return []
    mnt = request.getfixturevalue("hugetlbfs")
    return ["--enable-cp-shared-physical-l2-hicache", "--cp-shared-l2-hugetlbfs-dir", mnt,
            "--cp-hicache-max-slab-gb", "1"]


@pytest.mark.parametrize("l2", ["pinned", pytest.param("hugepage", marks=pytest.mark.xdist_group("hugepages"))])
def test_soak_short(l2, request, tmp_path_factory):
    _soak(SOAK_S, False, _l2(l2, request), base_dir(tmp_path_factory, f"soak-{l2}"), request)


@pytest.mark.slow
def test_soak_long(request, tmp_path_factory):
    _soak(LONG_S, True, [], base_dir(tmp_path_factory, "soak-long"), request)
