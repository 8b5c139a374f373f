"""A Python thread that never pauses: a GPU server's scheduler thread, beside code under measurement.

CPython hands the GIL from a running thread to a woken one only at its switch interval
(``sys.getswitchinterval()``, 5 ms by default; the store's ``io.gil_switch_interval_ms`` sets it), so every
GIL release of the measured code (a blocking call, a torch or numpy operation that releases it) can wait
that long for this thread. Used by the benchmarks' ``--busy-scheduler``. Imports no sglang.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Optional


def switch_interval_list(text: str) -> list:
    """``--gil-switch-interval-ms``: one value or a comma-separated list of distinct milliseconds (0: the
    interpreter's own), for ``type=`` of an argparse option; the L3 config checks the bounds."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: milliseconds, e.g. 0,0.5") from None
    if not vals or len(set(vals)) != len(vals) or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: one or more distinct values >= 0 in milliseconds, e.g. 0,0.5")
    return vals


def scheduler_steps(text: str) -> tuple:
    """``--scheduler-steps WORK_MS,WAIT_MS`` -> (work s, wait s), for ``type=`` of an argparse option."""
    try:
        work, wait = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: two milliseconds WORK,WAIT, e.g. 2,8") from None
    if work <= 0 or wait < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: WORK > 0 and WAIT >= 0 milliseconds, e.g. 2,8")
    return work / 1e3, wait / 1e3


def quantile(xs: list, q: float) -> float:
    """The q-quantile (0..1) of xs by the nearest rank below; 0.0 for none."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class BusyScheduler:
    """One Python thread that runs bytecode inside the ``with`` block, as a GPU server's scheduler thread
    does. Without ``step``: without pause, as its event loop polls while a request waits for its prefetch;
    ``turns_per_s`` after the block is its loop turns per second, what the scheduler would have got done
    meanwhile (a shorter switch interval hands the GIL over more often: this says at what cost).

    With ``step = (work_s, wait_s)``: a serving scheduler's steps, each ``work_s`` of bytecode (batch
    preparation) then ``wait_s`` with the GIL released (``time.sleep``, as the forward's synchronisation
    releases it). After the wait the thread needs the GIL back, and any other thread running bytecode
    keeps it up to the switch interval: ``steps_ms`` are the steps' wall times, what the operation beside
    it adds to every step of every request being served (``turns`` counts steps)."""

    def __init__(self, step: Optional[tuple] = None):
        self._stop, self._thread = threading.Event(), None
        self.step = step
        self.turns, self.seconds = 0, 0.0
        self.steps_ms: list = []
        self.cpu_s = 0.0  # its own CPU seconds: a benchmark's CPU per GB leaves them out

    def __enter__(self):
        def spin():
            n, t0, c0 = 0, time.perf_counter(), time.thread_time()
            if self.step is None:
                while not self._stop.is_set():
                    sum(range(64))
                    n += 1
            else:
                work, wait = self.step
                while not self._stop.is_set():
                    s = time.perf_counter()
                    while time.perf_counter() - s < work:
                        sum(range(64))
                    time.sleep(wait)
                    self.steps_ms.append((time.perf_counter() - s) * 1e3)
                    n += 1
            self.turns, self.seconds = n, time.perf_counter() - t0
            self.cpu_s = time.thread_time() - c0
        self._thread = threading.Thread(target=spin, name="busy-scheduler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.seconds if self.seconds > 0 else 0.0

    def step_quantiles(self) -> Optional[tuple]:
        """(p50, p99) of the steps' wall ms; None without steps."""
        if not self.steps_ms:
            return None
        return quantile(self.steps_ms, 0.5), quantile(self.steps_ms, 0.99)
