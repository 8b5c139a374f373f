"""L3Store: the per-rank, crash-consistent NVMe page store (engine-independent).

Threads: callers submit; one write thread owns slot pools, LRU and GC and commits the index; two I/O
pools (`io.threads` each) do O_DIRECT writes and reads. Durability order per group of writes:
data -> fdatasync -> index commit -> DURABLE ack. Deletes: index delete -> slot free.
Design and crash guarantees: docs_internal/l3_store.md.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .acks import Ack, AckKind, OpState
from .aligned import BounceBuffers, aligned_buffer
from .blob import BlobError, key_digest, write_extent
from .config import L3Config
from .disk_slab import DiskSlab, FaultInjector
from .errors import L3InvariantError, L3StartupError
from .gc import WatermarkPolicy
from .index import IndexEntry, IndexFull, IndexUnavailable, LmdbIndex, index_key
from .payload_pool import PayloadPool
from .ratelog import RateLimitedLog
from .recovery import COLD_START_MODES, cold_start

logger = logging.getLogger(__name__)
_PAYLOAD_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SLAB_SUBDIR = "sglang-cp-l3"

COUNTERS = ("spill_pages", "spill_bytes", "write_dedup_pages", "write_already_durable", "write_errors",
            "reload_pages", "reload_hits", "reload_bytes", "misses", "read_errors", "crc_errors",
            "header_errors", "foreign_blobs", "short_reads", "bad_pages_dropped", "gc_reclaimed",
            "gc_forced", "mapfull", "map_grows", "index_errors", "touches", "touches_dropped",
            "deleted_pages", "pool_full")


@dataclass
class _WriteTask:
    pool: PayloadPool
    ikey: bytes
    digest: bytes
    staging: memoryview
    buf: object
    waiters: list = field(default_factory=list)  # [(OpState, index_in_op)]
    slot: int = -1
    seq: int = 0
    error: Optional[str] = None


class _Staging:
    """Bounded staging memory: `max_inflight_pages` tokens shared by all payloads (backpressure)."""

    def __init__(self, limit: int):
        self._sem = threading.BoundedSemaphore(limit)
        self._free: dict[int, list] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self.limit = limit
        self.in_use = 0

    def acquire(self, extent: int):
        self._sem.acquire()
        with self._lock:
            self.in_use += 1
            free = self._free[extent]
            buf = free.pop() if free else None
        return buf if buf is not None else aligned_buffer(extent)

    def release(self, extent: int, buf) -> None:
        with self._lock:
            self.in_use -= 1
            self._free[extent].append(buf)
        self._sem.release()


class L3Store:
    def __init__(self, config: L3Config, *, rank: int, ranks_per_node: int, payloads: dict[str, int],
                 cold_start: str = "clear", fault_injector: Optional[FaultInjector] = None):
        _check_args(config, rank, ranks_per_node, payloads, cold_start)
        self.config = config
        self.rank = rank
        self.ranks_per_node = ranks_per_node
        self._log = RateLimitedLog(logger)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._clock_lock = threading.Lock()
        self._last_seq = 0
        self._fatal: Optional[BaseException] = None
        self._closed = False

        disk_i = config.disk_index_for_rank(rank)
        disk = config.disks[disk_i]
        sharing = sum(1 for r in range(ranks_per_node) if config.disk_index_for_rank(r) == disk_i)
        slot_bytes = {p: config.slot_bytes.get(p, write_extent(b)) for p, b in payloads.items()}
        for p, b in payloads.items():
            if slot_bytes[p] < write_extent(b):
                raise L3StartupError(
                    f"slot_bytes.{p}: {slot_bytes[p]} B cannot hold a {b} B page plus its 64 B header; "
                    f"set it to at least {write_extent(b)} or remove it")
        for p in config.slot_bytes:
            if p not in payloads:
                logger.warning("L3: slot_bytes.%s names a payload this server does not store; ignored", p)
        per_rank = disk.capacity_bytes // sharing
        num_slots = per_rank // sum(slot_bytes.values())
        if num_slots < 1:
            need = sum(slot_bytes.values()) * sharing / 1e9
            raise L3StartupError(
                f"disks[{disk_i}].capacity_gb: {disk.capacity_bytes / 1e9:g} GB shared by {sharing} rank(s) leaves "
                f"no room for one page of every payload ({sum(slot_bytes.values())} B per rank); "
                f"raise it to at least {need:.6f}")
        slab_dir = os.path.join(disk.path, SLAB_SUBDIR)
        try:
            os.makedirs(slab_dir, exist_ok=True)
        except OSError as e:
            raise L3StartupError(f"disks[{disk_i}].path: cannot create '{slab_dir}' ({e.strerror}); "
                                 "the directory must be writable") from None

        self._index = LmdbIndex(config.index.dir, config.index.map_size_bytes, config.index.max_map_size_bytes)
        self._pools: dict[str, PayloadPool] = {}
        try:
            for p, b in payloads.items():
                slab = DiskSlab(os.path.join(slab_dir, f"r{rank}.{p}.s{slot_bytes[p]}.slab"),
                                slot_bytes=slot_bytes[p], num_slots=num_slots, page_bytes=b,
                                fault_injector=fault_injector, disk_index=disk_i, field=f"disks[{disk_i}]")
                self._pools[p] = PayloadPool(p, b, rank, slab)
            self._by_tag = {pool.tag: pool for pool in self._pools.values()}
            if len(self._by_tag) != len(self._pools):
                raise L3StartupError("payloads: two payload names hash to the same tag; rename one")
            self._cold_start = cold_start_result = None
            cold_start_result = cold_start_fn(cold_start, self._index, rank, self._by_tag, config.io.threads)
        except BaseException:
            for pool in self._pools.values():
                pool.slab.close()
            self._index.close()
            raise
        self._cold_start = cold_start_result

        self._gc = {p: WatermarkPolicy(config.gc.high_watermark, config.gc.low_watermark,
                                       config.gc.max_reclaim_per_iter) for p in self._pools}
        self._staging = _Staging(config.io.max_inflight_pages)
        self._read_slots = threading.BoundedSemaphore(max(config.io.max_inflight_pages, config.io.threads))
        self._bounce = BounceBuffers()
        self._op_ids = itertools.count(1)
        self._acks: collections.deque[Ack] = collections.deque()
        self._lock = threading.Lock()          # guards _inflight (dedup) and counters
        self._inflight: dict[bytes, _WriteTask] = {}
        self._touches: collections.deque = collections.deque()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._reads_inflight = 0
        self._wio = ThreadPoolExecutor(config.io.threads, thread_name_prefix=f"l3w-r{rank}")
        self._rio = ThreadPoolExecutor(config.io.threads, thread_name_prefix=f"l3r-r{rank}")
        self._writer = threading.Thread(target=self._write_loop, name=f"l3-writer-r{rank}", daemon=True)
        self._writer.start()

    # ================================================================ public API (caller threads)

    def submit_write(self, payload: str, keys: list[bytes], pages: list) -> int:
        """Stage pages (blocks only for backpressure) and return an op id; acks GATHERED then DURABLE."""
        return self._submit_write(payload, keys, pages, False).op_id

    def _submit_write(self, payload: str, keys: list[bytes], pages: list, sync: bool) -> OpState:
        op = self._new_op(keys, sync)
        pool = self._pool(payload)
        if len(pages) != len(keys):
            raise ValueError(f"submit_write: {len(keys)} keys but {len(pages)} pages; pass one page per key")
        views = [self._page_view(pool, pg, i, "pages", writable=False) for i, pg in enumerate(pages)]
        digests = [key_digest(payload, self.rank, k) for k in keys]
        ikeys = [index_key(pool.tag, d) for d in digests]
        try:
            present = self._index.get_many(ikeys)
        except IndexUnavailable as e:
            self._fault("index_errors", "index", "L3 index read failed (%s); writing anyway", e)
            present = [None] * len(keys)
        for i, (key, view) in enumerate(zip(keys, views)):
            ikey = ikeys[i]
            with self._lock:
                task = self._inflight.get(ikey)
                if task is not None:
                    task.waiters.append((op, i))
                    self._counters["write_dedup_pages"] += 1
            if task is not None:
                self._emit(op, i, AckKind.GATHERED, True)
                continue
            if present[i] is not None and present[i].rank == self.rank:
                with self._lock:
                    self._counters["write_already_durable"] += 1
                self._emit(op, i, AckKind.GATHERED, True)
                self._finish(op, i, AckKind.DURABLE, True)
                continue
            buf = self._staging.acquire(pool.extent)
            staging = memoryview(buf)
            np.copyto(np.frombuffer(staging, dtype=np.uint8, count=pool.page_bytes),
                      np.frombuffer(view, dtype=np.uint8))
            task = _WriteTask(pool, ikey, digests[i], staging, buf, [(op, i)])
            with self._lock:
                other = self._inflight.get(ikey)
                if other is not None:  # raced with another submitter of the same key
                    other.waiters.append((op, i))
                    self._counters["write_dedup_pages"] += 1
                else:
                    self._inflight[ikey] = task
            if other is not None:
                self._staging.release(pool.extent, buf)
                self._emit(op, i, AckKind.GATHERED, True)
                continue
            self._emit(op, i, AckKind.GATHERED, True)
            self._q.put(("write", task))
        return op

    def submit_read(self, payload: str, keys: list[bytes], outs: list) -> int:
        """Read + verify pages into `outs`; one READ ack per page (ok=False: miss, outs[i] unspecified)."""
        return self._submit_read(payload, keys, outs, False).op_id

    def drain_acks(self, max_n: Optional[int] = None) -> list[Ack]:
        self._raise_fatal()
        out = []
        while self._acks and (max_n is None or len(out) < max_n):
            try:
                out.append(self._acks.popleft())
            except IndexError:
                break
        return out

    def write_pages(self, payload: str, keys: list[bytes], pages: list, timeout: Optional[float] = None) -> list[bool]:
        op = self._submit_write(payload, keys, pages, True)
        op.done.wait(timeout)
        self._raise_fatal()
        return op.final()

    def read_pages(self, payload: str, keys: list[bytes], outs: list, timeout: Optional[float] = None) -> list[bool]:
        op = self._submit_read(payload, keys, outs, True)
        if not op.done.wait(timeout):
            op.cancel_and_quiesce()  # nothing may land in `outs` after we return
        self._raise_fatal()
        return op.final()

    def exists_prefix(self, payload: str, keys: list[bytes]) -> int:
        pool = self._pool(payload)
        rows = [[index_key(pool.tag, key_digest(payload, self.rank, k))] for k in keys]
        return self._exists(rows)

    def exists_prefix_multi(self, payloads: list[str], keys: list[bytes]) -> int:
        pools = [self._pool(p) for p in payloads]
        rows = [[index_key(pl.tag, key_digest(pl.name, self.rank, k)) for pl in pools] for k in keys]
        return self._exists(rows)

    def touch(self, payload: str, keys: list[bytes]) -> None:
        pool = self._pool(payload)
        now = self._now()
        for k in keys:
            self._touch(pool, index_key(pool.tag, key_digest(payload, self.rank, k)), now)

    def delete(self, payload: str, keys: list[bytes]) -> int:
        pool = self._pool(payload)
        ikeys = [index_key(pool.tag, key_digest(payload, self.rank, k)) for k in keys]
        return self._control("delete", pool, ikeys)

    def clear(self) -> None:
        self._control("clear")

    def stats(self) -> dict:
        with self._lock:
            counters = dict(self._counters)
            inflight_writes = len(self._inflight)
        counters["map_grows"] = self._index.grows
        return {
            "rank": self.rank,
            "occupancy": {p: {"used": pl.slots.used, "total": pl.slots.num_slots, "durable": len(pl.lru)}
                          for p, pl in self._pools.items()},
            "counters": counters,
            "inflight": {"writes": inflight_writes, "reads": self._reads_inflight,
                         "staging_pages": self._staging.in_use, "staging_limit": self._staging.limit},
            "queues": {"write_thread": self._q.qsize(), "touches": len(self._touches), "acks": len(self._acks)},
            "index": {"map_size": self._index.map_size(), "max_map_size": self._index.max_map_size},
            "cold_start": self._cold_start,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer.is_alive():
            done = threading.Event()
            self._q.put(("stop", done))
            self._writer.join()
        self._wio.shutdown(wait=True)
        self._rio.shutdown(wait=True)
        for pool in self._pools.values():
            pool.slab.close()
        self._index.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ================================================================ helpers (caller threads)

    def _new_op(self, keys: list[bytes], sync: bool) -> OpState:
        self._raise_fatal()
        if self._closed:
            raise RuntimeError("L3Store is closed")
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, (bytes, bytearray)) for k in keys):
            raise TypeError("keys: must be a list of bytes")
        return OpState(next(self._op_ids), [bytes(k) for k in keys], sync)

    def _pool(self, payload: str) -> PayloadPool:
        pool = self._pools.get(payload)
        if pool is None:
            raise KeyError(f"payload: {payload!r} was not opened by this store; known: {sorted(self._pools)}")
        return pool

    @staticmethod
    def _page_view(pool: PayloadPool, obj, i: int, arg: str, writable: bool) -> memoryview:
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

    def _submit_read(self, payload: str, keys: list[bytes], outs: list, sync: bool) -> OpState:
        op = self._new_op(keys, sync)
        pool = self._pool(payload)
        if len(outs) != len(keys):
            raise ValueError(f"submit_read: {len(keys)} keys but {len(outs)} outs; pass one buffer per key")
        views = [self._page_view(pool, o, i, "outs", writable=True) for i, o in enumerate(outs)]
        digests = [key_digest(payload, self.rank, k) for k in keys]
        ikeys = [index_key(pool.tag, d) for d in digests]
        with self._lock:
            self._counters["reload_pages"] += len(keys)
        try:
            entries = self._index.get_many(ikeys)
        except IndexUnavailable as e:
            self._fault("index_errors", "index", "L3 index read failed (%s); reads are misses", e)
            entries = [None] * len(keys)
        for i, e in enumerate(entries):
            if e is None or not pool.entry_fits(e):
                if e is not None:
                    self._q.put(("drop", pool, ikeys[i], e, "geometry"))
                self._count("misses")
                self._finish(op, i, AckKind.READ, False)
                continue
            self._read_slots.acquire()
            with self._lock:
                self._reads_inflight += 1
            self._rio.submit(self._read_one, op, i, pool, ikeys[i], digests[i], e, views[i])
        return op

    def _read_one(self, op: OpState, i: int, pool: PayloadPool, ikey: bytes, digest: bytes, e: IndexEntry,
                  out: memoryview) -> None:
        ok = False
        try:
            if not op.begin_io():
                return
            try:
                pool.read_page(e.slot, digest, out, self._bounce)
                ok = True
            except BlobError as err:
                self._bad_page(pool, ikey, e, err)
            except OSError as err:
                self._fault("read_errors", f"read-{err.errno}", "L3 read of %s slot %d failed: %s",
                            pool.name, e.slot, err)
            finally:
                op.end_io()
            if ok:
                with self._lock:
                    self._counters["reload_hits"] += 1
                    self._counters["reload_bytes"] += pool.page_bytes
                self._touch(pool, ikey, self._now())
            else:
                self._count("misses")
        except BaseException as err:  # a bug in our own code: fail loud on the caller's next call
            self._set_fatal(err)
        finally:
            with self._lock:
                self._reads_inflight -= 1
            self._read_slots.release()
            self._finish(op, i, AckKind.READ, ok)

    def _bad_page(self, pool: PayloadPool, ikey: bytes, e: IndexEntry, err: BlobError) -> None:
        counter = {"crc_mismatch": "crc_errors", "short_read": "short_reads", "foreign_blob": "foreign_blobs"
                   }.get(err.reason, "header_errors")
        self._fault(counter, f"blob-{err.reason}", "L3 %s slot %d: %s; dropping the page (miss)",
                    pool.name, e.slot, err)
        self._q.put(("drop", pool, ikey, e, err.reason))

    def _exists(self, rows: list[list[bytes]]) -> int:
        self._raise_fatal()
        try:
            return self._index.exists_prefix(rows)
        except IndexUnavailable as e:
            self._fault("index_errors", "index", "L3 exists_prefix failed (%s); reporting 0", e)
            return 0

    def _touch(self, pool: PayloadPool, ikey: bytes, now: int) -> None:
        if len(self._touches) >= 65536:  # advisory: drop rather than grow without bound
            self._count("touches_dropped")
            return
        self._touches.append((pool, ikey, now))

    def _control(self, kind: str, *args):
        self._raise_fatal()
        if self._closed:
            raise RuntimeError("L3Store is closed")
        box: dict = {}
        done = threading.Event()
        self._q.put((kind, done, box) + args)
        done.wait()
        self._raise_fatal()
        return box.get("result")

    def _emit(self, op: OpState, i: int, kind: AckKind, ok: bool) -> None:
        if not op.sync:
            self._acks.append(Ack(op.op_id, i, op.keys[i], kind, ok))

    def _finish(self, op: OpState, i: int, kind: AckKind, ok: bool) -> None:
        if op.results[i] is None:
            self._emit(op, i, kind, ok)
        op.finish(i, ok)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _fault(self, counter: str, logkey: str, msg: str, *args) -> None:
        self._count(counter)
        self._log.warning(logkey, msg, *args)

    def _now(self) -> int:
        with self._clock_lock:
            t = max(time.time_ns(), self._last_seq + 1)
            self._last_seq = t
            return t

    def _set_fatal(self, err: BaseException) -> None:
        logger.error("L3 store invariant broken: %r", err, exc_info=err)
        if self._fatal is None:
            self._fatal = err

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise L3InvariantError(f"L3 store stopped after an internal error: {self._fatal!r}") from self._fatal

    # ================================================================ write thread

    def _write_loop(self) -> None:
        try:
            _WriteThread(self).run()
        except BaseException as err:
            self._set_fatal(err)
            # Unblock everyone waiting on this thread: their pages fail, the next call raises.
            with self._lock:
                stuck = list(self._inflight.values())
                self._inflight.clear()
            for t in stuck:
                for op, i in t.waiters:
                    self._finish(op, i, AckKind.DURABLE, False)
            while True:
                try:
                    msg = self._q.get_nowait()
                except queue.Empty:
                    break
                if msg[0] in ("delete", "clear", "stop"):
                    msg[1].set()


class _WriteThread:
    """State of the write thread; the only code that mutates pools, LRU, GC and index entries."""

    def __init__(self, store: L3Store):
        self.s = store
        self.new: collections.deque[_WriteTask] = collections.deque()
        self.completed: list[_WriteTask] = []
        self.io_pending = 0
        self.barriers: collections.deque = collections.deque()
        self.dirty_touch: dict[bytes, tuple[PayloadPool, IndexEntry]] = {}
        threads = store.config.io.threads
        self.commit_batch = max(threads * 2, store.config.io.max_inflight_pages // 2)

    def run(self) -> None:
        s = self.s
        while True:
            # Everything doable without a new message was done last iteration, so block; the timeout
            # only serves idle persistence of touches.
            try:
                msg = s._q.get(timeout=1.0)
            except queue.Empty:
                msg = None
            msgs = [msg] if msg is not None else []
            while len(msgs) < 4096:
                try:
                    msgs.append(s._q.get_nowait())
                except queue.Empty:
                    break
            stop = None
            for m in msgs:
                kind = m[0]
                if kind == "write":
                    self.new.append(m[1])
                elif kind == "io_done":
                    self.io_pending -= 1
                    self.completed.append(m[1])
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
            if not self.barriers:
                self._dispatch()
            if self.completed and (self.io_pending == 0 or len(self.completed) >= self.commit_batch):
                self._commit()
            if msg is None and self.dirty_touch and not self.io_pending:
                self._commit()  # idle: persist last_access so a restart keeps the LRU order
            while self.barriers and not self.io_pending and not self.completed:
                m = self.barriers.popleft()
                if m[0] == "stop":
                    self._flush_new_as_failed()
                    if self.dirty_touch:
                        self._commit()
                    m[1].set()
                    return
                self._clear(m[1], m[2])

    # -- writes ---------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        s = self.s
        need: dict[str, int] = collections.Counter(t.pool.name for t in self.new)
        for name, n in need.items():
            pool = s._pools[name]
            short = n - pool.slots.free
            if short > 0:
                self._reclaim(pool, min(short, len(pool.lru)), forced=True)
        retry = collections.deque()
        while self.new:
            t = self.new.popleft()
            slot = t.pool.slots.alloc()
            if slot is None:
                if self.io_pending or self.completed:
                    retry.append(t)  # slots come back when in-flight writes commit or fail
                else:
                    s._fault("pool_full", "pool_full", "L3 %s pool full with nothing reclaimable", t.pool.name)
                    t.error = "pool_full"
                    self._complete(t, False)
                continue
            t.slot, t.seq = slot, s._now()
            self.io_pending += 1
            s._wio.submit(self._io_write, t)
        self.new = retry

    def _io_write(self, t: _WriteTask) -> None:
        try:
            t.pool.write_page(t.staging, t.slot, t.digest, t.seq)
        except OSError as err:
            t.error = f"errno {err.errno}"
            code = errno.errorcode.get(err.errno, str(err.errno))
            self.s._fault("write_errors", f"write-{code}", "L3 write of %s slot %d failed: %s",
                          t.pool.name, t.slot, err)
        except BaseException as err:
            t.error = repr(err)
            self.s._set_fatal(err)
        self.s._q.put(("io_done", t))

    def _commit(self) -> None:
        s = self.s
        done, self.completed = self.completed, []
        good = [t for t in done if t.error is None]
        for slab in {t.pool.slab for t in good}:
            try:
                slab.sync()
            except OSError as err:
                s._fault("write_errors", "sync", "L3 fdatasync of %s failed: %s", slab.path, err)
                for t in good:
                    if t.pool.slab is slab:
                        t.error = "fdatasync"
        good = [t for t in good if t.error is None]
        entries = [(t.ikey, IndexEntry(s.rank, t.pool.slab.disk_index, t.slot, t.pool.tag, t.pool.page_bytes,
                                       t.seq, t.seq)) for t in good]
        touches = [(k, e) for k, (_, e) in self.dirty_touch.items()]
        try:
            s._index.commit(puts=entries, touches=touches)
            self.dirty_touch.clear()
        except IndexFull as err:
            s._fault("mapfull", "mapfull", "L3 index full (%s); %d page(s) not stored", err, len(good))
            for t in good:
                t.error = "mapfull"
        except IndexUnavailable as err:
            s._fault("index_errors", "index-w", "L3 index commit failed (%s); %d page(s) not stored", err, len(good))
            for t in good:
                t.error = "index"
        for t in done:
            if t.error is None:
                pool = t.pool
                old = pool.lru.get(t.ikey)
                if old is not None:  # a rewrite replaced the index entry; the old slot is unreferenced now
                    pool.release(t.ikey, old)
                pool.occupy(t.ikey, IndexEntry(s.rank, pool.slab.disk_index, t.slot, pool.tag, pool.page_bytes,
                                               t.seq, t.seq))
                with s._lock:
                    s._counters["spill_pages"] += 1
                    s._counters["spill_bytes"] += pool.page_bytes
            else:
                t.pool.slots.free_slot(t.slot)  # never indexed, so nothing references it
            self._complete(t, t.error is None)

    def _complete(self, t: _WriteTask, ok: bool) -> None:
        s = self.s
        with s._lock:
            if s._inflight.get(t.ikey) is t:
                del s._inflight[t.ikey]
            waiters = list(t.waiters)
        s._staging.release(t.pool.extent, t.buf)
        for op, i in waiters:
            s._finish(op, i, AckKind.DURABLE, ok)

    def _flush_new_as_failed(self) -> None:
        while self.new:
            t = self.new.popleft()
            self._complete(t, False)

    # -- GC, touches, deletes -------------------------------------------------------------------------

    def _apply_touches(self) -> None:
        s = self.s
        n = 0
        while s._touches:
            pool, ikey, stamp = s._touches.popleft()
            e = pool.lru.touch(ikey, stamp)
            if e is not None:
                self.dirty_touch[ikey] = (pool, e)
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
        s = self.s
        if not victims:
            return True
        try:
            flags = s._index.commit(deletes=victims)
        except (IndexFull, IndexUnavailable) as err:
            s._fault("index_errors", "index-d", "L3 index delete failed (%s); slots kept", err)
            return False
        for (ikey, e), deleted in zip(victims, flags):
            if not deleted:
                # The index no longer maps this key to our slot (only we write our keys): still ours
                # to free, since nothing in the index references the slot.
                pass
            pool.release(ikey, e)
            self.dirty_touch.pop(ikey, None)
        return True

    def _drop(self, pool: PayloadPool, ikey: bytes, e: IndexEntry, reason: str) -> None:
        s = self.s
        cur = pool.lru.get(ikey)
        if cur is not None and (cur.slot, cur.seq) == (e.slot, e.seq):
            if self._delete_then_free(pool, [(ikey, cur)]):
                s._count("bad_pages_dropped")
            return
        # Not (or no longer) ours in memory: drop only the exact stale index entry, free nothing.
        try:
            if any(s._index.commit(deletes=[(ikey, e)])):
                s._count("bad_pages_dropped")
        except (IndexFull, IndexUnavailable) as err:
            s._fault("index_errors", "index-d", "L3 index delete failed (%s)", err)

    def _delete(self, done: threading.Event, box: dict, pool: PayloadPool, ikeys: list[bytes]) -> None:
        try:
            victims = [(k, pool.lru.get(k)) for k in ikeys if pool.lru.get(k) is not None]
            ok = self._delete_then_free(pool, victims)
            box["result"] = len(victims) if ok else 0
            if ok:
                self.s._count("deleted_pages", len(victims))
        finally:
            done.set()

    def _clear(self, done: threading.Event, box: dict) -> None:
        s = self.s
        try:
            box["result"] = cold_start_fn("clear", s._index, s.rank, s._by_tag, 1)
            self.dirty_touch.clear()
            s._cold_start = dict(box["result"], mode="clear (runtime)")
        finally:
            done.set()


cold_start_fn = cold_start


def _check_args(config, rank, ranks_per_node, payloads, cold_start_mode) -> None:
    if not isinstance(config, L3Config):
        raise TypeError("config: pass the L3Config returned by load_l3_config(path)")
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node: must be an int >= 1, got {ranks_per_node!r}")
    if not isinstance(rank, int) or not 0 <= rank < ranks_per_node:
        raise ValueError(f"rank: must be in [0, ranks_per_node={ranks_per_node}), got {rank!r}")
    if not isinstance(payloads, dict) or not payloads:
        raise ValueError("payloads: pass a non-empty dict {payload name: page bytes}")
    for name, b in payloads.items():
        if not isinstance(name, str) or not _PAYLOAD_NAME.match(name):
            raise ValueError(f"payloads: name {name!r} must match [A-Za-z0-9_-]{{1,64}} (it names a slab file)")
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"payloads[{name!r}]: page bytes must be a positive int, got {b!r}")
    if cold_start_mode not in COLD_START_MODES:
        raise ValueError(f"cold_start: {cold_start_mode!r} is not one of {', '.join(COLD_START_MODES)} "
                         "(--cp-l3-cold-start)")
    for r, name in config.rank_to_disk.items():
        if r >= ranks_per_node:
            logger.warning("L3: rank_to_disk.\"%d\" names a rank >= ranks_per_node=%d; ignored", r, ranks_per_node)
