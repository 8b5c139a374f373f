"""CPython's switch interval in a process that serves restores (``io.gil_switch_interval_ms``).

Why: a GPU server's scheduler thread runs Python without pause while a request waits for its prefetch
(its event loop polls; upstream's ``Scheduler.event_loop_normal``). A thread that wants the GIL back --
upstream's prefetch thread after it allocates host pages, our read returning from its GIL-free call,
upstream's completion thread woken by the prefetch's ack -- gets it only when the running thread is asked
to drop it, after the switch interval (5 ms by default). A restore passes through several such
hand-offs in series. A shorter interval bounds each of them; it costs nothing while no thread waits.

The setting is process-wide by nature (``sys.setswitchinterval``): the store's owner sets it once when it
opens and puts the earlier value back when it closes, unless someone else has changed it since.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

logger = logging.getLogger(__name__)


class SwitchInterval:
    """One process's switch interval as the store set it: what it was before (``before_s``) and what the
    store made it (``set_s``); None for both when the config leaves the interpreter's own."""

    def __init__(self, ms: float):
        self.before_s: Optional[float] = None
        self.set_s: Optional[float] = None
        if ms > 0:
            self.before_s = sys.getswitchinterval()
            sys.setswitchinterval(ms / 1e3)
            self.set_s = sys.getswitchinterval()
            logger.info("sglang-cp L3: CPython switch interval %.3g ms -> %.3g ms (io.gil_switch_interval_ms)",
                        self.before_s * 1e3, self.set_s * 1e3)

    def restore(self) -> None:
        """Put the earlier interval back if the process still runs with ours; idempotent."""
        if self.set_s is not None and sys.getswitchinterval() == self.set_s:
            sys.setswitchinterval(self.before_s)
        self.set_s = None
