"""The store's write thread (sole owner of slot pools, LRU and GC) and its group-commit thread.

Pipeline per page: staged by the caller -> slot allocated here -> O_DIRECT write on an I/O thread ->
group commit on the commit thread (fdatasync of the touched slabs, then one durable LMDB txn) ->
bookkeeping and DURABLE acks back here. One commit is in flight at a time; writes that complete while
it runs form the next group, so commits batch themselves under load and the disk never idles for them.
"""

from __future__ import annotations

import collections
import errno
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from .acks import AckKind, OpState
from .errors import L3InvariantError
from .index import IndexEntry, IndexFull, IndexUnavailable
from .payload_pool import PayloadPool


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


@dataclass(eq=False)
class WriteTask:
    pool: PayloadPool
    ikey: bytes
    digest: bytes
    buf: Optional[memoryview]                     # staging slot image, or the tail block if zero-copy;
                                                  # None once the write returned (token given back)
    waiters: list = field(default_factory=list)  # [(OpState, index_in_op)]
    src: Optional[memoryview] = None             # zero-copy: the sync caller's own page
    guard: Optional[OpState] = None              # the op whose caller memory `src` is
    token: bool = False                          # holds a staging token (zero-copy under a caller's bound)
    slot: int = -1
    seq: int = 0
    error: Optional[str] = None
    written: bool = False                        # its pwrite returned ok; the group commit is pending
    pcrc: Optional[int] = None                   # staged pages: payload CRC32C, taken by the submitter
                                                 # right after its copy (bytes still hot in cache), so the
                                                 # I/O threads only write; zero-copy pages: None

    def release_buffer(self, staging: Any) -> None:
        """Give back what this page holds in staging: its slot image, or a zero-copy page's tail block
        and (under a caller's bound) its token. Idempotent."""
        if self.buf is None:
            return
        if self.src is not None:
            staging.release_tail(self.buf)
            if self.token:
                staging.unreserve()
                self.token = False
        else:
            staging.release(self.pool.extent, self.buf)
        self.buf = None

    def entry(self, rank: int) -> IndexEntry:
        p = self.pool
        return IndexEntry(rank, p.slab.disk_index, self.slot, p.tag, p.page_bytes, self.seq, self.seq)


