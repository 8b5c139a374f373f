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


class BusyScheduler:
    """One Python thread that runs bytecode without pause inside the ``with`` block, as a GPU server's
    scheduler thread does while a request waits for its prefetch (its event loop polls without
    sleeping). ``turns_per_s`` after the block: its loop turns per second, what the scheduler would have
    got done meanwhile (a shorter switch interval hands the GIL over more often: this says at what cost)."""

    def __init__(self):
        self._stop, self._thread = threading.Event(), None
        self.turns, self.seconds = 0, 0.0
        self.cpu_s = 0.0  # its own CPU seconds: a benchmark's CPU per GB leaves them out

    def __enter__(self):
        def spin():
            n, t0, c0 = 0, time.perf_counter(), time.thread_time()
            while not self._stop.is_set():
                sum(range(64))
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
