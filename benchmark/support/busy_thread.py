"""A Python thread that never pauses: a GPU server's scheduler thread, beside code under measurement.

CPython hands the GIL from a running thread to a woken one only at its switch interval
(``sys.getswitchinterval()``, 5 ms by default), so every GIL release of the measured code (a blocking
call, a torch or numpy operation that releases it) can wait that long for this thread. Used by the
benchmarks' ``--busy-scheduler``. Imports no sglang.
"""

from __future__ import annotations

import sys
import threading


class BusyScheduler:
    """One Python thread that runs bytecode without pause inside the ``with`` block, as a GPU server's
    scheduler thread does while a request waits for its prefetch (its event loop polls without
    sleeping); ``switch_ms`` sets CPython's switch interval for the block."""

    def __init__(self, switch_ms=None):
        self.switch_ms, self._stop, self._thread = switch_ms, threading.Event(), None
        self._old = sys.getswitchinterval()

    def __enter__(self):
        if self.switch_ms is not None:
            sys.setswitchinterval(self.switch_ms / 1e3)

        def spin():
            while not self._stop.is_set():
                sum(range(64))
        self._thread = threading.Thread(target=spin, name="busy-scheduler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._old)