class WriteThread:
    def __init__(self, store: Any):  # the owning L3Store; not imported: store.py imports this module
        self.s = store
        self.new: collections.deque[WriteTask] = collections.deque()
        self.completed: list[WriteTask] = []
        self.completed_bytes = 0
        self.io_pending = 0
        self.committing = False
        self.committing_bytes = 0
        self.barriers: collections.deque = collections.deque()
        self.dirty_touch: dict[bytes, IndexEntry] = {}
        self.commit_q: queue.SimpleQueue = queue.SimpleQueue()
        self.committer = threading.Thread(target=self._commit_loop, name=f"l3-commit-r{store.rank}", daemon=True)

    def run(self) -> None:
        self.committer.start()
        try:
            self._run()
        finally:
            self.commit_q.put(None)
            self.committer.join()

    def _run(self) -> None:
        s = self.s
        while True:
            # Everything doable without a new message was done last iteration, so block; the timeout
            # only serves idle persistence of touches (and noticing that close() gave up on us).
            try:
                msg = s._q.get(timeout=1.0)
            except queue.Empty:
                msg = None
            if s._abandoned:  # close() timed out waiting for the device and failed everything
                if msg is not None:
                    s._settle(msg)
                return
            msgs = [msg] if msg is not None else []
            while len(msgs) < 4096:
                try:
                    msgs.append(s._q.get_nowait())
                except queue.Empty:
                    break
            for m in msgs:
                kind = m[0]
                if kind == "write":
                    self.new.extend(m[1])
                elif kind == "io_done":
                    self.io_pending -= len(m[1])
                    self._release_buffers(m[1])
                    self._ack_written(m[1])
                    self.completed.extend(m[1])
                    self.completed_bytes += sum(t.pool.page_bytes for t in m[1])
                elif kind == "committed":
                    self.committing = False
                    self.committing_bytes = 0
                    self._finish_group(m[1])
                elif kind == "drop":
                    self._drop(*m[1:])
                elif kind == "delete":
                    self._delete(*m[1:])
                elif kind in ("clear", "stop"):
                    self.barriers.append(m)
                else:
                    raise L3InvariantError(f"write thread: unknown message {kind!r}")
            self._apply_touches()
            self._gc()
            if not self.barriers and self._uncommitted_bytes() < _MAX_UNCOMMITTED_BYTES:
                self._dispatch()
            if not self.committing and (self._group_ready() or (msg is None and self.dirty_touch)):
                self._start_commit()
            while self.barriers and not (self.io_pending or self.completed or self.committing):
                m = self.barriers.popleft()
                if m[0] == "stop":
                    for t in self.new:
                        self._complete(t, False)
                    self.new.clear()
                    if self.dirty_touch:  # keep the LRU order for the next start
                        self._persist_touches_now()
                    m[1].set()
                    return
                self._clear(m[1], m[2])

    # -- writes ---------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        s = self.s
        need = collections.Counter(t.pool.name for t in self.new)
        for name, n in need.items():
            pool = s._pools[name]
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
                    s._fault("pool_full", "pool_full", "L3 %s pool full with nothing reclaimable", t.pool.name)
                    t.error = "pool_full"
                    self._complete(t, False)
                continue
            t.slot, t.seq = slot, s._now()
            ready[t.pool.name].append(t)
        self.new = retry
        threads = s.config.io.threads
        for tasks in ready.values():
            pool = tasks[0].pool
            tasks.sort(key=lambda t: t.slot)
            # Coalesce consecutive slots, but keep at least `threads` requests when there is enough work.
            per_io = max(1, min(_MAX_IO_BYTES // pool.extent, -(-len(tasks) // threads)))
            if pool.slab.slot_bytes != pool.extent:
                per_io = 1
            run: list[WriteTask] = []
            for t in tasks:
                if run and (len(run) >= per_io or t.slot != run[-1].slot + 1):
                    self._submit_io(run)
                    run = []
                run.append(t)
            if run:
                self._submit_io(run)

    def _submit_io(self, run: list[WriteTask]) -> None:
        self.io_pending += len(run)
        self.s._submit_io(self.s._wio, self._io_write, run)

    def _io_write(self, run: list[WriteTask]) -> None:
        s = self.s
        pool = run[0].pool
        reading = []  # zero-copy tasks currently reading their caller's memory
        try:
            for t in run:
                if t.src is not None:
                    if t.guard.begin_io():
                        reading.append(t)
                    else:
                        t.error = "cancelled"  # the caller timed out; its memory is off limits
            live = [t for t in run if t.error is None]
            images = [pool.seal_zero_copy(t.src, t.buf, t.slot, t.digest, t.seq) if t.src is not None
                      else pool.seal_image(t.buf, t.slot, t.digest, t.seq, t.pcrc) for t in live]
            try:
                if len(live) == len(run):
                    pool.slab.write_slots(run[0].slot, images)
                else:
                    raise OSError(0, "run has holes")
            except OSError:
                if len(live) == 1 and len(run) == 1:
                    raise
                # One bad sector must not fail its neighbours: retry page by page.
                for t, img in zip(live, images):
                    try:
                        pool.slab.write_slot(t.slot, img)
                    except OSError as err:
                        self._write_failed(pool, [t], err)
        except OSError as err:
            self._write_failed(pool, [t for t in run if t.error is None], err)
        except BaseException as err:  # our bug: fail these pages, then fail loud on the next call
            for t in run:
                t.error = repr(err)
            s._set_fatal(err)
        finally:
            for t in reading:
                if t.guard.end_io() and t.error is None:
                    # The caller returned before this write was done with its memory (its bound passed):
                    # the slot may hold bytes of whatever the caller put there since. Never indexed; the
                    # slot is freed only now that the I/O returned (io.zero_copy_writes).
                    t.error = "abandoned"
        s._post(("io_done", run))

    def _release_buffers(self, run: list[WriteTask]) -> None:
        """Once its pwrite returned, a page's staging image is not needed any more: fdatasync and the
        index commit work on the file, and a failed page is never rewritten from staging. Freeing the
        token here, not at DURABLE, keeps submitters copying while a group commit runs."""
        for t in run:
            t.release_buffer(self.s._staging)

    def _ack_written(self, run: list[WriteTask]) -> None:
        """Mark pages whose pwrite returned ok as written (the store reads them from their slot from now
        on) and finish the pages of write_pages calls that return at that point (backup_ack = "written").
        Their DURABLE completion after the group commit is then a no-op for those ops."""
        s = self.s
        early = []
        with s._lock:
            for t in run:
                if t.error is None:
                    t.written = True
                    early += [(op, i) for op, i in t.waiters if op.ack_at_write]
        for op, i in early:
            s._finish(op, i, AckKind.DURABLE, True)

    def _write_failed(self, pool: PayloadPool, run: list[WriteTask], err: OSError) -> None:
        if not run:
            return
        code = errno.errorcode.get(err.errno, str(err.errno))
        for t in run:
            t.error = f"errno {code}"
        self.s._fault("write_errors", f"write-{code}", "L3 write of %s slots %d..%d failed: %s",
                      pool.name, run[0].slot, run[-1].slot, err)

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
        self.commit_q.put((group, touches))

    def _commit_loop(self) -> None:
        """fdatasync touched slabs, then one durable index txn: a page is indexed only after its data
        is on stable storage."""
        s = self.s
        while True:
            item = self.commit_q.get()
            if item is None:
                return
            group, touches = item
            try:
                self._commit_group(group, touches)
            except BaseException as err:
                for t in group:
                    t.error = t.error or repr(err)
                s._set_fatal(err)
            s._post(("committed", group))

    def _commit_group(self, group: list[WriteTask], touches: list) -> None:
        s = self.s
        good = [t for t in group if t.error is None]
        for slab in {t.pool.slab for t in good}:
            try:
                slab.sync()
            except OSError as err:
                s._fault("write_errors", "sync", "L3 fdatasync of %s failed: %s", slab.path, err)
                for t in good:
                    if t.pool.slab is slab:
                        t.error = "fdatasync"
        good = [t for t in good if t.error is None]
        try:
            s._index.commit(puts=[(t.ikey, t.entry(s.rank)) for t in good], touches=touches)
        except IndexFull as err:
            s._fault("mapfull", "mapfull", "L3 index full (%s); %d page(s) not stored", err, len(good))
            for t in good:
                t.error = "mapfull"
        except IndexUnavailable as err:
            s._fault("index_errors", "index-w", "L3 index commit failed (%s); %d page(s) not stored",
                     err, len(good))
            for t in good:
                t.error = "index"

    def _finish_group(self, group: list[WriteTask]) -> None:
        s = self.s
        spilled = spilled_bytes = 0
        for t in group:
            pool = t.pool
            if t.error is None:
                old = pool.lru.get(t.ikey)
                if old is not None:  # a rewrite replaced the index entry; the old slot is unreferenced now
                    pool.release(t.ikey, old)
                pool.occupy(t.ikey, t.entry(s.rank))
                spilled += 1
                spilled_bytes += pool.page_bytes
            else:
                pool.slots.free_slot(t.slot)  # never indexed, so nothing references it
            self._complete(t, t.error is None)
        with s._lock:
            s._counters["spill_pages"] += spilled
            s._counters["spill_bytes"] += spilled_bytes

    def _complete(self, t: WriteTask, ok: bool) -> None:
        s = self.s
        with s._lock:
            if s._inflight.get(t.ikey) is t:
                del s._inflight[t.ikey]
            waiters = list(t.waiters)
        self._release_buffers([t])
        for op, i in waiters:
            s._finish(op, i, AckKind.DURABLE, ok)

    def _persist_touches_now(self) -> None:
        touches, self.dirty_touch = list(self.dirty_touch.items()), {}
        try:
            self.s._index.commit(touches=touches)
        except (IndexFull, IndexUnavailable) as err:
            self.s._fault("index_errors", "index-t", "L3 could not persist LRU touches (%s)", err)

    # -- GC, touches, deletes -------------------------------------------------------------------------

    def _apply_touches(self) -> None:
        s = self.s
        n = 0
        while s._touches:
            pool, ikey, stamp = s._touches.popleft()
            e = pool.lru.touch(ikey, stamp)
            if e is not None:
                self.dirty_touch[ikey] = e
                n += 1
        if n:
            s._count("touches", n)

    def _gc(self) -> None:
        for name, pool in self.s._pools.items():
            n = self.s._gc[name].to_reclaim(pool.slots.used, pool.slots.num_slots)
            if n:
                self._reclaim(pool, min(n, len(pool.lru)), forced=False)

    def _reclaim(self, pool: PayloadPool, n: int, forced: bool) -> None:
        if n <= 0:
            return
        victims = pool.lru.coldest(n)
        if self._delete_then_free(pool, victims):
            self.s._count("gc_reclaimed", len(victims))
            if forced:
                self.s._count("gc_forced", len(victims))

    def _delete_then_free(self, pool: PayloadPool, victims: list[tuple[bytes, IndexEntry]]) -> bool:
        """Index delete is committed (durable) before any victim slot goes back to the free list."""
        if not victims:
            return True
        try:
            self.s._index.commit(deletes=victims)
        except (IndexFull, IndexUnavailable) as err:
            self.s._fault("index_errors", "index-d", "L3 index delete failed (%s); slots kept", err)
            return False
        for ikey, e in victims:
            # Whether or not the entry was still there, nothing in the index references the slot now.
            pool.release(ikey, e)
            self.dirty_touch.pop(ikey, None)
        return True

    def _drop(self, pool: PayloadPool, ikey: bytes, e: IndexEntry, deleted: Optional[bool]) -> None:
        """A reader found a bad page and (normally) already deleted its exact index entry."""
        s = self.s
        try:
            self._drop_page(pool, ikey, e, deleted)
        finally:
            with s._lock:
                s._dropping.discard(ikey)

    def _drop_page(self, pool: PayloadPool, ikey: bytes, e: IndexEntry, deleted: Optional[bool]) -> None:
        s = self.s
        cur = pool.lru.get(ikey)
        ours = cur is not None and (cur.slot, cur.seq) == (e.slot, e.seq)
        if deleted is None:  # the reader's index delete failed: retry here, still before any free
            if ours:
                if self._delete_then_free(pool, [(ikey, cur)]):
                    s._count("bad_pages_dropped")
            return
        if ours:
            pool.release(ikey, cur)
            self.dirty_touch.pop(ikey, None)
        if deleted:
            s._count("bad_pages_dropped")

    def _delete(self, done: threading.Event, box: dict, pool: PayloadPool, ikeys: list[bytes]) -> None:
        try:
            victims = [(k, pool.lru.get(k)) for k in ikeys if k in pool.lru]
            ok = self._delete_then_free(pool, victims)
            box["result"] = len(victims) if ok else 0
            if ok:
                self.s._count("deleted_pages", len(victims))
        finally:
            done.set()

    def _clear(self, done: threading.Event, box: dict) -> None:
        """A runtime clear. If the index fails, the pages stay as they were and the caller gets a miss-like
        outcome (a counter, a log, ``clear()`` returns False), never a dead store: the rank's entries are
        deleted from the index first, and only then are the slots freed (index delete before slot free)."""
        from .recovery import run_cold_start
        s = self.s
        try:
            try:
                wiped = s._index.delete_rank(s.rank)
                result = run_cold_start("clear", s._index, s.rank, s._by_tag, 1)
            except (IndexFull, IndexUnavailable, OSError) as err:
                s._fault("clear_errors", "clear", "L3 rank %d: clear failed (%s); the store keeps serving", s.rank,
                         err)
                box["result"] = False
                return
            result["index_entries_wiped"] += wiped
            box["result"] = True
            self.dirty_touch.clear()
            s._cold_start = dict(result, mode="clear (runtime)")
            s._record_cold_start(s._cold_start)
        finally:
            done.set()
