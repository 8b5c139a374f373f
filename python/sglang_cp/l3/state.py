"""The L3 store's shared state, and the completion helpers every one of its threads uses.

One StoreState per store. The store's parts (submit.py, writer.py, commit.py, reads.py, hits.py and the
facade, store.py) each hold it and use only its public fields and methods; they never reach into
each other. Threads: callers (submit, read, hit query, control), the write thread (writer.py: sole
owner of slot allocators, LRU and GC), the commit thread (commit.py), and three sets of I/O threads
(writes, reads, read finishers).

Concurrency, in one place. What `lock` guards (every write, and every read unless listed under the GIL):
  inflight       key -> WriteTask of pages staged and not yet final (dedup; read-your-writes)
  counters       every increment, and the snapshot stats() takes
  live_ops       ops not yet complete (close() and a fatal error fail them)
  reads_inflight read pages between their submit and their completion
  dropping       bad pages deleted from the index whose LRU release the write thread has pending
  WriteTask.written, set when its pwrite returned (under the lock, with the early acks it allows)
Other locks: `post_lock` orders posts against the write thread's exit (`stopped`, `abandoned`);
`io_cond` counts I/O thread tasks; `clock_lock` keeps write sequences increasing; each OpState's `cond`
guards its results and its caller-memory I/O count; Staging, Tokens, the read path's landing areas
and the LMDB index lock themselves.
No lock, one owner: slot allocators, LRUs, PayloadSlab.owner, HeldDigests' writes, GC and the write
thread's own bookkeeping belong to the write thread (and to recovery before any thread starts).
What relies on the GIL (CPython with a GIL; a free-threaded build would need these under `lock`):
  - the hit query reads the LRUs' HeldDigests (a dict lookup, a table probe of single 64-bit stores)
    while the write thread changes them (held.py says what a racing answer can be);
  - durable_entries() takes each page's IndexEntry from its pool's LRU (one OrderedDict get per key)
    while the write thread changes it (reads.py says why a racing answer is a miss, never wrong bytes);
  - written_pending() reads `inflight` with one dict lookup per key, and WriteTask flags only ever go
    one way (written False -> True, error None -> set);
  - the hit query reads `dropping` (truthiness, then membership) without the lock;
  - `acks` and `touches` are deques appended and popped from both ends by different threads; the
    touch queue's length bound is advisory;
  - flags set once and read anywhere: `closed`, `fatal` (of two first errors at once either may be
    kept), `abandoned` (read by the write thread without post_lock), OpState.cancelled (an I/O thread's
    early skip; the copy into caller memory checks again under the op's cond);
  - stats() reads reads_inflight, slot and staging counts and queue sizes unlocked: monitoring only.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Callable, Optional

from .acks import Ack, AckKind, OpState
from .format.blob import key_digester, key_digests
from .config import L3Config
from .errors import L3InvariantError
from .held import HeldDigests
from .format.index import IndexEntry, LmdbIndex
from .io_threads import IoThreads
from .messages import Clear, Delete, Message, Stop, Touch, WriteBatch, WriteTask
from .format.ownership import RankLock
from .payload_slab import PayloadSlab
from .ratelog import RateLimitedLog
from .recovery import write_record as write_cold_start_record
from .staging import Staging

# One logger for all of the store's parts, under the name it always had (operators filter by it).
logger = logging.getLogger("sglang_cp.l3.store")

COUNTERS = ("spill_pages", "spill_bytes", "zero_copy_pages", "write_dedup_pages", "write_already_durable",
            "write_errors", "reload_pages", "reload_hits", "reload_bytes", "misses", "read_errors", "crc_errors",
            "header_errors", "foreign_blobs", "short_reads", "bad_pages_dropped", "gc_reclaimed",
            "gc_forced", "mapfull", "map_grows", "index_errors", "touches", "touches_dropped",
            "deleted_pages", "pool_full", "read_timeouts", "write_timeouts", "clear_errors",
            "hit_queries", "hit_query_keys", "hit_query_ns", "spill_replaced", "read_calls", "read_ns")
# Kept per payload too: a page of a model with sidecars (DSA indexer-K, packed MTP draft layers) is a
# hit only when every payload of it is good, so "which payload failed" is what an operator needs.
PAYLOAD_COUNTERS = ("spill_pages", "reload_hits", "crc_errors", "header_errors", "short_reads", "foreign_blobs")
# delete() / clear() wait this long for the write thread (clear waits for writes in flight to settle);
# a read waits this long for a landing area before it calls that a leak.
CONTROL_TIMEOUT_S = 60.0
_MAX_TOUCHES = 65536  # queued LRU touches; advisory, so more are dropped rather than queued


class StoreState:
    def __init__(self, config: L3Config, rank: int, *, index: LmdbIndex, pools: dict[str, PayloadSlab],
                 held: HeldDigests, staging: Staging, slab_dir: str, locks: list[RankLock], native):
        self.config = config
        self.rank = rank
        self.log = RateLimitedLog(logger)
        # durability.backup_ack = "written": write_pages returns once pages are written, and this
        # process reads its own written-but-not-yet-committed pages (docs_internal/l3_write_ack.md).
        self.ack_at_write = config.backup_ack == "written"
        # One digest per key, shared by every payload (the payload tag keeps their index rows apart).
        self.digest = key_digester(rank)
        # The hit query's batch digests: in C over threads when index.digest_threads > 0.
        self.native = native
        self.digests = key_digests(rank, native)
        self.index = index
        self.pools = pools
        self.by_tag = {pool.tag: pool for pool in pools.values()}
        self.held = held  # the hit query's view of every pool's LRU (one lookup per key)
        self.staging = staging
        self.slab_dir = slab_dir
        self.locks = locks
        self.cold_start: dict = {}

        self.lock = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.payload_counters = {p: dict.fromkeys(PAYLOAD_COUNTERS, 0) for p in pools}
        self.inflight: dict[bytes, WriteTask] = {}
        self.dropping: set[bytes] = set()
        self.live_ops: set[OpState] = set()
        self.reads_inflight = 0
        self.acks: collections.deque[Ack] = collections.deque()
        self.touches: collections.deque[Touch] = collections.deque()
        self.queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.post_lock = threading.Lock()
        self.stopped = False    # the write thread takes no more messages
        self.abandoned = False  # close() gave up waiting for it
        self.closed = False
        self.fatal: Optional[BaseException] = None
        self.io_cond = threading.Condition()
        self.io_tasks = 0       # I/O thread tasks submitted and not yet finished
        self._clock_lock = threading.Lock()
        self._last_seq = 0
        self._op_ids = itertools.count(1)

    # ---------------------------------------------------------------- lookups and counters

    def pool(self, payload: str) -> PayloadSlab:
        pool = self.pools.get(payload)
        if pool is None:
            raise KeyError(f"payload: {payload!r} was not opened by this store; known: {sorted(self.pools)}")
        return pool

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def fault(self, counter: str, logkey: str, msg: str, *args) -> None:
        self.count(counter)
        self.log.warning(logkey, msg, *args)

    def now(self) -> int:
        """A write sequence / LRU stamp: wall-clock ns, strictly increasing within the store."""
        with self._clock_lock:
            t = max(time.time_ns(), self._last_seq + 1)
            self._last_seq = t
            return t

    def touch(self, pool: PayloadSlab, ikey: bytes, now: int) -> None:
        if len(self.touches) >= _MAX_TOUCHES:
            self.count("touches_dropped")
            return
        self.touches.append(Touch(pool, ikey, now))

    def durable_entries(self, pool, ikeys: list[bytes]) -> list[Optional[IndexEntry]]:
        """Per key, this rank's durable page: its IndexEntry from `pool`'s LRU (the write thread's copy of
        this rank's index entries, reads.py), or None. A page a reader is dropping as bad is None: its key
        enters `dropping` before its index entry is deleted and leaves it after its LRU entry is released,
        both under `lock`, so the lookups under `lock` never see a dropped page's stale entry. Not
        LMDB: py-lmdb releases the GIL for every get, a wait of up to 5 ms each beside a busy Python
        thread (116 ms for 512 keys)."""
        get = pool.lru.get
        with self.lock:
            dropping = self.dropping
            if dropping:
                return [None if k in dropping else get(k) for k in ikeys]
            return [get(k) for k in ikeys]

    def written_entries(self, ikeys: list[bytes]) -> dict[int, IndexEntry]:
        """Under `lock`: {i: entry} for keys written to a slot whose index commit is pending."""
        out = {}
        for i, k in enumerate(ikeys):
            t = self.inflight.get(k)
            if t is not None and t.written and t.error is None:
                out[i] = t.entry(self.rank)
        return out

    def written_pending(self) -> Optional[Callable[[bytes], bool]]:
        """Under backup_ack = "written": ikey -> True for pages written to their slot whose index commit
        is still pending (read-your-writes); None otherwise. Lock-free (see the module docstring)."""
        if not self.ack_at_write:
            return None
        inflight = self.inflight

        def written(ikey: bytes) -> bool:
            t = inflight.get(ikey)
            return t is not None and t.written and t.error is None
        return written

    def record_cold_start(self, result: dict) -> None:
        try:
            write_cold_start_record(self.slab_dir, self.rank, result)
        except OSError as e:  # observability only: the store itself is sound
            logger.warning("L3 rank %d: could not record the cold start for `sglang-cp l3 stats` in %s (%s)",
                           self.rank, self.slab_dir, e)

    # ---------------------------------------------------------------- operations and their acks

    def new_op(self, keys: list[bytes], sync: bool, final: AckKind) -> OpState:
        self.raise_fatal()
        if self.closed:
            raise RuntimeError("L3Store is closed")
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, (bytes, bytearray)) for k in keys):
            raise TypeError("keys: must be a list of bytes")
        op = OpState(next(self._op_ids), [bytes(k) for k in keys], sync)
        op.final_kind = final
        if keys:
            with self.lock:
                self.live_ops.add(op)
            op.on_done = self._op_done
        return op

    def _op_done(self, op: OpState) -> None:
        with self.lock:
            self.live_ops.discard(op)

    def emit(self, op: OpState, i: int, kind: AckKind, ok: bool) -> None:
        if not op.sync:
            self.acks.append(Ack(op.op_id, i, op.keys[i], kind, ok))

    def finish(self, op: OpState, i: int, kind: AckKind, ok: bool) -> None:
        if op.results[i] is None:
            self.emit(op, i, kind, ok)
        op.finish(i, ok)

    def fail_live_ops(self) -> None:
        """close(): every operation still pending fails now. Reads are quiesced (a copy into the
        caller's memory under way finishes first: bounded, no disk involved); a zero-copy write's
        own caller waits for its I/O, as write_pages without a timeout promises."""
        with self.lock:
            ops = list(self.live_ops)
        for op in ops:
            if op.final_kind == AckKind.READ:
                op.cancel_and_quiesce()
            else:
                op.cancel()
            self._fail_unfinished(op)

    def _fail_unfinished(self, op: OpState) -> None:
        for i, r in enumerate(op.results):
            if r is None:
                self.finish(op, i, op.final_kind, False)

    # ---------------------------------------------------------------- the fatal latch

    def set_fatal(self, err: BaseException) -> None:
        logger.error("L3 store invariant broken: %r", err, exc_info=err)
        if self.fatal is None:
            self.fatal = err
        with self.lock:
            ops = list(self.live_ops)
        for op in ops:  # nobody may wait forever on a store that stopped working
            self._fail_unfinished(op)

    def raise_fatal(self) -> None:
        if self.fatal is not None:
            raise L3InvariantError(f"L3 store stopped after an internal error: {self.fatal!r}") from self.fatal

    # ---------------------------------------------------------------- I/O thread tasks

    def submit_io(self, threads: IoThreads, fn, *args) -> bool:
        """Executor futures swallow exceptions; a task that dies outside its own handlers is a bug in
        this store, so it turns fatal (and fails every waiting op) instead of leaving callers hanging.
        Tasks are counted so that close() can tell when no thread is inside a syscall any more.
        False: the threads were shut down (the caller settles what the task would have)."""
        with self.io_cond:
            self.io_tasks += 1
        try:
            fut = threads.submit(fn, *args)
        except RuntimeError:  # the threads were shut down by a close() that raced this submit
            self._io_task_done(None)
            return False
        fut.add_done_callback(self._io_task_done)
        return True

    def _io_task_done(self, fut) -> None:
        with self.io_cond:
            self.io_tasks -= 1
            self.io_cond.notify_all()
        if fut is not None and not fut.cancelled() and fut.exception() is not None:
            self.set_fatal(fut.exception())

    def wait_io_idle(self, deadline: float) -> bool:
        with self.io_cond:
            while self.io_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.io_cond.wait(left)
            return True

    # ---------------------------------------------------------------- messages to the write thread

    def post(self, msg: Message) -> None:
        """Hand a message to the write thread, or, once it stopped taking messages, settle it here: a
        submit racing close() must not wait on a thread that is gone."""
        with self.post_lock:
            if not self.stopped:
                self.queue.put(msg)
                return
        self.settle(msg)

    def settle(self, msg: Message) -> None:
        """What a message comes to when the write thread will never run it."""
        if isinstance(msg, WriteBatch):  # never dispatched: no I/O reads these buffers
            for t in msg.tasks:
                with self.lock:
                    if self.inflight.get(t.ikey) is t:
                        del self.inflight[t.ikey]
                    waiters = list(t.waiters)
                t.release_buffer(self.staging)
                for op, i in waiters:
                    self.finish(op, i, AckKind.DURABLE, False)
        elif isinstance(msg, (Delete, Clear, Stop)):
            msg.reply.done.set()
        # IoDone, Committed, Drop: bookkeeping of a write thread that is gone; nothing waits

    def drain_queue(self) -> None:
        while True:
            try:
                msg = self.queue.get_nowait()
            except queue.Empty:
                return
            self.settle(msg)

    def fail_inflight(self) -> None:
        """Fail every page waiting on the write thread (it stopped or was given up on). Their staging
        buffers are not reused: an I/O thread may still be writing from them."""
        with self.lock:
            stuck = list(self.inflight.values())
            self.inflight.clear()
        for t in stuck:
            for op, i in t.waiters:
                self.finish(op, i, op.final_kind, False)

    # ---------------------------------------------------------------- files

    def release_files(self) -> None:
        """Close slabs, index, staging and the native hasher, then give up the rank's ownership."""
        for pool in self.pools.values():
            pool.slab.close()
        self.index.close()
        self.staging.close()
        if self.native is not None:
            self.native.close()
        release_locks(self.locks)


def release_locks(locks: list[RankLock]) -> None:
    for lock in reversed(locks):
        lock.release()


def page_view(pool: PayloadSlab, obj, i: int, arg: str, writable: bool) -> memoryview:
    """A caller's page as a flat byte view, checked against the payload's page size."""
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{arg}[{i}]: needs the buffer protocol (bytes, numpy array, mmap; "
                        "for a torch tensor pass tensor.numpy())") from None
    if not mv.c_contiguous:
        raise ValueError(f"{arg}[{i}]: must be C-contiguous")
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if mv.nbytes != pool.page_bytes:
        raise ValueError(f"{arg}[{i}]: {mv.nbytes} B but payload {pool.name!r} pages are {pool.page_bytes} B")
    if writable and mv.readonly:
        raise ValueError(f"{arg}[{i}]: must be writable")
    return mv
