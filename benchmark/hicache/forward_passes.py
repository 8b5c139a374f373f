"""Upstream's per-forward telemetry for a bench_peers phase (``bench_peers run --forward-metrics``).

SGLang 0.5.23 publishes one ``ForwardPassMetrics`` message per forward pass over a ZMQ PUB socket when a
server runs with ``--enable-forward-pass-metrics`` (``sglang/srt/observability/forward_pass_metrics.py``):
``wall_time``, the GPU span of the model's forward call (CUDA events from its first kernel's start to its
last kernel's end on one stream, gaps between kernels included; batch loading, attention metadata and
sampling are outside it), and what the forward carried (prefill requests, their new and cached tokens,
decode requests). Only the scheduler of attention-TP rank 0 on the last pipeline rank publishes, to
``<--forward-pass-metrics-ipc-name>.<dp rank>``; ``bench_peers`` refuses the flag with data parallelism,
since it listens to DP rank 0.

Why a storage benchmark wants it: the peers servers run without CUDA graphs, so the forward's kernels are
launched by the scheduler's Python thread, and where the GPU runs out of queued kernels (small decode
batches) a thread kept from its launches, by the GIL held by storage work in the same process, shows as
a longer span. Decode-only spans are the ones to compare across tiers: a prefill span of a pool hit also
holds the layer-by-layer waits for its KV's transfer to the device, and a large prefill keeps the GPU
queued past any stall. The phase's wall time less the spans is everything else: scheduling, batch setup,
sampling, idle time.

Lifecycle: ``Listener(endpoint)`` subscribes before the server starts (ZMQ keeps retrying the connect until
the scheduler binds), ``wait_connected()`` returns once the two sockets have shaken hands (a SUB socket
misses what is published before its subscription reaches the publisher), ``quiet()`` drops what arrived
before a phase (the tier's warm request: its spans come after its answer, so it waits until none has come
for a moment), ``take()`` hands over what arrived since, ``close()`` ends the thread, bounded.
``summarize`` turns a phase's records into the dict the report reads. ``lost`` counts the gaps in the
publisher's sequence numbers, which are what its socket dropped (ZMQ's high-water mark); a message the
publisher dropped before numbering it (its queue full, a span across CUDA streams) leaves no gap and is not
counted. A message of another schema version, or one that does not decode, is ``undecodable``.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from benchmark.hicache.peer_report import percentile

POLL_MS = 200  # how long the listener's thread blocks in one receive before it looks at its stop flag
CLOSE_S = 2.0  # bound on joining that thread
# After the handshake the SUB socket sends its subscription at once; the publisher's I/O thread takes it in
# well under this on one host.
SUBSCRIBE_GRACE_S = 0.1
QUIET_S = 0.5  # no forward for this long: the server is idle (its idle heartbeats are no forwards)
SCHEMA_VERSION = 1  # upstream's FPM_VERSION this reader knows


def server_flags(endpoint: str) -> list:
    """The launch_server arguments that make its scheduler publish to ``endpoint``.0."""
    return ["--enable-forward-pass-metrics", "--forward-pass-metrics-ipc-name", endpoint]


def record(seq: int, msg: dict, received: float) -> Optional[dict]:
    """One decoded message as the row ``summarize`` reads; None for an idle heartbeat (all zeros). Raises
    ValueError for a message of another schema version."""
    if not isinstance(msg, dict) or msg.get("version") != SCHEMA_VERSION:
        raise ValueError(f"forward-pass message of schema {msg.get('version') if isinstance(msg, dict) else '?'}, "
                         f"this reader knows {SCHEMA_VERSION}")
    s = msg.get("scheduled_requests") or {}
    prefill, decode = int(s.get("num_prefill_requests") or 0), int(s.get("num_decode_requests") or 0)
    span = float(msg.get("wall_time") or 0.0)
    if not prefill and not decode and span == 0.0:
        return None
    return {"seq": seq, "t": received, "span_s": span, "prefill_reqs": prefill,
            "prefill_tokens": int(s.get("sum_prefill_tokens") or 0),
            "prefill_kv_tokens": int(s.get("sum_prefill_kv_tokens") or 0), "decode_reqs": decode,
            "queued_prefill_reqs": int((msg.get("queued_requests") or {}).get("num_prefill_requests") or 0)}


class Listener:
    """A ZMQ SUB socket on ``endpoint``.``dp_rank`` and the thread that drains it."""

    def __init__(self, endpoint: str, dp_rank: int = 0):
        import msgspec
        import zmq

        self.endpoint = f"{endpoint}.{dp_rank}"
        self._decode = msgspec.msgpack.Decoder().decode
        self._zmq = zmq
        self._ctx = zmq.Context()
        try:
            self._sock = self._ctx.socket(zmq.SUB)
            self._sock.setsockopt(zmq.SUBSCRIBE, b"")
            self._sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
            # Handshakes are watched from the caller's thread on a socket of their own (a ZMQ socket is not
            # shared between threads): wait_connected() reads it.
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._sock.connect(self.endpoint)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.connected = False
        self._lock = threading.Lock()
        self._rows: list = []
        self._seqs: list = []  # sequence numbers since the last take, heartbeats and undecodable ones too
        self._last_seq: Optional[int] = None  # the last one handed over: a gap across two takes counts too
        self._bad = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fpm-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    frames = self._sock.recv_multipart()
                except self._zmq.Again:
                    continue
                now = time.monotonic()
                seq, row = None, None
                try:
                    seq = int.from_bytes(frames[1], "big") if len(frames) == 3 and len(frames[1]) == 8 else None
                    row = record(seq, self._decode(frames[2]), now)
                except Exception:  # another schema or a torn message: counted, not guessed at
                    seq = seq if seq is not None else -1
                    with self._lock:
                        self._bad += 1
                        if seq >= 0:
                            self._seqs.append(seq)
                    continue
                with self._lock:
                    self._seqs.append(seq)
                    if row is not None:
                        self._rows.append(row)
        finally:  # the thread that used the socket closes it: close() never touches a socket in use
            self._sock.disable_monitor()
            self._sock.close(linger=0)

    def wait_connected(self, timeout_s: float) -> bool:
        """True once the publisher has accepted this subscriber (bounded by ``timeout_s``)."""
        if not self.connected and self._monitor.poll(int(timeout_s * 1000)):
            self._monitor.recv_multipart()
            time.sleep(SUBSCRIBE_GRACE_S)
            self.connected = True
        return self.connected

    def quiet(self, max_s: float) -> dict:
        """Everything up to the point where no forward has arrived for QUIET_S (bounded by ``max_s``), as
        ``take`` gives it."""
        deadline = time.monotonic() + max_s
        taken = self.take()
        while time.monotonic() < deadline:
            time.sleep(QUIET_S)
            more = self.take()
            taken = {"rows": taken["rows"] + more["rows"], "messages": taken["messages"] + more["messages"],
                     "lost": taken["lost"] + more["lost"], "undecodable": taken["undecodable"] + more["undecodable"]}
            if not more["rows"]:
                break
        return taken

    def take(self) -> dict:
        """What arrived since the last call: ``rows`` (forwards), ``messages`` (heartbeats too), ``lost``
        (gaps in the publisher's sequence numbers among them) and ``undecodable``."""
        with self._lock:
            rows, seqs, bad = self._rows, self._seqs, self._bad
            self._rows, self._seqs, self._bad = [], [], 0
        chain = ([self._last_seq] if self._last_seq is not None else []) + seqs
        lost = sum(max(0, b - a - 1) for a, b in zip(chain, chain[1:]))
        if seqs:
            self._last_seq = seqs[-1]
        return {"rows": rows, "messages": len(seqs), "lost": lost, "undecodable": bad}

    def close(self) -> None:
        """Ends the thread (it closes its socket on the way out) and the context; bounded by CLOSE_S. A
        thread that did not end in time is a daemon blocked in one bounded receive: its context is left
        to the process's exit rather than torn down under it."""
        self._stop.set()
        self._thread.join(timeout=CLOSE_S)
        self._monitor.close(linger=0)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)


