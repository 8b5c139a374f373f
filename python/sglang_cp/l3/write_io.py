"""The write I/O threads: pages the write thread placed in slots, written to their slab.

The write thread (writer.py) owns the slots and decides what is written where; it hands runs of
consecutive slots here as I/O tasks and hears back through one IoDone per task. An I/O task seals each
page's header, writes, frees the pages' staging the moment no I/O reads it, and posts IoDone. Nothing
here touches a pool's allocator, LRU or index.

Why tasks are groups of runs: beside a Python thread that never pauses (a GPU server's scheduler), each
return from the kernel costs an I/O thread up to CPython's switch interval (5 ms by default) to get the
GIL back, and with GLM-5's 5.75 MB pages a run is one page, so page-by-page pwrites left the drive idle
for part of every write. With the native library a task writes a group of runs in one call
(native/write_runs.c: one pwritev per run, one GIL release per group). Without it, a task is one run
(os.pwritev), as many in flight as there are threads.

Faults stay per run: a run that fails (an error, a short write) is retried page by page, so one bad
sector fails only its page; a page whose caller gave up on it (zero-copy, past its bound) is never
written from memory it no longer owns.
"""

from __future__ import annotations

import errno
import functools
import os

from . import native
from .io_threads import IoThreads
from .messages import IoDone, WriteTask
from .payload_slab import PayloadSlab
from .state import StoreState

# With the native library an I/O task writes runs in groups of up to this many bytes once every write
# I/O thread has work (before that, idle threads get a share each, so the device sees as many requests
# as there are threads).
MAX_GROUP_BYTES = 32 << 20


def release_buffers(st: StoreState, run: list[WriteTask]) -> None:
    """Once its pwrite returned, a page's staging image is not needed any more: fdatasync and the
    index commit work on the file, and a failed page is never rewritten from staging. Freeing the
    token then, not at DURABLE, keeps submitters copying while a group commit runs. The I/O thread
    frees its task's buffers before it posts IoDone; the write thread's call on IoDone is then a no-op
    (release_buffer is idempotent, and IoDone orders the two)."""
    for t in run:
        t.release_buffer(st.staging)


class WriteIo:
    def __init__(self, st: StoreState, threads: int):
        self.st = st
        self._threads = IoThreads(threads, f"l3w-r{st.rank}")
        lib = native.installed()  # without it, one run per task, written with os.pwritev
        self._pwritev_runs = functools.partial(native.write_runs, lib) if lib is not None else None

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def groups(self, runs: list[list[WriteTask]], extent: int, idle: int) -> list[list[list[WriteTask]]]:
        """The I/O tasks for `runs` (consecutive slots of one pool, `extent` bytes a page) while `idle`
        write I/O threads have no task: one run each without the native library; with it, a share for
        each idle thread first, then groups of up to MAX_GROUP_BYTES."""
        if self._pwritev_runs is None or len(runs) == 1:
            return [[r] for r in runs]
        total = sum(len(r) for r in runs) * extent
        limit = MAX_GROUP_BYTES if idle <= 0 else min(MAX_GROUP_BYTES, -(-total // min(idle, len(runs))))
        groups: list[list[list[WriteTask]]] = []
        size = 0
        for run in runs:
            if not groups or size + len(run) * extent > limit:
                groups.append([])
                size = 0
            groups[-1].append(run)
            size += len(run) * extent
        return groups

    def submit(self, group: list[list[WriteTask]]) -> bool:
        """Hand a task to the I/O threads; False once they are shut down (the caller settles its pages)."""
        return self.st.submit_io(self._threads, self._write, group)

    def _write(self, group: list[list[WriteTask]]) -> None:
        """One I/O task (on an I/O thread): a group of runs of one pool, then IoDone for all its pages."""
        st = self.st
        pool = group[0][0].pool
        tasks = [t for run in group for t in run]
        reading = []  # zero-copy tasks currently reading their caller's memory
        try:
            for t in tasks:
                if t.src is not None:
                    if t.guard.begin_io():
                        reading.append(t)
                    else:
                        t.error = "cancelled"  # the caller timed out; its memory is off limits
            sealed = []  # (run, its live pages, their images)
            for run in group:
                live = [t for t in run if t.error is None]
                sealed.append((run, live, [pool.seal_zero_copy(t.src, t.buf, t.slot, t.digest, t.seq)
                                           if t.src is not None
                                           else pool.seal_image(t.buf, t.slot, t.digest, t.seq, t.pcrc)
                                           for t in live]))
            whole = [(run[0].slot, images) for run, live, images in sealed if len(live) == len(run)]
            outcomes = iter(pool.slab.write_runs(self._pwritev_runs or _os_pwritev_runs, whole))
            for run, live, images in sealed:
                err = next(outcomes) if len(live) == len(run) else OSError(0, "run has holes")
                if err is None:
                    continue
                if len(live) == 1 and len(run) == 1:
                    self._failed(pool, live, err)
                    continue
                # One bad sector must not fail its neighbours: retry page by page.
                for t, img in zip(live, images):
                    try:
                        pool.slab.write_slot(t.slot, img)
                    except OSError as e:
                        self._failed(pool, [t], e)
        except OSError as err:
            self._failed(pool, [t for t in tasks if t.error is None], err)
        except BaseException as err:  # our bug: fail these pages, then fail loud on the next call
            for t in tasks:
                t.error = repr(err)
            st.set_fatal(err)
        finally:
            for t in reading:
                if t.guard.end_io() and t.error is None:
                    # The caller returned before this write was done with its memory (its bound passed):
                    # the slot may hold bytes of whatever the caller put there since. Never indexed; the
                    # slot is freed only now that the I/O returned (io.zero_copy_writes).
                    t.error = "abandoned"
            # Staging comes back here, on the I/O thread, the moment no I/O reads it: a submitter waiting
            # for slots then wakes at once rather than after the write thread's next turn (each thread
            # that wakes waits up to the switch interval for the GIL beside a busy scheduler thread).
            release_buffers(st, tasks)
        st.post(IoDone(tasks))

    def _failed(self, pool: PayloadSlab, run: list[WriteTask], err: OSError) -> None:
        if not run:
            return
        code = errno.errorcode.get(err.errno, str(err.errno))
        for t in run:
            t.error = f"errno {code}"
        self.st.fault("write_errors", f"write-{code}", "L3 write of %s slots %d..%d failed: %s",
                      pool.name, run[0].slot, run[-1].slot, err)


def _os_pwritev_runs(fd: int, offsets: list[int], runs: list[list[memoryview]]) -> list[int]:
    """native.write_runs's contract without the library: per run the bytes written or -errno, one
    os.pwritev (and one GIL release) per run."""
    out = []
    for off, iovecs in zip(offsets, runs):
        try:
            out.append(os.pwritev(fd, iovecs, off))
        except OSError as err:
            out.append(-err.errno)
    return out
