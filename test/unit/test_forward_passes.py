"""bench_peers --forward-metrics: upstream's per-forward telemetry, read the way a real server sends it.

The publisher is SGLang 0.5.23's own (``_FpmPublisherThread`` and ``ForwardPassMetrics`` from
``sglang/srt/observability/forward_pass_metrics.py``) over a real ZMQ ipc socket; only the forwards are
made up, since no GPU runs here.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from benchmark.hicache import bench_peers as bench
from benchmark.hicache import forward_passes as fp
from benchmark.hicache import peer_report as report
from benchmark.hicache import peer_tiers as tiers
from benchmark.hicache import peer_workloads as wl

fpm = pytest.importorskip("sglang.srt.observability.forward_pass_metrics")
zmq = pytest.importorskip("zmq")

WAIT_S = 10.0  # bound on waiting for a message over a local socket


def forward(prefill=0, tokens=0, cached=0, decode=0, span=0.0):
    return fpm.ForwardPassMetrics(worker_id="w", wall_time=span, scheduled_requests=fpm.ScheduledRequestMetrics(
        num_prefill_requests=prefill, sum_prefill_tokens=tokens, sum_prefill_kv_tokens=cached,
        num_decode_requests=decode))


PROBE_DECODES = 99  # a probe forward's mark: no measured forward here carries 99 decode requests


def wait_rows(listener, n):
    """What the listener took once it holds at least n forwards (bounded)."""
    got = {"rows": [], "messages": 0, "lost": 0, "undecodable": 0}
    deadline = time.monotonic() + WAIT_S
    while len(got["rows"]) < n and time.monotonic() < deadline:
        t = listener.take()
        got = {"rows": got["rows"] + t["rows"], "messages": got["messages"] + t["messages"],
               "lost": got["lost"] + t["lost"], "undecodable": got["undecodable"] + t["undecodable"]}
        time.sleep(0.05)
    assert not any(r["decode_reqs"] == PROBE_DECODES for r in got["rows"]), "a probe arrived after the drain"
    return got


def subscribed(listener, publish):
    """Publish probes until one arrives (a SUB socket misses what is sent before it has joined), then drain
    the listener until nothing has come for a while, so no late probe lands among the measured rows."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        publish(forward(decode=PROBE_DECODES, span=0.001))
        time.sleep(0.05)
        if listener.take()["rows"]:
            listener.quiet(WAIT_S)
            return
    pytest.fail(f"no message reached {listener.endpoint} in {WAIT_S} s")


def test_a_phase_of_upstreams_forwards_is_summarized_per_kind(tmp_path):
    """The listener connects first (as bench_peers does, before the server starts), upstream's publisher binds
    <endpoint>.0; prefill and decode forwards are counted and timed per kind, nothing is lost."""
    endpoint = f"ipc://{tmp_path}/replay"
    listener = fp.Listener(endpoint)
    pub = fpm._FpmPublisherThread(f"{endpoint}.0", worker_id="w", dp_rank=0)
    try:
        subscribed(listener, pub.publish)
        sent = [forward(prefill=1, tokens=8192, cached=0, span=0.40), forward(prefill=1, tokens=8192, cached=8192, span=0.60),
                forward(prefill=2, tokens=1024, cached=32768, decode=3, span=0.10)]
        sent += [forward(decode=d, span=s) for d, s in ((8, 0.010), (8, 0.020), (7, 0.030), (6, 0.040))]
        for m in sent:
            pub.publish(m)
        taken = wait_rows(listener, len(sent))
    finally:
        pub.shutdown()
        listener.close()
    assert taken["lost"] == 0 and taken["undecodable"] == 0 and len(taken["rows"]) == len(sent)
    got = fp.summarize(taken, wall_s=2.4)
    assert got["forwards"] == 7
    assert got["prefill"] == {"n": 3, "tokens": 17408, "kv_tokens": 40960, "span_s": pytest.approx(1.10),
                              "ms_per_1k_tokens": pytest.approx(1.10e6 / 17408)}
    assert got["decode"]["n"] == 4 and got["decode"]["span_s"] == pytest.approx(0.10)
    assert got["decode"]["p50_ms"] == pytest.approx(25.0) and got["decode"]["p90_ms"] == pytest.approx(37.0)
    assert got["busy_s"] == pytest.approx(1.20) and got["busy_share"] == pytest.approx(0.5)


