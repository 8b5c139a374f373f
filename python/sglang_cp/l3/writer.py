"""The store's write thread: sole owner of slot allocators, LRU and GC.

Pipeline per page: staged by the caller (submit.py) -> slot allocated here -> O_DIRECT write on a write
I/O thread (write_io.py) -> group commit on the commit thread (commit.py: fdatasync of the touched
slabs, then one durable LMDB txn) -> bookkeeping and DURABLE acks back here. One commit is in flight at
a time; writes that complete while it runs form the next group, so commits batch themselves under load
and the disk never idles for them. GC, LRU touches, deletes of bad pages and control messages run here
too, so no other thread ever changes a pool. Under backup_ack = "written" deletes and touches that
follow a returned write whose commit is pending wait for that commit (fence.py).
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Optional

from .acks import AckKind
from .commit import GroupCommitter
from .errors import L3InvariantError
from .fence import CommitFence
from .gc import WatermarkPolicy
from .format.index import IndexEntry, IndexFull, IndexUnavailable
from .messages import Clear, CommitJob, Committed, Delete, Drop, IoDone, Reply, Stop, WriteBatch, WriteTask
from .payload_slab import PayloadSlab
from .recovery import run_cold_start
from .state import StoreState
from .write_io import WriteIo, release_buffers

# A coalesced write covers consecutive slots up to this many bytes (one pwritev).
_MAX_IO_BYTES = 4 << 20
# While writes are still in flight, a group commits at this size (bounds DURABLE ack latency). A commit
# started while writes stream flushes the device under them and queues LMDB's small writes behind them;
# upstream's backup calls are 128 pages (0.74 GB at GLM-5's 5.75 MB pages), so at 1 GiB each call commits
# once, at its end (256 MiB split a 64-page call in two: docs_internal/l3_store.md, "Group size").
_GROUP_BYTES = 1 << 30
# Written but not yet committed bytes above which no new write is dispatched. Staging tokens come back
# when a pwrite returns, so without this a stuck commit (a hung fdatasync) would let writers run on
# unbounded; with it, staging fills and submitters block (backpressure) until the commit lands.
_MAX_UNCOMMITTED_BYTES = 2 * _GROUP_BYTES


class WriteThread:
    def __init__(self, st: StoreState):
        self.st = st
        self.new: collections.deque[WriteTask] = collections.deque()
        self.completed: list[WriteTask] = []
        self.completed_bytes = 0
        self.io_pending = 0  # pages handed to the I/O threads whose IoDone has not come back
        self.io_groups = 0  # I/O tasks (groups of runs) handed out whose IoDone has not come back
        self.committing = False
        self.committing_bytes = 0
        self.barriers: collections.deque[Clear | Stop] = collections.deque()
        self.dirty_touch: dict[bytes, IndexEntry] = {}
        self.fence = CommitFence(st)
        cfg = st.config
        self._gc_policy = {p: WatermarkPolicy(cfg.gc.high_watermark, cfg.gc.low_watermark, cfg.gc.max_reclaim_per_iter)
                           for p in st.pools}
        self._io = WriteIo(st, cfg.io.threads)
        self._committer = GroupCommitter(st)
        self._thread = threading.Thread(target=self._main, name=f"l3-writer-r{st.rank}", daemon=True)

    # -- lifecycle (the facade's thread) ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: Optional[float]) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown_io(self) -> None:
        self._io.shutdown()

    def _main(self) -> None:
        st = self.st
        try:
            self._committer.start()
            try:
                self._run()
            finally:
                self._committer.stop()
        except BaseException as err:
            st.set_fatal(err)
        finally:
            # Unblock everyone waiting on this thread: their pages fail (after a crash the next call
            # raises); whatever is posted from now on is settled by the poster.
            with st.post_lock:
                st.stopped = True
            st.fail_inflight()
            st.drain_queue()
            self.fence.abandon()

    # -- the loop --------------------------------------------------------------------------------------

    def _run(self) -> None:
        st = self.st
        while True:
            # Everything doable without a new message was done last iteration, so block; the timeout
            # only serves idle persistence of touches (and noticing that close() gave up on us).
            try:
                msg = st.queue.get(timeout=1.0)
            except queue.Empty:
                msg = None
            if st.abandoned:  # close() timed out waiting for the device and failed everything
                if msg is not None:
                    st.settle(msg)
                return
            msgs = [msg] if msg is not None else []
            while len(msgs) < 4096:
                try:
                    msgs.append(st.queue.get_nowait())
                except queue.Empty:
                    break
            for m in msgs:
                self._handle(m)
            for d in self.fence.ready_deletes():  # their pending commits landed (or failed)
                self._delete(d)
            self._apply_touches()
            self._gc()
            if not self.barriers and self._uncommitted_bytes() < _MAX_UNCOMMITTED_BYTES:
                self._dispatch()
            if not self.committing and (self._group_ready() or (msg is None and self.dirty_touch)):
                self._start_commit()
            while self.barriers and not (self.io_pending or self.completed or self.committing):
                b = self.barriers.popleft()
                if isinstance(b, Stop):
                    for t in self.new:
                        self._complete(t, False)
                    self.new.clear()
                    for d in self.fence.ready_deletes(force=True):  # no write of theirs can land now
                        self._delete(d)
                    self._touch_all(self.fence.ready_touches(force=True))
                    if self.dirty_touch:  # keep the LRU order for the next start
                        self._persist_touches_now()
                    b.reply.done.set()
                    return
                self._clear(b.reply)

    def _handle(self, m) -> None:
        if isinstance(m, WriteBatch):
            self.new.extend(m.tasks)
        elif isinstance(m, IoDone):
            self.io_pending -= len(m.run)
            self.io_groups -= 1
            release_buffers(self.st, m.run)
            self._ack_written(m.run)
            self.completed.extend(m.run)
            self.completed_bytes += sum(t.pool.page_bytes for t in m.run)
        elif isinstance(m, Committed):
            self.committing = False
            self.committing_bytes = 0
            self._finish_group(m.group)
            self.fence.commit_landed()
        elif isinstance(m, Drop):
            self._drop(m)
        elif isinstance(m, Delete):
            if not self.fence.hold_delete(m):  # else it runs once the commits it waits for landed
                self._delete(m)
        elif isinstance(m, (Clear, Stop)):
            self.barriers.append(m)
        else:
            raise L3InvariantError(f"write thread: unknown message {m!r}")

    # -- writes ---------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        st = self.st
        need = collections.Counter(t.pool.name for t in self.new)
        for name, n in need.items():
            pool = st.pools[name]
            short = n - pool.slots.free
            if short > 0:
                self._reclaim(pool, min(short, len(pool.lru)), forced=True)
        retry: collections.deque[WriteTask] = collections.deque()
        ready: dict[str, list[WriteTask]] = collections.defaultdict(list)
        while self.new:
            t = self.new.popleft()
            slot = t.pool.slots.alloc()
            if slot is None:
                if self.io_pending or self.completed or self.committing:
                    retry.append(t)  # slots come back when in-flight writes commit or fail
                else:
                    st.fault("pool_full", "pool_full", "L3 %s pool full with nothing reclaimable", t.pool.name)
                    t.error = "pool_full"
                    self._complete(t, False)
                continue
            t.slot, t.seq = slot, st.now()
            ready[t.pool.name].append(t)
        self.new = retry
        threads = st.config.io.threads
        for tasks in ready.values():
            pool = tasks[0].pool
            tasks.sort(key=lambda t: t.slot)
            # Coalesce consecutive slots, but keep at least `threads` requests when there is enough work.
            per_io = max(1, min(_MAX_IO_BYTES // pool.extent, -(-len(tasks) // threads)))
            if pool.slab.slot_bytes != pool.extent:
                per_io = 1
            runs: list[list[WriteTask]] = []
            for t in tasks:
                if runs and len(runs[-1]) < per_io and t.slot == runs[-1][-1].slot + 1:
                    runs[-1].append(t)
                else:
                    runs.append([t])
            for group in self._io.groups(runs, pool.extent, threads - self.io_groups):
                self._submit_io(group)

    def _submit_io(self, group: list[list[WriteTask]]) -> None:
        tasks = [t for run in group for t in run]
        self.io_pending += len(tasks)
        self.io_groups += 1
        if self._io.submit(group):
            return
        # The I/O pool is shut: close() gave up waiting for this thread (busy in an index txn that the
        # device held up, e.g. a forced reclaim's delete) and failed its pages. Nothing reads the run's
        # buffers, so settle it as a failed write would be: buffers back, slots free, waiters failed.
        self.io_pending -= len(tasks)
        self.io_groups -= 1
        for t in tasks:
            t.error = "closed"
            t.pool.slots.free_slot(t.slot)  # never written, so nothing references it
            self._complete(t, False)

    def _ack_written(self, run: list[WriteTask]) -> None:
        """Mark pages whose pwrite returned ok as written (the store reads them from their slot from now
        on) and finish the pages of write_pages calls that return at that point (backup_ack = "written").
        Their DURABLE completion after the group commit is then a no-op for those ops."""
        st = self.st
        early = []
        with st.lock:
            for t in run:
                if t.error is None:
                    t.written = True
                    early += [(op, i) for op, i in t.waiters if op.ack_at_write]
        for op, i in early:
            st.finish(op, i, AckKind.DURABLE, True)

    # -- group commits --------------------------------------------------------------------------------

    def _group_ready(self) -> bool:
        """Every commit costs device cache flushes (fdatasync + LMDB), so commit as rarely as waiting
        callers allow: when no write is in flight, or when a large amount of data waits (bounds ack
        latency). Staging tokens come back at write completion, so submitters never wait on a commit."""
        if not self.completed:
            return False
        if self.io_pending == 0:
            return True
        return self.completed_bytes >= _GROUP_BYTES

    def _uncommitted_bytes(self) -> int:
        return self.committing_bytes + self.completed_bytes

    def _start_commit(self) -> None:
        group, self.completed = self.completed, []
        self.committing_bytes, self.completed_bytes = self.completed_bytes, 0
        touches, self.dirty_touch = list(self.dirty_touch.items()), {}
        self.committing = True
        self._committer.submit(CommitJob(group, touches))

    def _finish_group(self, group: list[WriteTask]) -> None:
        st = self.st
        spilled = spilled_bytes = replaced = 0
        per_payload: dict[str, int] = {}
        for t in group:
            pool = t.pool
            if t.error is None:
                old = pool.lru.get(t.ikey)
                if old is not None:  # a rewrite replaced the index entry; the old slot is unreferenced now
                    pool.release(t.ikey, old)
                    replaced += 1
                pool.occupy(t.ikey, t.entry(st.rank))
                spilled += 1
                spilled_bytes += pool.page_bytes
                per_payload[pool.name] = per_payload.get(pool.name, 0) + 1
            else:
                pool.slots.free_slot(t.slot)  # never indexed, so nothing references it
            self._complete(t, t.error is None)
        with st.lock:
            st.counters["spill_pages"] += spilled
            st.counters["spill_bytes"] += spilled_bytes
            st.counters["spill_replaced"] += replaced  # spilled - replaced - reclaimed - dropped = live growth
            for name, n in per_payload.items():
                st.payload_counters[name]["spill_pages"] += n

    def _complete(self, t: WriteTask, ok: bool) -> None:
        st = self.st
        with st.lock:
            if st.inflight.get(t.ikey) is t:
                del st.inflight[t.ikey]
            waiters = list(t.waiters)
        release_buffers(self.st, [t])
        for op, i in waiters:
            st.finish(op, i, AckKind.DURABLE, ok)

    def _persist_touches_now(self) -> None:
        touches, self.dirty_touch = list(self.dirty_touch.items()), {}
        try:
            self.st.index.commit(touches=touches)
        except (IndexFull, IndexUnavailable) as err:
            self.st.fault("index_errors", "index-t", "L3 could not persist LRU touches (%s)", err)

    # -- GC, touches, deletes -------------------------------------------------------------------------

    def _apply_touches(self) -> None:
        st = self.st
        self._touch_all(self.fence.ready_touches())
        pending = self.committing + bool(self.completed)  # group commits of pages already written
        now = []
        while st.touches:
            t = st.touches.popleft()
            if not self.fence.hold_touch(t, pending):
                now.append(t)
        self._touch_all(now)

    def _touch_all(self, touches: list) -> None:
        n = 0
        for pool, ikey, stamp in touches:
            e = pool.lru.touch(ikey, stamp)
            if e is not None:
                self.dirty_touch[ikey] = e
                n += 1
        if n:
            self.st.count("touches", n)

    def _gc(self) -> None:
        for name, pool in self.st.pools.items():
            n = self._gc_policy[name].to_reclaim(pool.slots.used, pool.slots.num_slots)
            if n:
                self._reclaim(pool, min(n, len(pool.lru)), forced=False)

    def _reclaim(self, pool: PayloadSlab, n: int, forced: bool) -> None:
        if n <= 0:
            return
        victims = pool.lru.coldest(n)
        if self._delete_then_free(pool, victims):
            self.st.count("gc_reclaimed", len(victims))
            if forced:
                self.st.count("gc_forced", len(victims))

    def _delete_then_free(self, pool: PayloadSlab, victims: list[tuple[bytes, IndexEntry]]) -> bool:
        """Index delete is committed (durable) before any victim slot goes back to the free list."""
        if not victims:
            return True
        try:
            self.st.index.commit(deletes=victims)
        except (IndexFull, IndexUnavailable) as err:
            self.st.fault("index_errors", "index-d", "L3 index delete failed (%s); slots kept", err)
            return False
        for ikey, e in victims:
            # Whether or not the entry was still there, nothing in the index references the slot now.
            pool.release(ikey, e)
            self.dirty_touch.pop(ikey, None)
        return True

    def _drop(self, m: Drop) -> None:
        """A reader found a bad page and (normally) already deleted its exact index entry."""
        st = self.st
        try:
            self._drop_page(m.pool, m.ikey, m.entry, m.deleted)
        finally:
            with st.lock:
                st.dropping.discard(m.ikey)

    def _drop_page(self, pool: PayloadSlab, ikey: bytes, e: IndexEntry, deleted: Optional[bool]) -> None:
        """Free the bad page's slot if it is still this page's, counting it then only (whoever else freed
        it -- GC, a delete, a rewrite -- counted it already). Unless the reader deleted the exact index
        entry (True), the entry is deleted here first: the reader's delete failed (None), or found nothing
        (False: under backup_ack = "written" it read the page before its group commit, which has landed
        since, since the page is in the LRU; freeing the slot alone would leave that entry naming it)."""
        cur = pool.lru.get(ikey)
        if cur is None or (cur.slot, cur.seq) != (e.slot, e.seq):
            return
        if deleted:
            pool.release(ikey, cur)
            self.dirty_touch.pop(ikey, None)
        elif not self._delete_then_free(pool, [(ikey, cur)]):
            return  # the index refused the delete (counted): the slot stays, as the entry does
        self.st.count("bad_pages_dropped")

    def _delete(self, m: Delete) -> None:
        try:
            # Each key once: a key given twice would free its slot twice (an invariant error: a dead store).
            victims = [(k, m.pool.lru.get(k)) for k in dict.fromkeys(m.ikeys) if k in m.pool.lru]
            ok = self._delete_then_free(m.pool, victims)
            m.reply.result = len(victims) if ok else 0
            if ok:
                self.st.count("deleted_pages", len(victims))
        finally:
            m.reply.done.set()

    def _clear(self, reply: Reply) -> None:
        """A runtime clear. If the index fails, the pages stay as they were and the caller gets a miss-like
        outcome (a counter, a log, ``clear()`` returns False), never a dead store: the rank's entries are
        deleted from the index first, and only then are the slots freed (index delete before slot free)."""
        st = self.st
        try:
            try:
                wiped = st.index.delete_rank(st.rank)
                result = run_cold_start("clear", st.index, st.rank, st.by_tag, 1)
            except (IndexFull, IndexUnavailable, OSError) as err:
                st.fault("clear_errors", "clear", "L3 rank %d: clear failed (%s); the store keeps serving", st.rank,
                         err)
                reply.result = False
                return
            result["index_entries_wiped"] += wiped
            reply.result = True
            self.dirty_touch.clear()
            st.cold_start = dict(result, mode="clear (runtime)")
            st.record_cold_start(st.cold_start)
        finally:
            reply.done.set()
