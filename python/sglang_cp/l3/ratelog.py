"""Rate-limited logging for data-path faults: a bad disk must not flood the log."""

import logging
import threading
import time


class RateLimitedLog:
    """At most one line per `key` per `interval_s`; the next line says how many were suppressed."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self._logger = logger
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._last[key] = now
            n = self._suppressed.pop(key, 0)
        if n:
            msg = msg + " (%d similar suppressed)"
            args = args + (n,)
        self._logger.warning(msg, *args)
