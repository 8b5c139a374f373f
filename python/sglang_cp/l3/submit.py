"""The write path's caller side: dedup, staging copy (or zero-copy), hand-over to the write thread.

Per page: already durable (one LMDB read txn for the call) or already in flight -> no write (content
addressed: same key, same bytes; an in-flight page is joined and completes with its leader); else it is
copied into a staging slot and acked GATHERED (the caller may reuse its memory), or, for a sync caller
with aligned memory, written from that memory (zero-copy). When staging is full the caller blocks
(backpressure) after handing over what it staged: those pages hold the tokens it waits for.

Staged pages are copied and checksummed in runs (``_STAGE_RUN_BYTES``), one native call per run where the
library is installed: the caller is upstream's backup thread, and each GIL release it makes costs it up to
the switch interval beside a busy scheduler thread (``native/stage_pages.c``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from . import native
from .acks import AckKind, OpState
from .format.blob import crc32c
from .format.index import index_key
from .messages import WriteBatch, WriteTask
from .payload_slab import PayloadSlab
from .state import StoreState, page_view

# Staged pages are handed to the write thread in messages of about this size: big enough to keep
# per-message overhead low, small enough that disk I/O starts while the caller is still copying.
_MESSAGE_BYTES = 8 << 20
# Pages with a staging slot are copied and checksummed in runs of about this size, in one native call: one
# GIL hand-off per run instead of two per page (a copy and a CRC), and the run's first message reaches the
# write thread after ~32 MB of copying (a few ms), not after the whole call's pages.
_STAGE_RUN_BYTES = 32 << 20


class _Batch:
    """Staged pages not yet handed to the write thread."""

    def __init__(self, st: StoreState):
        self.st = st
        self.tasks: list[WriteTask] = []
        self.bytes = 0

    def add(self, task: WriteTask) -> None:
        self.tasks.append(task)
        self.bytes += task.pool.page_bytes
        if self.bytes >= _MESSAGE_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.tasks:
            self.st.post(WriteBatch(self.tasks))
            self.tasks, self.bytes = [], 0


class _Staged(NamedTuple):
    """Page i of a submit call with its staging slot, waiting for its copy."""

    i: int
    ikey: bytes
    digest: bytes
    view: memoryview  # the caller's page
    buf: memoryview  # its staging slot


class WriteSubmitter:
    def __init__(self, st: StoreState):
        self.st = st
        # the native library's staging copy, or None (not installed): then numpy's copy and the crc32c
        # package, page by page
        self.native = native.installed()

    def submit(self, payload: str, keys: list[bytes], pages: list, sync: bool, zero_copy: bool = False,
               deadline: Optional[float] = None, ack_at_write: bool = False) -> OpState:
        """Stage the pages (blocks only for backpressure, until `deadline`) and return their op."""
        st = self.st
        pool = st.pool(payload)
        if len(pages) != len(keys):
            raise ValueError(f"submit_write: {len(keys)} keys but {len(pages)} pages; pass one page per key")
        views = [page_view(pool, pg, i, "pages", writable=False) for i, pg in enumerate(pages)]
        op = st.new_op(keys, sync, AckKind.DURABLE)  # after validation: a refused call leaves no op
        op.ack_at_write = ack_at_write
        digests = list(map(st.digest, keys))
        ikeys = [index_key(pool.tag, d, st.rank) for d in digests]
        # Durable already (the pool's LRU: state.durable_entries). A page whose write completes between
        # this lookup and _rides_inflight below is written again: harmless (same key, same bytes; the
        # write thread replaces its entry and counts spill_replaced), as with an LMDB snapshot.
        present = st.durable_entries(pool, ikeys)
        batch = _Batch(st)
        run: list[_Staged] = []  # pages holding a staging slot, not copied yet
        for i, view in enumerate(views):
            if self._rides_inflight(op, i, ikeys[i]):
                continue
            if present[i] is not None and present[i].rank == st.rank:
                st.count("write_already_durable")
                st.emit(op, i, AckKind.GATHERED, True)
                st.finish(op, i, AckKind.DURABLE, True)
                continue
            if zero_copy and pool.can_zero_copy(view):
                self._copy_run(op, pool, run, batch)
                if not self._stage_zero_copy(op, i, pool, ikeys[i], digests[i], view, deadline, batch):
                    break  # pages i.. gave up (the caller's bound passed, or closing)
                continue
            buf = st.staging.acquire(pool.extent, blocking=False)
            if buf is None:
                self._copy_run(op, pool, run, batch)
                batch.flush()  # what we handed over holds the tokens we wait for
                # sleep until a run's worth of slots is free: one wake-up per run, not per page
                buf = st.staging.acquire(pool.extent, deadline=deadline,
                                         ready=min(len(views) - i, max(1, _STAGE_RUN_BYTES // pool.page_bytes)))
                if buf is None:  # past the caller's bound (tokens held by a stuck disk), or closing
                    self._give_up(op, i, deadline)
                    break
            run.append(_Staged(i, ikeys[i], digests[i], view, buf))
            if len(run) * pool.page_bytes >= _STAGE_RUN_BYTES:
                self._copy_run(op, pool, run, batch)
        self._copy_run(op, pool, run, batch)
        batch.flush()
        return op

    def _rides_inflight(self, op: OpState, i: int, ikey: bytes) -> bool:
        """Page i's key is already being written: it completes with that write."""
        st = self.st
        with st.lock:
            task = st.inflight.get(ikey)
            final = task is not None and self._join_locked(task, op, i)
        if task is None:
            return False
        st.emit(op, i, AckKind.GATHERED, True)
        if final:
            st.finish(op, i, AckKind.DURABLE, True)
        return True

    def _claim(self, task: WriteTask, op: OpState, i: int) -> tuple[bool, bool]:
        """Register `task` as its key's write, unless another submitter of the key won the race since
        _rides_inflight: then (True, whether page i is final already) and `task` is dropped."""
        st = self.st
        with st.lock:
            other = st.inflight.get(task.ikey)
            final = other is not None and self._join_locked(other, op, i)
            if other is None:
                st.inflight[task.ikey] = task
        return other is not None, final

    def _join_locked(self, task: WriteTask, op: OpState, i: int) -> bool:
        """Under the lock: page i of op rides `task` (same key, already in flight). True when the page
        is final right away (ack_at_write and the task's pwrite already returned)."""
        self.st.counters["write_dedup_pages"] += 1
        if op.ack_at_write and task.written and task.error is None:
            return True
        task.waiters.append((op, i))
        return False

    def _stage_zero_copy(self, op: OpState, i: int, pool: PayloadSlab, ikey: bytes, digest: bytes,
                         view: memoryview, deadline: Optional[float], batch: _Batch) -> bool:
        """The sync caller waits for DURABLE, or under a bound gives up on (and so never indexes) the
        pages still being written from its memory: write from it, no staging copy. Under a bound each
        page holds a staging token, so a stuck disk bounds these as it does staged pages."""
        st = self.st
        token = deadline is not None
        if token and not st.staging.reserve(blocking=False):
            batch.flush()  # what we handed over holds the tokens we wait for
            if not st.staging.reserve(deadline=deadline):
                self._give_up(op, i, deadline)
                return False
        task = WriteTask(pool, ikey, digest, st.staging.tail(pool.tail_bytes()), [(op, i)],
                         src=view, guard=op, token=token)
        joined, final = self._claim(task, op, i)
        if joined:
            st.staging.release_tail(task.buf)
            if token:
                st.staging.unreserve()
            if final:
                st.finish(op, i, AckKind.DURABLE, True)
            return True
        st.count("zero_copy_pages")
        batch.add(task)
        return True

    def _copy_run(self, op: OpState, pool: PayloadSlab, run: list, batch: _Batch) -> None:
        """Copy the run's pages into their staging slots, checksum each copy, and hand them over (or join
        a write of the same key that started meanwhile); empties `run`."""
        if not run:
            return
        st, n = self.st, pool.page_bytes
        # CRC each copy while it is hot in cache, here rather than on an I/O thread: an I/O thread that
        # checksums is not writing, and the disk then sees fewer than io.threads requests.
        if self.native is not None:
            dsts = np.array([native.address(p.buf) for p in run], dtype=np.uint64)
            srcs = np.array([native.address(p.view) for p in run], dtype=np.uint64)
            crcs = native.stage_pages(self.native, dsts, srcs, n).tolist()
        else:
            crcs = []
            for p in run:
                np.copyto(np.frombuffer(p.buf, dtype=np.uint8, count=n), np.frombuffer(p.view, dtype=np.uint8))
                crcs.append(crc32c(p.buf[:n]))
        for p, pcrc in zip(run, crcs):
            task = WriteTask(pool, p.ikey, p.digest, p.buf, [(op, p.i)], pcrc=pcrc)
            joined, final = self._claim(task, op, p.i)
            st.emit(op, p.i, AckKind.GATHERED, True)
            if joined:
                st.staging.release(pool.extent, p.buf)
                if final:
                    st.finish(op, p.i, AckKind.DURABLE, True)
                continue
            batch.add(task)
        run.clear()

    def _give_up(self, op: OpState, i: int, deadline: Optional[float]) -> None:
        """No staging token came before the caller's bound (tokens held by a stuck disk), or closing:
        pages i.. of the op fail."""
        st = self.st
        n = len(op.keys)
        if deadline is not None and not st.closed:
            st.count("write_timeouts", n - i)
        for j in range(i, n):
            if op.results[j] is None:
                st.emit(op, j, AckKind.GATHERED, False)
                st.finish(op, j, AckKind.DURABLE, False)