def test_gaps_in_the_publishers_sequence_are_lost_messages_and_heartbeats_are_no_forwards(tmp_path):
    """Frames as upstream's publisher sends them (topic, 8-byte sequence number, msgpack), from a plain PUB
    socket so the sequence can skip: a skipped number is a lost message, an idle heartbeat (all zeros) is a
    message but no forward, and a frame that does not decode is counted, not guessed at."""
    endpoint = f"ipc://{tmp_path}/gaps"
    listener = fp.Listener(endpoint)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.bind(f"{endpoint}.0")
    seq = iter(range(10_000))

    def send(m, n=None):
        sock.send_multipart((b"", (next(seq) if n is None else n).to_bytes(8, "big"), fpm.encode(m)))

    try:
        subscribed(listener, send)
        n = next(seq)  # the next number after the probes': a gap across two takes counts too
        send(forward(decode=1, span=0.01), n + 1)  # n itself never sent
        send(fpm.ForwardPassMetrics(worker_id="w"), n + 2)  # the idle heartbeat
        send(forward(decode=1, span=0.02), n + 5)  # n + 3 and n + 4 never sent
        sock.send_multipart((b"", (n + 6).to_bytes(8, "big"), b"\xc1"))  # msgpack's never-used byte
        send(fpm.ForwardPassMetrics(version=2, wall_time=0.5), n + 7)  # a schema this reader does not know
        send(forward(prefill=1, tokens=100, span=0.03), n + 8)
        taken = wait_rows(listener, 3)
    finally:
        listener.close()
        sock.close(linger=0)
        ctx.term()
    assert len(taken["rows"]) == 3 and taken["messages"] == 6 and taken["undecodable"] == 2
    assert taken["lost"] == 3  # n, n + 3, n + 4
    assert fp.summarize(taken, 0.0)["busy_share"] is None
    assert not [t for t in threading.enumerate() if t.name == "fpm-listener" and t.is_alive()]


FPM_SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, sys.argv[3])
from suite_helpers import answer_generate
from sglang.srt.observability.forward_pass_metrics import (
    ForwardPassMetrics, ScheduledRequestMetrics, _FpmPublisherThread)

# As the scheduler does at its start, with --enable-forward-pass-metrics: bind <--forward-pass-metrics-ipc-name>.0.
argv = sys.argv[4:]
pub = None
if "--enable-forward-pass-metrics" in argv:
    pub = _FpmPublisherThread(argv[argv.index("--forward-pass-metrics-ipc-name") + 1] + ".0", worker_id="", dp_rank=0)


