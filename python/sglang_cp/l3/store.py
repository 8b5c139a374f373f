"""L3Store: the per-rank, crash-consistent NVMe page store (engine-independent).

Threads: callers submit; one write thread owns slot pools, LRU and GC and commits the index; two I/O
pools (`io.threads` each) do O_DIRECT writes and reads. Durability order per group of writes:
data -> fdatasync -> index commit -> DURABLE ack. Deletes: index delete -> slot free.
Design and crash guarantees: docs_internal/l3_store.md.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from .acks import Ack, AckKind, OpState
from .aligned import BounceBuffers
from .blob import BlobError, key_digest, write_extent
from .config import L3Config
from .disk_slab import DiskSlab, FaultInjector
from .errors import L3InvariantError, L3StartupError
from .files import private_dir
from .gc import WatermarkPolicy
from .index import IndexEntry, IndexFull, IndexUnavailable, SharedIndex, index_key
from .payload_pool import PayloadPool
from .ratelog import RateLimitedLog
from .recovery import COLD_START_MODES, cold_start, write_record as write_cold_start_record
from .staging import Staging
from .writer import WriteThread, WriteTask

logger = logging.getLogger(__name__)
_PAYLOAD_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SLAB_SUBDIR = "sglang-cp-l3"
# Staged pages are handed to the write thread in messages of about this size: big enough to keep
# per-message overhead low, small enough that disk I/O starts while the caller is still copying.
_MESSAGE_BYTES = 8 << 20
# A coalesced read covers consecutive slots up to this many bytes (one preadv), while keeping at least
# 2 x io.threads requests per batch. Each request costs Python work (submit, GIL, verify); at 1 MiB pages
# one page per request read 0.90x raw over 4 GiB, three per request 0.97x. At 64 KiB pages the request
# count bound keeps requests near 1 MiB (fewer, larger ones read slower there: 1.35x vs 1.46x raw).
_READ_IO_BYTES = 4 << 20

COUNTERS = ("spill_pages", "spill_bytes", "zero_copy_pages", "write_dedup_pages", "write_already_durable", "write_errors",
            "reload_pages", "reload_hits", "reload_bytes", "misses", "read_errors", "crc_errors",
            "header_errors", "foreign_blobs", "short_reads", "bad_pages_dropped", "gc_reclaimed",
            "gc_forced", "mapfull", "map_grows", "index_errors", "touches", "touches_dropped",
            "deleted_pages", "pool_full")


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
        private_dir(slab_dir, f"disks[{disk_i}].path")  # 0700, ours, not a link

        self._index = SharedIndex(config.index.dir, config.index.map_size_bytes, config.index.max_map_size_bytes)
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
            try:
                cold_start_result = cold_start_fn(cold_start, self._index, rank, self._by_tag, config.io.threads)
            except (IndexFull, IndexUnavailable) as e:
                raise L3StartupError(f"index.dir: the LMDB index failed during cold start '{cold_start}' ({e}); "
                                     "check the disk under index.dir, or start with --cp-l3-cold-start clear") from None
        except BaseException:
            for pool in self._pools.values():
                pool.slab.close()
            self._index.close()
            raise
        self._cold_start = cold_start_result
        self._slab_dir = slab_dir
        self._record_cold_start(cold_start_result)

        self._gc = {p: WatermarkPolicy(config.gc.high_watermark, config.gc.low_watermark,
                                       config.gc.max_reclaim_per_iter) for p in self._pools}
        self._staging = Staging(config.io.max_inflight_pages, {p.extent for p in self._pools.values()})
        self._read_permits = max(config.io.max_inflight_pages, config.io.threads)
        self._read_slots = threading.BoundedSemaphore(self._read_permits)
        self._bounce = BounceBuffers()
        self._op_ids = itertools.count(1)
        self._acks: collections.deque[Ack] = collections.deque()
        self._lock = threading.Lock()          # guards _inflight (dedup) and counters
        self._inflight: dict[bytes, WriteTask] = {}
        self._live_ops: set[OpState] = set()
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

    def _submit_write(self, payload: str, keys: list[bytes], pages: list, sync: bool,
                      zero_copy: bool = False) -> OpState:
        pool = self._pool(payload)
        if len(pages) != len(keys):
            raise ValueError(f"submit_write: {len(keys)} keys but {len(pages)} pages; pass one page per key")
        views = [self._page_view(pool, pg, i, "pages", writable=False) for i, pg in enumerate(pages)]
        op = self._new_op(keys, sync, AckKind.DURABLE)  # after validation: a refused call leaves no op
        digests = [key_digest(payload, self.rank, k) for k in keys]
        ikeys = [index_key(pool.tag, d) for d in digests]
        try:
            present = self._index.get_many(ikeys)
        except IndexUnavailable as e:
            self._fault("index_errors", "index", "L3 index read failed (%s); writing anyway", e)
            present = [None] * len(keys)
        batch: list[WriteTask] = []
        batch_bytes = 0
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
            if zero_copy and pool.can_zero_copy(view):
                # The sync caller waits for DURABLE anyway: write from its memory, no staging copy.
                task = WriteTask(pool, ikey, digests[i], self._staging.tail(pool.tail_bytes()), [(op, i)],
                                 src=view, guard=op)
                with self._lock:
                    other = self._inflight.get(ikey)
                    if other is not None:
                        other.waiters.append((op, i))
                        self._counters["write_dedup_pages"] += 1
                    else:
                        self._inflight[ikey] = task
                if other is not None:
                    self._staging.release_tail(task.buf)
                    continue
                self._count("zero_copy_pages")
                batch.append(task)
                batch_bytes += pool.page_bytes
                if batch_bytes >= _MESSAGE_BYTES:
                    self._q.put(("write", batch))
                    batch, batch_bytes = [], 0
                continue
            buf = self._staging.acquire(pool.extent, blocking=False)
            if buf is None:
                # Hand over what we staged before blocking: those pages hold the tokens we wait for.
                if batch:
                    self._q.put(("write", batch))
                    batch, batch_bytes = [], 0
                buf = self._staging.acquire(pool.extent)
            np.copyto(np.frombuffer(buf, dtype=np.uint8, count=pool.page_bytes),
                      np.frombuffer(view, dtype=np.uint8))
            task = WriteTask(pool, ikey, digests[i], buf, [(op, i)])
            with self._lock:
                other = self._inflight.get(ikey)
                if other is not None:  # raced with another submitter of the same key
                    other.waiters.append((op, i))
                    self._counters["write_dedup_pages"] += 1
                else:
                    self._inflight[ikey] = task
            self._emit(op, i, AckKind.GATHERED, True)
            if other is not None:
                self._staging.release(pool.extent, buf)
                continue
            batch.append(task)
            batch_bytes += pool.page_bytes
            if batch_bytes >= _MESSAGE_BYTES:
                self._q.put(("write", batch))
                batch, batch_bytes = [], 0
        if batch:
            self._q.put(("write", batch))
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
        op = self._submit_write(payload, keys, pages, True, zero_copy=True)
        if not op.done.wait(timeout):
            op.cancel_and_quiesce()  # no I/O may read the caller's pages after we return
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
        self._staging.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _record_cold_start(self, result: dict) -> None:
        try:
            write_cold_start_record(self._slab_dir, self.rank, result)
        except OSError as e:  # observability only: the store itself is sound
            logger.warning("L3 rank %d: could not record the cold start for `sglang-cp l3 stats` in %s (%s)",
                           self.rank, self._slab_dir, e)

    # ================================================================ helpers (caller threads)

    def _new_op(self, keys: list[bytes], sync: bool, final: AckKind) -> OpState:
        self._raise_fatal()
        if self._closed:
            raise RuntimeError("L3Store is closed")
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, (bytes, bytearray)) for k in keys):
            raise TypeError("keys: must be a list of bytes")
        op = OpState(next(self._op_ids), [bytes(k) for k in keys], sync)
        op.final_kind = final
        if keys:
            with self._lock:
                self._live_ops.add(op)
            op.on_done = self._op_done
        return op

    def _op_done(self, op: OpState) -> None:
        with self._lock:
            self._live_ops.discard(op)

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
        pool = self._pool(payload)
        if len(outs) != len(keys):
            raise ValueError(f"submit_read: {len(keys)} keys but {len(outs)} outs; pass one buffer per key")
        views = [self._page_view(pool, o, i, "outs", writable=True) for i, o in enumerate(outs)]
        op = self._new_op(keys, sync, AckKind.READ)
        digests = [key_digest(payload, self.rank, k) for k in keys]
        ikeys = [index_key(pool.tag, d) for d in digests]
        with self._lock:
            self._counters["reload_pages"] += len(keys)
        try:
            entries = self._index.get_many(ikeys)
        except IndexUnavailable as e:
            self._fault("index_errors", "index", "L3 index read failed (%s); reads are misses", e)
            entries = [None] * len(keys)
        todo = []
        for i, e in enumerate(entries):
            if e is None or not pool.entry_fits(e):
                if e is not None:
                    self._drop_entry(pool, ikeys[i], e)
                self._count("misses")
                self._finish(op, i, AckKind.READ, False)
                continue
            todo.append((e.slot, i))
        for run in self._read_runs(pool, sorted(todo), views):
            for _ in run:
                self._read_slots.acquire()
            with self._lock:
                self._reads_inflight += len(run)
            items = [(i, ikeys[i], digests[i], entries[i], views[i]) for _, i in run]
            if len(items) == 1:
                self._submit_io(self._rio, self._read_one, op, items[0][0], pool, *items[0][1:])
            else:
                self._submit_io(self._rio, self._read_run, op, pool, items)
        return op

    def _read_runs(self, pool: PayloadPool, todo: list[tuple[int, int]], views: list) -> list:
        """Group pages of consecutive slots into coalesced reads (<= _READ_IO_BYTES, and at least
        2 x io.threads requests when there is enough work)."""
        threads = self.config.io.threads
        per_io = max(1, min(_READ_IO_BYTES // pool.extent, -(-len(todo) // (2 * threads)),
                            self._read_permits // 2))
        runs, run = [], []
        for slot, i in todo:
            if run and (len(run) >= per_io or slot != run[-1][0] + 1):
                runs.append(run)
                run = []
            run.append((slot, i))
        if run:
            runs.append(run)
        out = []
        for run in runs:
            if len(run) > 1 and not pool.can_read_run([views[i] for _, i in run]):
                out.extend([r] for r in run)
            else:
                out.append(run)
        return out

    def _read_run(self, op: OpState, pool: PayloadPool, items: list) -> None:
        """A coalesced read; if the read itself fails or comes back short, each page is retried alone
        so one bad sector or a truncated slab costs only its own pages."""
        oks = [False] * len(items)
        try:
            if op.begin_io():
                try:
                    results = pool.read_run(items[0][3].slot, [(d, v) for _, _, d, _, v in items], self._bounce)
                except OSError:
                    results = None
                finally:
                    op.end_io()
                if results is None:
                    oks = [self._read_page_io(op, pool, ikey, d, e, out) for _, ikey, d, e, out in items]
                else:
                    for k, r in enumerate(results):
                        if isinstance(r, BlobError):
                            self._bad_page(pool, items[k][1], items[k][3], r)
                        else:
                            oks[k] = True
        except BaseException as err:  # a bug in our own code: fail loud on the caller's next call
            self._set_fatal(err)
        finally:
            for k, (i, ikey, _, _, _) in enumerate(items):
                self._page_done(op, i, pool, ikey, oks[k])

    def _read_one(self, op: OpState, i: int, pool: PayloadPool, ikey: bytes, digest: bytes, e: IndexEntry,
                  out: memoryview) -> None:
        ok = False
        try:
            ok = self._read_page_io(op, pool, ikey, digest, e, out)
        except BaseException as err:  # a bug in our own code: fail loud on the caller's next call
            self._set_fatal(err)
        finally:
            self._page_done(op, i, pool, ikey, ok)

    def _read_page_io(self, op: OpState, pool: PayloadPool, ikey: bytes, digest: bytes, e: IndexEntry,
                      out: memoryview) -> bool:
        if not op.begin_io():
            return False  # the sync caller timed out: its buffers are off limits
        try:
            pool.read_page(e.slot, digest, out, self._bounce)
            return True
        except BlobError as err:
            self._bad_page(pool, ikey, e, err)
        except OSError as err:
            self._fault("read_errors", f"read-{err.errno}", "L3 read of %s slot %d failed: %s",
                        pool.name, e.slot, err)
        finally:
            op.end_io()
        return False

    def _page_done(self, op: OpState, i: int, pool: PayloadPool, ikey: bytes, ok: bool) -> None:
        if ok:
            with self._lock:
                self._counters["reload_hits"] += 1
                self._counters["reload_bytes"] += pool.page_bytes
            self._touch(pool, ikey, self._now())
        else:
            self._count("misses")
        with self._lock:
            self._reads_inflight -= 1
        self._read_slots.release()
        self._finish(op, i, AckKind.READ, ok)

    def _bad_page(self, pool: PayloadPool, ikey: bytes, e: IndexEntry, err: BlobError) -> None:
        counter = {"crc_mismatch": "crc_errors", "short_read": "short_reads", "foreign_blob": "foreign_blobs"
                   }.get(err.reason, "header_errors")
        self._fault(counter, f"blob-{err.reason}", "L3 %s slot %d: %s; dropping the page (miss)",
                    pool.name, e.slot, err)
        self._drop_entry(pool, ikey, e)

    def _drop_entry(self, pool: PayloadPool, ikey: bytes, e: IndexEntry) -> None:
        """Delete the exact bad entry from the index now (so the miss is final when acked), then let the
        write thread free the slot: index delete before slot free."""
        try:
            deleted = any(self._index.commit(deletes=[(ikey, e)]))
        except (IndexFull, IndexUnavailable) as err:
            self._fault("index_errors", "index-d", "L3 index delete of a bad page failed (%s)", err)
            deleted = None
        self._q.put(("drop", pool, ikey, e, deleted))

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

    def _submit_io(self, pool: ThreadPoolExecutor, fn, *args) -> None:
        """Executor futures swallow exceptions; a task that dies outside its own handlers is a bug in
        this store, so it turns fatal (and fails every waiting op) instead of leaving callers hanging."""
        fut = pool.submit(fn, *args)
        fut.add_done_callback(lambda f: f.exception() and self._set_fatal(f.exception()))

    def _set_fatal(self, err: BaseException) -> None:
        logger.error("L3 store invariant broken: %r", err, exc_info=err)
        if self._fatal is None:
            self._fatal = err
        with self._lock:
            ops = list(self._live_ops)
        for op in ops:  # nobody may wait forever on a store that stopped working
            for i, r in enumerate(op.results):
                if r is None:
                    self._finish(op, i, op.final_kind, False)

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise L3InvariantError(f"L3 store stopped after an internal error: {self._fatal!r}") from self._fatal

    # ================================================================ write thread

    def _write_loop(self) -> None:
        try:
            WriteThread(self).run()
        except BaseException as err:
            self._set_fatal(err)
            # Unblock everyone waiting on this thread: their pages fail, the next call raises.
            with self._lock:
                stuck = list(self._inflight.values())
                self._inflight.clear()
            for t in stuck:
                for op, i in t.waiters:
                    self._finish(op, i, op.final_kind, False)
            while True:
                try:
                    msg = self._q.get_nowait()
                except queue.Empty:
                    break
                if msg[0] in ("delete", "clear", "stop"):
                    msg[1].set()


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