def summarize(taken: dict, wall_s: float) -> dict:
    """A phase's forwards: prefill forwards (any prefill request; mixed ones too) and decode-only ones, each
    with its count and spans, and the spans' share of the phase's wall time."""
    rows = taken["rows"]
    prefill = [r for r in rows if r["prefill_reqs"]]
    decode = [r for r in rows if not r["prefill_reqs"] and r["decode_reqs"]]
    tokens = sum(r["prefill_tokens"] for r in prefill)
    span_p = sum(r["span_s"] for r in prefill)
    dspans = [r["span_s"] for r in decode]
    busy = sum(r["span_s"] for r in rows)
    return {
        "forwards": len(rows), "lost": taken["lost"], "undecodable": taken["undecodable"],
        "prefill": {"n": len(prefill), "tokens": tokens, "kv_tokens": sum(r["prefill_kv_tokens"] for r in prefill),
                    "span_s": span_p, "ms_per_1k_tokens": (1e6 * span_p / tokens) if tokens else None},
        "decode": {"n": len(decode), "span_s": sum(dspans), "p50_ms": None if not dspans else 1e3 * percentile(dspans, 50),
                   "p90_ms": None if not dspans else 1e3 * percentile(dspans, 90)},
        "busy_s": busy, "busy_share": (busy / wall_s) if wall_s else None,
    }