class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(body["input_ids"])  # one prefill forward for the prompt, one decode forward for its token
        if pub is not None:
            self.forwards(n)
        chunk = {"output_ids": [1], "meta_info": {"cached_tokens": 0, "cached_tokens_details": {}}}
        answer_generate(self, chunk, bool(body.get("stream")))

    @staticmethod
    def forwards(n):
        pub.publish(ForwardPassMetrics(wall_time=n / 1e5, scheduled_requests=ScheduledRequestMetrics(
            num_prefill_requests=1, sum_prefill_tokens=n)))
        pub.publish(ForwardPassMetrics(wall_time=0.005, scheduled_requests=ScheduledRequestMetrics(
            num_decode_requests=1)))

    def log_message(self, *a):
        pass


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_tier_run_with_forward_metrics_records_each_phases_forwards_and_not_the_warm_up(tmp_path, monkeypatch):
    """run_tier on the harness's real process lifecycle with a stand-in for launch_server that publishes
    through upstream's publisher where --forward-pass-metrics-ipc-name tells it to: each phase's row holds
    its own forwards (the tier's warm request's are left out), the report prints them, and without the flag
    no server gets the upstream flags."""
    script = tmp_path / "fpm_server.py"
    script.write_text(FPM_SERVER)
    flags_seen = []

    class Stand(bench.harness.ServerProcess):
        def command(self):
            flags_seen.append(list(map(str, self.extra_args)))
            return [sys.executable, str(script), str(self.port), "-",
                    os.path.dirname(os.path.dirname(__file__)), *map(str, self.extra_args)]

    monkeypatch.setattr(bench.harness, "ServerProcess", Stand)
    monkeypatch.setattr(bench, "COUNTER_SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "STORAGE_SETTLE_S", 0.3)
    monkeypatch.setattr(bench, "SETTLE_POLL_S", 0.05)
    s = tiers.TierSettings(work_dir=str(tmp_path / "w"), host_gb=1, disk_gb=1, free_port=bench.harness.free_port,
                           prefetch_policy="wait_complete")
    store = tmp_path / "w" / "t" / "kv"
    tier = tiers.Tier("t", [], "a stand-in", storage_dirs=[str(store)])
    prompts = [wl.Prompt(("d0",), 128, 1), wl.Prompt(("d1",), 192, 1)]
    tokens = wl.BlockTokens(64, 1000, seed=0)

    def run(*extra):
        args = bench.parser().parse_args(["run", "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path),
                                          "--block-tokens", "64", "--concurrency", "1", *extra])
        return bench.run_tier(tier, s, prompts, tokens, args, "unused-model", [], {"startup_timeout_s": 60}, {})

    rec = run("--forward-metrics")
    assert rec["error"] is None, rec.get("log")
    assert sorted(rec["phases"]) == ["replay", "restart"]
    assert rec["phases"]["replay"]["forward_passes"]["messages_before"] == 2  # the tier's warm request, off the clock
    for phase in ("replay", "restart"):
        f = rec["phases"][phase]["forward_passes"]
        assert f["forwards"] == 4 and f["lost"] == 0
        assert f["prefill"]["n"] == 2 and f["prefill"]["tokens"] == sum(len(tokens.prompt(p)) for p in prompts)
        assert f["decode"]["n"] == 2 and f["decode"]["p50_ms"] == pytest.approx(5.0)
    endpoints = [fl[fl.index("--forward-pass-metrics-ipc-name") + 1] for fl in flags_seen]
    assert len(set(endpoints)) == 2 and all("--enable-forward-pass-metrics" in fl for fl in flags_seen)
    assert not any(os.path.exists(e[len("ipc://"):].rsplit("/", 1)[0]) for e in endpoints)  # its directory went
    assert all(rec["phases"][p]["forward_passes"]["connected"] for p in ("replay", "restart"))
    md = report.markdown({"meta": {}, "prompts": [], "tiers": [rec]}, [])
    assert "| t | replay | 4 (0 / 0) | 2, 128 / 0 |" in md and "`--forward-metrics`" in md
    rec["phases"]["restart"]["forward_passes"]["connected"] = False  # zeros would read as a measurement
    assert "| t | restart | not connected:" in report.markdown({"meta": {}, "prompts": [], "tiers": [rec]}, [])
    assert not [t for t in threading.enumerate() if t.name == "fpm-listener" and t.is_alive()]

    flags_seen.clear()
    plain = run()
    assert plain["error"] is None and "forward_passes" not in plain["phases"]["replay"]
    assert not any("--enable-forward-pass-metrics" in fl for fl in flags_seen)
    assert "`--forward-metrics`" not in report.markdown({"meta": {}, "prompts": [], "tiers": [plain]}, [])
    json.dumps(rec)  # what the run saves


def test_a_server_that_never_starts_with_forward_metrics_ends_its_tier_and_leaves_nothing(tmp_path, monkeypatch):
    """The flag on, a stand-in for launch_server that exits at once: the tier is an error row, its listener's
    thread has ended and its socket directory is gone; data parallelism with the flag is refused at parse."""
    script = tmp_path / "dies.py"
    script.write_text("import sys\nsys.exit(3)\n")
    dirs = []

    class Stand(bench.harness.ServerProcess):
        def command(self):
            fl = list(map(str, self.extra_args))
            dirs.append(fl[fl.index("--forward-pass-metrics-ipc-name") + 1][len("ipc://"):].rsplit("/", 1)[0])
            return [sys.executable, str(script)]

    monkeypatch.setattr(bench.harness, "ServerProcess", Stand)
    s = tiers.TierSettings(work_dir=str(tmp_path / "w"), host_gb=1, disk_gb=1, free_port=bench.harness.free_port,
                           prefetch_policy="wait_complete")
    args = bench.parser().parse_args(["run", "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path),
                                      "--block-tokens", "64", "--forward-metrics"])
    rec = bench.run_tier(tiers.Tier("t", [], "a stand-in"), s, [wl.Prompt(("d0",), 64, 1)],
                         wl.BlockTokens(64, 1000, seed=0), args, "unused-model", [], {"startup_timeout_s": 30}, {})
    assert rec["error"].startswith("did not start") and rec["phases"] == {}
    assert dirs and not any(os.path.exists(d) for d in dirs)
    assert not [t for t in threading.enumerate() if t.name == "fpm-listener" and t.is_alive()]
    with pytest.raises(SystemExit, match=r"--forward-metrics with --server-arg --dp-size=2: it listens to "
                                         r"data-parallel rank 0 only"):
        bench.main(["run", "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path), "--forward-metrics",
                    "--server-arg=--dp-size=2"])
