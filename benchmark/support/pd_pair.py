"""A PD pair: one prefill worker and one decode worker (two ``ServerProcess``), driven the way upstream's
router drives them, for the two-GPU test and the TTFT benchmark of a CP-sharded prefill worker.

Upstream's PD protocol from the client's side: the same request goes to both workers at once, with the
prefill worker's bootstrap address and one random ``bootstrap_room`` that pairs the two halves; the
prefill worker computes (or restores) the prefix KV and sends it to the decode worker, which answers.
So a request's first token is the decode worker's answer, and where the prefix came from (device, host,
L3) is the prefill worker's ``cached_tokens_details``: L3 lives on the prefill worker.

Upstream runs ``--enable-kv-cache-sharding`` only on a PD prefill worker with a real transfer backend
(mooncake or nixl), and on sm90 with the ``fa3`` prefill backend for non-DSA models
(``arg_groups/kv_shard_hook.py``); ``sharded_prefill_args`` is that flag set. Imports no sglang.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, replace
from typing import Optional

from .server_process import GenResult, ServerProcess


def sharded_prefill_args(cp: int, bootstrap_port: int, transfer_backend: str = "nixl",
                         chunked_prefill: int = 4096) -> list:
    """A CP-sharded PD prefill worker on ``cp`` GPUs: TP = CP = ``cp``, zigzag split, KV sharded."""
    if cp < 2:
        raise ValueError(f"sharded_prefill_args: cp must be >= 2 (one stripe per rank), got {cp}")
    return ["--tp", str(cp), "--enable-prefill-cp", "--attn-cp-size", str(cp), "--cp-strategy", "zigzag",
            "--enable-kv-cache-sharding", "--chunked-prefill-size", str(chunked_prefill),
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
            "--disaggregation-transfer-backend", transfer_backend]


def decode_args(tp: int, transfer_backend: str = "nixl") -> list:
    return ["--tp", str(tp), "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", transfer_backend]


def pd_generate(prefill: ServerProcess, decode: ServerProcess, bootstrap_port: int, ids: list, n: int = 8,
                timeout_s: float = 300.0) -> tuple[GenResult, GenResult]:
    """One request through both workers with one bootstrap room; (prefill's result, decode's result).
    Both halves are bounded by ``timeout_s``; a failed or unanswered half raises, naming its side."""
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
             "bootstrap_room": random.getrandbits(62)}
    out: dict = {}

    def run(name, srv):
        try:
            out[name] = srv.generate(ids, n, timeout_s=timeout_s, extra=extra)
        except Exception as e:  # reported below, with the side it came from
            out[name] = e

    threads = [threading.Thread(target=run, args=(k, s), daemon=True)
               for k, s in (("prefill", prefill), ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    for side, srv in (("prefill", prefill), ("decode", decode)):
        got = out.get(side)
        if got is None:
            raise RuntimeError(f"PD request: no answer from the {side} worker ({srv.url}) within {timeout_s + 30:.0f} s")
        if isinstance(got, Exception):
            raise RuntimeError(f"PD request failed on the {side} worker ({srv.url}): {got!r}") from got
    return out["prefill"], out["decode"]


@dataclass
class PdPair:
    """Prefill + decode workers as one server for a client: ``generate`` answers with the decode worker's
    ids and latency (the client's time to its first token) and the prefill worker's ``meta_info`` (where the
    prefix came from, and its own stages); metrics and the log are the prefill worker's (L3's side)."""

    prefill: ServerProcess
    decode: ServerProcess
    bootstrap_port: int

    @property
    def startup_s(self) -> Optional[float]:
        return self.prefill.startup_s

    def start(self) -> "PdPair":
        self.decode.start()
        try:
            self.prefill.start()
        except BaseException:
            self.decode.stop()
            raise
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        try:
            self.prefill.stop(timeout_s)
        finally:
            self.decode.stop(timeout_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def generate(self, input_ids: list, max_new_tokens: int = 8, timeout_s: float = 600.0) -> GenResult:
        p, d = pd_generate(self.prefill, self.decode, self.bootstrap_port, input_ids, max_new_tokens, timeout_s)
        meta = dict(p.meta_info)
        meta["decode_meta_info"] = d.meta_info
        meta["prefill_latency_s"] = p.latency_s
        # sent_at: the prefill half's, the clock of the stages in its meta_info (both halves leave together)
        return replace(d, meta_info=meta, sent_at=p.sent_at)

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        return self.prefill.metrics_text(timeout_s)

    def metrics(self, timeout_s: float = 10.0) -> dict:
        return self.prefill.metrics(timeout_s)

    def metric_by_label(self, name: str, label: str) -> dict:
        return self.prefill.metric_by_label(name, label)

    def log_text(self) -> str:
        return self.prefill.log_text()
