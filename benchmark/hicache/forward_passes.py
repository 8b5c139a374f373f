"""Upstream's per-forward telemetry for a bench_peers phase (``bench_peers run --forward-metrics``).

SGLang 0.5.23 publishes one ``ForwardPassMetrics`` message per forward pass over a ZMQ PUB socket when a
server runs with ``--enable-forward-pass-metrics`` (``sglang/srt/observability/forward_pass_metrics.py``):
``wall_time``, the forward's GPU span from its first kernel's start to its last kernel's end on one
stream (CUDA events, launch gaps included), and what the forward carried (prefill requests, their new and
cached tokens, decode requests). The scheduler binds ``<--forward-pass-metrics-ipc-name>.<dp rank>``.

Why a storage benchmark wants it: the peers servers run without CUDA graphs, so every kernel of a forward
is launched by the scheduler's Python thread, and a forward whose launches wait for the GIL (held by
storage work in the same process: a backup's index commit, a prefetch's bookkeeping) shows it as a longer
span. Two tiers' spans for forwards of the same kind, on the same workload and GPU, tell whether storage
work in the server process slows its forwards; the phase's wall time less the spans is what the scheduler
spent between forwards.

Lifecycle: ``Listener(endpoint)`` subscribes before the server starts (ZMQ keeps retrying the connect until
the scheduler binds), ``wait_connected()`` returns once the two sockets have shaken hands (a SUB socket
misses what is published before its subscription reaches the publisher), ``quiet()`` drops what arrived before a phase (the tier's warm request: its spans come
after its answer, so it waits until none has come for a moment), ``take()`` hands over what arrived since,
``close()`` ends the thread, bounded. ``summarize`` turns a
phase's records into the dict the report reads. Messages the publisher could not send (its queue full,
ZMQ's high-water mark) leave gaps in its sequence numbers: counted as ``lost``, never guessed.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

POLL_MS = 200  # how long the listener's thread blocks in one receive before it looks at its stop flag
CLOSE_S = 2.0  # bound on joining that thread
# After the handshake the SUB socket sends its subscription at once; the publisher's I/O thread takes it in
# well under this on one host.
SUBSCRIBE_GRACE_S = 0.1
QUIET_S = 0.5  # no forward for this long: the server is idle (its idle heartbeats are no forwards)


def server_flags(endpoint: str) -> list:
    """The launch_server arguments that make its scheduler publish to ``endpoint``.0."""
    return ["--enable-forward-pass-metrics", "--forward-pass-metrics-ipc-name", endpoint]


def record(seq: int, msg: dict, received: float) -> Optional[dict]:
    """One decoded message as the row ``summarize`` reads; None for an idle heartbeat (all zeros)."""
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
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
        # Handshakes are watched from the caller's thread on a socket of their own (a ZMQ socket is not shared
        # between threads): wait_connected() reads it.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.connected = False
        self._sock.connect(self.endpoint)
        self._zmq = zmq
        self._lock = threading.Lock()
        self._rows: list = []
        self._seqs: list = []  # every message's sequence number, heartbeats too: gaps are lost messages
        self._bad = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fpm-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except self._zmq.Again:
                continue
            except self._zmq.ZMQError:
                break  # the socket closed under us: close() is running
            now = time.monotonic()
            try:
                seq = int.from_bytes(frames[1], "big")
                row = record(seq, self._decode(frames[2]), now)
            except Exception:  # another schema or a torn message: counted, not guessed at
                with self._lock:
                    self._bad += 1
                continue
            with self._lock:
                self._seqs.append(seq)
                if row is not None:
                    self._rows.append(row)

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
        lost = sum(max(0, b - a - 1) for a, b in zip(seqs, seqs[1:]))
        return {"rows": rows, "messages": len(seqs), "lost": lost, "undecodable": bad}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CLOSE_S)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()


def _pct(xs: list, q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


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
        "decode": {"n": len(decode), "span_s": sum(dspans), "p50_ms": None if not dspans else 1e3 * _pct(dspans, 50),
                   "p90_ms": None if not dspans else 1e3 * _pct(dspans, 90)},
        "busy_s": busy, "busy_share": (busy / wall_s) if wall_s else None,
    }
