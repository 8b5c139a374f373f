"""Decode traffic around timed requests: a server under load instead of an idle one.

Why: a restore's setup and completion run on upstream's prefetch and scheduler threads, and every GIL
release there waits for whichever Python thread holds the GIL, up to CPython's 5 ms switch interval. An
idle server's scheduler loop mostly sleeps, so an idle TTFT run cannot show that cost; a server decoding
for other users can. ``DecodeLoad`` keeps ``clients`` requests decoding throughout a ``with`` block:
each client sends one greedy request after another (one shared short prompt, so the prefix stays on the
GPU and each request adds only its decode tokens to the pools), and the timed requests run beside them.

The load is real or it fails loud: ``__enter__`` returns once every client has had an answer (decode
batches are running, kernels compiled), and the first error of any client stops the load and is raised
at ``__exit__``, so a row is never labelled "under load" when the load had died. Every wait is bounded
(``timeout_s`` per request). Imports no sglang.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class DecodeLoadError(RuntimeError):
    pass


class DecodeLoad:
    def __init__(self, generate: Callable, clients: int, prompt: list, new_tokens: int,
                 timeout_s: float = 600.0):
        """``generate(input_ids, max_new_tokens, timeout_s)``: one blocking request (``ServerProcess.generate``)."""
        if clients < 1:
            raise ValueError(f"DecodeLoad: clients must be >= 1, got {clients}")
        if new_tokens < 1:
            raise ValueError(f"DecodeLoad: new_tokens must be >= 1, got {new_tokens}")
        self._generate, self.clients, self.prompt = generate, clients, list(prompt)
        self.new_tokens, self.timeout_s = new_tokens, timeout_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._answered: set[int] = set()
        self._first = threading.Event()  # every client answered once
        self._threads: list[threading.Thread] = []
        self.requests = 0
        self.tokens = 0
        self.error: Optional[BaseException] = None
        self._t0 = self._t1 = 0.0
        self._counted = (0, 0)  # requests and tokens when the timed block began
        self.during: Optional[dict] = None  # what the clients completed inside the block (after __exit__)

    def _client(self, k: int) -> None:
        while not self._stop.is_set():
            try:
                r = self._generate(self.prompt, self.new_tokens, self.timeout_s)
            except BaseException as e:  # noqa: BLE001  (raised at __exit__: the load is dead)
                with self._lock:
                    self.error = self.error or e
                self._stop.set()
                self._first.set()
                return
            with self._lock:
                self.requests += 1
                self.tokens += len(getattr(r, "output_ids", None) or [])
                self._answered.add(k)
                if len(self._answered) == self.clients:
                    self._first.set()

    def __enter__(self) -> "DecodeLoad":
        self._threads = [threading.Thread(target=self._client, args=(k,), name=f"decode-load-{k}", daemon=True)
                         for k in range(self.clients)]
        for t in self._threads:
            t.start()
        if not self._first.wait(self.timeout_s):
            self._stop.set()
            raise DecodeLoadError(f"decode load: not every one of {self.clients} clients had an answer within "
                                  f"{self.timeout_s:g} s")
        if self.error is not None:
            self._stop.set()
            raise DecodeLoadError(f"decode load failed before the timed requests: {self.error!r}") from self.error
        with self._lock:
            self._t0, self._counted = time.perf_counter(), (self.requests, self.tokens)
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._t1 = time.perf_counter()
            requests, tokens = self.requests, self.tokens
        self._stop.set()
        deadline = time.monotonic() + self.timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        self.during = {"clients": self.clients, "new_tokens": self.new_tokens,
                       "requests": requests - self._counted[0], "tokens": tokens - self._counted[1],
                       "seconds": round(self._t1 - self._t0, 3)}
        self.during["tokens_per_s"] = round(self.during["tokens"] / max(1e-9, self.during["seconds"]), 1)
        if exc[0] is None and self.error is not None:
            raise DecodeLoadError(f"decode load failed during the timed requests: {self.error!r}") from self.error
        if exc[0] is None and stuck:
            raise DecodeLoadError(f"decode load: {', '.join(stuck)} still waiting after {self.timeout_s:g} s")
