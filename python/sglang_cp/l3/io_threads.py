"""IoThreads: the store's I/O threads, as daemon threads that interpreter exit does not wait for.

A ThreadPoolExecutor's workers are joined at interpreter exit (concurrent.futures registers that join
with threading's exit hooks), so one preadv / pwritev / fdatasync stuck in a dead device kept the
process alive after close(timeout) had returned, until the request came back: minutes, or never. The
store's close() already leaves such a thread behind on purpose (it fails every pending op and keeps the
files open for it); the process must then be able to exit. IoThreads keeps the executor's interface the
store uses (submit -> Future, shutdown(wait, cancel_futures), RuntimeError after shutdown) over a fixed
number of daemon threads, started at open.

A daemon thread that comes back from the kernel after the interpreter started finalizing never runs
Python again (CPython parks or ends it), so a late completion cannot touch the torn-down store. What the
process cannot escape is the kernel itself: a request in uninterruptible sleep delays the final exit of
the process until the device driver gives up on it, as for any process.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class IoThreads:
    def __init__(self, threads: int, name: str):
        if threads < 1:
            raise ValueError(f"IoThreads: threads must be >= 1, got {threads}")
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit against shutdown
        self._shut = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._tasks.put((fut, fn, args))
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """As ThreadPoolExecutor.shutdown: no new tasks; with cancel_futures, tasks not started are
        cancelled (their done callbacks run); idle threads end. wait joins the threads (never the store:
        it shuts down without waiting)."""
        with self._lock:
            if not self._shut:
                self._shut = True
                if cancel_futures:
                    while True:
                        try:
                            item = self._tasks.get_nowait()
                        except queue.Empty:
                            break
                        if item is not None:
                            item[0].cancel()
                for _ in self._threads:
                    self._tasks.put(None)
        if wait:
            for t in self._threads:
                t.join()

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # the Future carries it, as an executor's does
                fut.set_exception(e)
            else:
                fut.set_result(result)
            del fut, fn, args, item
