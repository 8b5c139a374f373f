"""The write path's caller side: dedup, staging copy (or zero-copy), hand-over to the write thread.

Per page: already durable (one LMDB read txn for the call) or already in flight -> no write (content
addressed: same key, same bytes; an in-flight page is joined and completes with its leader); else it is
copied into a staging slot and acked GATHERED (the caller may reuse its memory), or, for a sync caller
with aligned memory, written from that memory (zero-copy). When staging is full the caller blocks
(backpressure) after handing over what it staged: those pages hold the tokens it waits for.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .acks import AckKind, OpState
from .format.blob import crc32c
from .format.index import index_key
from .messages import WriteBatch, WriteTask
from .payload_slab import PayloadSlab
from .state import StoreState, page_view

# Staged pages are handed to the write thread in messages of about this size: big enough to keep
# per-message overhead low, small enough that disk I/O starts while the caller is still copying.
_MESSAGE_BYTES = 8 << 20


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


class WriteSubmitter:
    def __init__(self, st: StoreState):
        self.st = st

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
        for i, view in enumerate(views):
            if self._rides_inflight(op, i, ikeys[i]):
                continue
            if present[i] is not None and present[i].rank == st.rank:
                st.count("write_already_durable")
                st.emit(op, i, AckKind.GATHERED, True)
                st.finish(op, i, AckKind.DURABLE, True)
                continue
            stage = self._stage_zero_copy if zero_copy and pool.can_zero_copy(view) else self._stage_copy
            if not stage(op, i, pool, ikeys[i], digests[i], view, deadline, batch):
                break  # pages i.. gave up (the caller's bound passed, or closing)
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

    def _stage_copy(self, op: OpState, i: int, pool: PayloadSlab, ikey: bytes, digest: bytes,
                    view: memoryview, deadline: Optional[float], batch: _Batch) -> bool:
        st = self.st
        buf = st.staging.acquire(pool.extent, blocking=False)
        if buf is None:
            batch.flush()  # what we handed over holds the tokens we wait for
            buf = st.staging.acquire(pool.extent, deadline=deadline)
            if buf is None:  # past the caller's bound (tokens held by a stuck disk), or closing
                self._give_up(op, i, deadline)
                return False
        np.copyto(np.frombuffer(buf, dtype=np.uint8, count=pool.page_bytes), np.frombuffer(view, dtype=np.uint8))
        # CRC the copy while it is hot in cache, here rather than on an I/O thread: an I/O thread that
        # checksums is not writing, and the disk then sees fewer than io.threads requests.
        task = WriteTask(pool, ikey, digest, buf, [(op, i)], pcrc=crc32c(buf[: pool.page_bytes]))
        joined, final = self._claim(task, op, i)
        st.emit(op, i, AckKind.GATHERED, True)
        if joined:
            st.staging.release(pool.extent, buf)
            if final:
                st.finish(op, i, AckKind.DURABLE, True)
            return True
        batch.add(task)
        return True

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
