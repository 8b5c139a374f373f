"""L3Store: the per-rank, crash-consistent NVMe page store (engine-independent).

Threads: callers submit; one write thread owns slot pools, LRU and GC and commits the index; two I/O
pools (`io.threads` each) do O_DIRECT writes and reads. Durability order per group of writes:
data -> fdatasync -> index commit -> DURABLE ack. Deletes: index delete -> slot free.
Reads land in memory the store owns and are copied out only once verified (by a finisher thread, so
the I/O thread's next preadv does not wait for the copy), so a read that never comes back cannot
touch the caller's pages; read_pages / write_pages with a timeout and close()
return within their bound even when the device never answers.
Design and crash guarantees: docs_internal/l3_store.md.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import os
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .acks import Ack, AckKind, OpState
from .aligned import huge_aligned_view
from .blob import BlobError, crc32c, digest_list, key_digester, key_digests, mixed_keys_error, write_extent
from .config import SLAB_SUBDIR, L3Config  # noqa: F401  (SLAB_SUBDIR: re-exported for tools)
from .disk_slab import DiskSlab, FaultInjector
from .errors import L3InvariantError, L3StartupError
from .files import private_dir, private_dirs
from .gc import WatermarkPolicy
from .held import HeldDigests
from .index import MAX_RANKS, IndexEntry, IndexFull, IndexUnavailable, SharedIndex, index_key
from .index import key_prefix as index_key_prefix
from .native_digest import native_digests
from .ownership import RankLock
from .payload_pool import PayloadPool
from .ratelog import RateLimitedLog
from .recovery import DEFAULT_COLD_START, check_mode, run_cold_start, write_record as write_cold_start_record
from .staging import Staging, Tokens
from .writer import WriteThread, WriteTask

logger = logging.getLogger(__name__)
_PAYLOAD_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Staged pages are handed to the write thread in messages of about this size: big enough to keep
# per-message overhead low, small enough that disk I/O starts while the caller is still copying.
_MESSAGE_BYTES = 8 << 20
# A coalesced read covers consecutive slots up to this many bytes (one preadv), while keeping at least
# 2 x io.threads requests per batch. Each request costs Python work (submit, GIL, verify); at 1 MiB pages
# one page per request read 0.90x raw over 4 GiB, three per request 0.97x. At 64 KiB pages the request
# count bound keeps requests near 1 MiB (fewer, larger ones read slower there: 1.35x vs 1.46x raw).
_READ_IO_BYTES = 4 << 20
# Hit-query chunks of at least this many keys look up the held digests in HeldDigests' numpy table (a
# fixed ~50 us of numpy calls, then overlapped cache misses); smaller ones in its dict (~60 ns per key,
# more at millions of held pages).
_TABLE_CHUNK = 1024
# Landing areas per read I/O thread: one in a preadv, the others with pages being verified and copied
# out by a finisher while the I/O thread already reads the next request.
_LANDING_PER_THREAD = 2
# close() waits this long for in-flight I/O and the last group commit; past it, pending operations fail
# and the files stay open for threads still inside a syscall (a hung device).
CLOSE_TIMEOUT_S = 30.0
# delete() / clear() wait this long for the write thread (clear waits for writes in flight to settle).
CONTROL_TIMEOUT_S = 60.0

COUNTERS = ("spill_pages", "spill_bytes", "zero_copy_pages", "write_dedup_pages", "write_already_durable", "write_errors",
            "reload_pages", "reload_hits", "reload_bytes", "misses", "read_errors", "crc_errors",
            "header_errors", "foreign_blobs", "short_reads", "bad_pages_dropped", "gc_reclaimed",
            "gc_forced", "mapfull", "map_grows", "index_errors", "touches", "touches_dropped",
            "deleted_pages", "pool_full", "read_timeouts", "write_timeouts", "clear_errors",
            "hit_queries", "hit_query_keys", "hit_query_ns")


class L3Store:
    def __init__(self, config: L3Config, *, rank: int, ranks_per_node: int, payloads: dict[str, int],
                 cold_start: str = DEFAULT_COLD_START, fault_injector: Optional[FaultInjector] = None,
                 owner: Optional[str] = None):
        """`owner` describes this rank's identity in ownership errors (e.g. the server's DP/PP/TP ranks)."""
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
        # durability.backup_ack = "written": write_pages returns once pages are written, and this
        # process reads its own written-but-not-yet-committed pages (docs_internal/l3_write_ack.md).
        self._ack_at_write = config.backup_ack == "written"
        # One digest per key, shared by every payload (the payload tag keeps their index rows apart).
        self._digest = key_digester(rank)

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
        slab_dir = config.slab_dir(disk.path)
        private_dir(os.path.join(disk.path, SLAB_SUBDIR), f"disks[{disk_i}].path")  # 0700, ours, not a link
        if slab_dir != os.path.join(disk.path, SLAB_SUBDIR):
            private_dir(slab_dir, f"disks[{disk_i}].path")  # the namespace's own directory
        index_dir = config.index_dir
        private_dirs(index_dir, "index.dir")
        # index.digest_threads > 0: the hit query's digests in C over threads (built here, before
        # anything is opened, so a host without a compiler is refused with nothing to undo).
        self._native = native_digests(config.index.dir, config.index.digest_threads)
        self._digests = key_digests(rank, self._native)
        # Exclusive ownership of this rank's slabs and index entries before anything destructive (slab
        # truncation, cold start), held until close(): a second opener fails here (l3/ownership.py).
        owner = owner or f"L3 rank {rank}"
        if config.namespace:
            owner += f", namespace '{config.namespace}'"
        self._locks: list[RankLock] = [RankLock(slab_dir, rank, owner, what=f"disks[{disk_i}].path")]
        try:
            self._locks.append(RankLock(index_dir, rank, owner, what="index.dir"))
            self._index = SharedIndex(index_dir, config.index.map_size_bytes, config.index.max_map_size_bytes)
        except BaseException:
            self._release_locks()
            raise
        self._pools: dict[str, PayloadPool] = {}
        try:
            for p, b in payloads.items():
                slab = DiskSlab(os.path.join(slab_dir, f"r{rank}.{p}.s{slot_bytes[p]}.slab"),
                                slot_bytes=slot_bytes[p], num_slots=num_slots, page_bytes=b,
                                fault_injector=fault_injector, disk_index=disk_i, field=f"disks[{disk_i}]")
                self._pools[p] = PayloadPool(p, b, rank, slab)
            self._by_tag = {pool.tag: pool for pool in self._pools.values()}
            self._held = HeldDigests()  # the hit query's view of every pool's LRU (one lookup per key)
            for i, pool in enumerate(self._pools.values()):
                pool.lru.attach(self._held, 1 << i)
            if len(self._by_tag) != len(self._pools):
                raise L3StartupError("payloads: two payload names hash to the same tag; rename one")
            # Allocated before cold start: a failure here must not follow a 'clear' that wiped the index.
            self._staging = Staging(config.io.max_inflight_pages, {p.extent for p in self._pools.values()})
            self._landing_free = {p.name: [huge_aligned_view(_landing_bytes(p))
                                           for _ in range(_LANDING_PER_THREAD * config.io.threads)]
                                  for p in self._pools.values()}
            try:
                cold_start_result = run_cold_start(cold_start, self._index, rank, self._by_tag, config.io.threads)
            except (IndexFull, IndexUnavailable) as e:
                raise L3StartupError(f"index.dir: the LMDB index failed during cold start '{cold_start}' ({e}); "
                                     "check the disk under index.dir, or start with --cp-l3-cold-start clear") from None
        except BaseException:
            for pool in self._pools.values():
                pool.slab.close()
            self._index.close()
            if hasattr(self, "_staging"):
                self._staging.close()
            self._release_locks()
            raise
        self._cold_start = cold_start_result
        self._slab_dir = slab_dir
        self._record_cold_start(cold_start_result)

        self._gc = {p: WatermarkPolicy(config.gc.high_watermark, config.gc.low_watermark,
                                       config.gc.max_reclaim_per_iter) for p in self._pools}
        self._read_permits = max(config.io.max_inflight_pages, config.io.threads)
        self._read_slots = Tokens(self._read_permits)
        # Where reads land before they are copied out (self._landing_free, allocated with staging before
        # cold start, faulted in: first touch is slow on VMs). An area is taken for one preadv and comes
        # back only after its pages were copied out, so a preadv stuck in the kernel keeps its area for
        # good and a late completion lands where nobody looks.
        self._landing_cond = threading.Condition()
        self._op_ids = itertools.count(1)
        self._acks: collections.deque[Ack] = collections.deque()
        self._lock = threading.Lock()          # guards _inflight (dedup) and counters
        self._inflight: dict[bytes, WriteTask] = {}
        self._dropping: set[bytes] = set()     # bad pages deleted from the index, LRU release pending
        self._live_ops: set[OpState] = set()
        self._touches: collections.deque = collections.deque()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._post_lock = threading.Lock()  # orders posts against the write thread's exit
        self._stopped = False               # the write thread takes no more messages
        self._abandoned = False             # close() gave up waiting for it
        self._io_cond = threading.Condition()
        self._io_tasks = 0                  # I/O pool tasks submitted and not yet finished
        self._reads_inflight = 0
        self._wio = ThreadPoolExecutor(config.io.threads, thread_name_prefix=f"l3w-r{rank}")
        self._rio = ThreadPoolExecutor(config.io.threads, thread_name_prefix=f"l3r-r{rank}")
        self._fio = ThreadPoolExecutor(config.io.threads, thread_name_prefix=f"l3f-r{rank}")  # verify + copy out
        self._writer = threading.Thread(target=self._write_loop, name=f"l3-writer-r{rank}", daemon=True)
        self._writer.start()

    # ================================================================ public API (caller threads)

    def submit_write(self, payload: str, keys: list[bytes], pages: list) -> int:
        """Stage pages (blocks only for backpressure) and return an op id; acks GATHERED then DURABLE."""
        return self._submit_write(payload, keys, pages, False).op_id

    def _submit_write(self, payload: str, keys: list[bytes], pages: list, sync: bool,
                      zero_copy: bool = False, deadline: Optional[float] = None,
                      ack_at_write: bool = False) -> OpState:
        pool = self._pool(payload)
        if len(pages) != len(keys):
            raise ValueError(f"submit_write: {len(keys)} keys but {len(pages)} pages; pass one page per key")
        views = [self._page_view(pool, pg, i, "pages", writable=False) for i, pg in enumerate(pages)]
        op = self._new_op(keys, sync, AckKind.DURABLE)  # after validation: a refused call leaves no op
        op.ack_at_write = ack_at_write
        digests = list(map(self._digest, keys))
        ikeys = [index_key(pool.tag, d, self.rank) for d in digests]
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
                final = task is not None and self._join_locked(task, op, i)
            if task is not None:
                self._emit(op, i, AckKind.GATHERED, True)
                if final:
                    self._finish(op, i, AckKind.DURABLE, True)
                continue
            if present[i] is not None and present[i].rank == self.rank:
                with self._lock:
                    self._counters["write_already_durable"] += 1
                self._emit(op, i, AckKind.GATHERED, True)
                self._finish(op, i, AckKind.DURABLE, True)
                continue
            if zero_copy and pool.can_zero_copy(view):
                # The sync caller waits for DURABLE, or under a bound gives up on (and so never indexes)
                # the pages still being written from its memory: write from it, no staging copy. Under
                # a bound each page holds a staging token, so a stuck disk bounds these as it does
                # staged pages.
                token = deadline is not None
                if token and not self._staging.reserve(blocking=False):
                    if batch:  # what we handed over holds the tokens we wait for
                        self._post(("write", batch))
                        batch, batch_bytes = [], 0
                    if not self._staging.reserve(deadline=deadline):
                        self._give_up(op, i, deadline)
                        break
                task = WriteTask(pool, ikey, digests[i], self._staging.tail(pool.tail_bytes()), [(op, i)],
                                 src=view, guard=op, token=token)
                with self._lock:
                    other = self._inflight.get(ikey)
                    final = other is not None and self._join_locked(other, op, i)
                    if other is None:
                        self._inflight[ikey] = task
                if other is not None:
                    self._staging.release_tail(task.buf)
                    if token:
                        self._staging.unreserve()
                    if final:
                        self._finish(op, i, AckKind.DURABLE, True)
                    continue
                self._count("zero_copy_pages")
                batch.append(task)
                batch_bytes += pool.page_bytes
                if batch_bytes >= _MESSAGE_BYTES:
                    self._post(("write", batch))
                    batch, batch_bytes = [], 0
                continue
            buf = self._staging.acquire(pool.extent, blocking=False)
            if buf is None:
                # Hand over what we staged before blocking: those pages hold the tokens we wait for.
                if batch:
                    self._post(("write", batch))
                    batch, batch_bytes = [], 0
                buf = self._staging.acquire(pool.extent, deadline=deadline)
                if buf is None:  # past the caller's bound (tokens held by a stuck disk), or closing
                    self._give_up(op, i, deadline)
                    break
            np.copyto(np.frombuffer(buf, dtype=np.uint8, count=pool.page_bytes),
                      np.frombuffer(view, dtype=np.uint8))
            # CRC the copy while it is hot in cache, here rather than on an I/O thread: an I/O thread
            # that checksums is not writing, and the disk then sees fewer than io.threads requests.
            task = WriteTask(pool, ikey, digests[i], buf, [(op, i)], pcrc=crc32c(buf[: pool.page_bytes]))
            with self._lock:
                other = self._inflight.get(ikey)  # raced with another submitter of the same key?
                final = other is not None and self._join_locked(other, op, i)
                if other is None:
                    self._inflight[ikey] = task
            self._emit(op, i, AckKind.GATHERED, True)
            if other is not None:
                self._staging.release(pool.extent, buf)
                if final:
                    self._finish(op, i, AckKind.DURABLE, True)
                continue
            batch.append(task)
            batch_bytes += pool.page_bytes
            if batch_bytes >= _MESSAGE_BYTES:
                self._post(("write", batch))
                batch, batch_bytes = [], 0
        if batch:
            self._post(("write", batch))
        return op

    def _give_up(self, op: OpState, i: int, deadline: Optional[float]) -> None:
        """No staging token came before the caller's bound (tokens held by a stuck disk), or closing:
        pages i.. of the op fail."""
        n = len(op.keys)
        if deadline is not None and not self._closed:
            self._count("write_timeouts", n - i)
        for j in range(i, n):
            if op.results[j] is None:
                self._emit(op, j, AckKind.GATHERED, False)
                self._finish(op, j, AckKind.DURABLE, False)

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
        """Write and wait for DURABLE. With a timeout it returns within it whatever the device does:
        pages are copied into staging first (nothing reads `pages` after the return) and a page not
        durable in time is reported False (it may still become durable later: it is then a hit with
        its exact bytes). Without one, aligned pages are written straight from `pages` (no copy) and
        the call waits as long as the device takes. With one and io.zero_copy_writes, aligned pages are
        written straight from `pages` too; a write still reading them at the deadline is abandoned (never
        indexed: the caller may reuse its memory once we return). Under durability.backup_ack =
        "written" a page is True once written to its slot (readable by this store at once, durable when
        its group commit lands; a failed commit makes it a later miss)."""
        return self.finish_write_pages(self.start_write_pages(payload, keys, pages, timeout))

    def start_write_pages(self, payload: str, keys: list[bytes], pages: list,
                          timeout: Optional[float] = None) -> "PendingWrite":
        """write_pages' first half: stage the pages (copied, or under zero-copy referenced) and return
        without waiting for the disk; finish_write_pages(pending) is the second half. Between the two,
        zero-copy writes may still read `pages`: the caller keeps them unchanged until it has finished
        (upstream's backup keeps its host pages locked until the backup operation's ack). The timeout
        counts from this call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        zero_copy = timeout is None or self.config.io.zero_copy_writes
        op = self._submit_write(payload, keys, pages, True, zero_copy=zero_copy, deadline=deadline,
                                ack_at_write=self._ack_at_write)
        return PendingWrite(op, deadline)

    def finish_write_pages(self, pending: "PendingWrite") -> list[bool]:
        """Wait for a started write as write_pages does, within its deadline; per page True if stored."""
        op, deadline = pending.op, pending.deadline
        if not op.done.wait(_left(deadline)):
            self._timed_out(op, "write_timeouts")
        # Zero-copy only: no I/O may read the caller's pages after we return. Without a bound, wait for
        # it; with one (io.zero_copy_writes), a write still running at the deadline is abandoned: it
        # finishes into its still-reserved slot and is never indexed (writer._io_write).
        op.cancel_and_quiesce(deadline)
        self._raise_fatal()
        return op.final()

    def read_pages(self, payload: str, keys: list[bytes], outs: list, timeout: Optional[float] = None) -> list[bool]:
        """Read, verify and wait. With a timeout it returns within it whatever the device does: a page
        not read in time is a miss. Reads land in the store's own memory and are copied into `outs`
        only once verified, so a read that completes late never touches `outs`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        op = self._submit_read(payload, keys, outs, True, deadline)
        if not op.done.wait(_left(deadline)):
            self._timed_out(op, "read_timeouts")
        op.cancel_and_quiesce()  # waits only for copies into `outs` under way (memory, never the disk)
        self._raise_fatal()
        return op.final()

    # Hit queries. `key_prefix`: the keys asked about are key_prefix + keys[i] (a caller whose keys share
    # a constant head passes it once instead of building every full key; the answer is the same).

    def exists_prefix(self, payload: str, keys: list[bytes], key_prefix: bytes = b"") -> int:
        return self._exists([payload], keys, 0, key_prefix)

    def exists_prefix_multi(self, payloads: list[str], keys: list[bytes], key_prefix: bytes = b"") -> int:
        return self._exists(payloads, keys, 0, key_prefix)

    def exists_each(self, payloads: list[str], keys: list[bytes], classes: int = 1,
                    key_prefix: bytes = b"") -> list[bool]:
        """Per key: is it present in every payload? Keys fall in `classes` residue classes (key i in class
        i % classes) and only each class's prefix is answered: after a class's first miss its keys read
        False (a CP rank's hit query for every rotation phase at once)."""
        if not isinstance(classes, int) or classes < 1:
            raise ValueError(f"classes: must be an int >= 1, got {classes!r}")
        return self._exists(payloads, keys, classes, key_prefix)

    def _exists_rows(self, payloads: list[str], keys: list[bytes]) -> list:
        pools = [self._pool(p) for p in payloads]
        digests = digest_list(self._digests(keys))
        if len(pools) == 1:  # the common case: one key per row, no inner loop
            return [(k,) for k in map(index_key_prefix(self.rank, pools[0].tag).__add__, digests)]
        cols = [list(map(index_key_prefix(self.rank, pl.tag).__add__, digests)) for pl in pools]
        return list(zip(*cols))

    def touch(self, payload: str, keys: list[bytes]) -> None:
        pool = self._pool(payload)
        now = self._now()
        for k in keys:
            self._touch(pool, index_key(pool.tag, self._digest(k), self.rank), now)

    def delete(self, payload: str, keys: list[bytes]) -> int:
        pool = self._pool(payload)
        ikeys = [index_key(pool.tag, self._digest(k), self.rank) for k in keys]
        return self._control("delete", pool, ikeys)

    def clear(self) -> bool:
        """Drop every page of this rank; False (and the clear_errors counter) if the index failed."""
        return bool(self._control("clear"))

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

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop: let writes in flight commit, then close files. Returns within `timeout` even when the
        device never answers: past it every pending operation fails (DURABLE/READ ok=False, sync calls
        return False), submitters blocked on backpressure give up their remaining pages, and files and
        the index stay open for the threads still inside a syscall (released at process exit).
        Default bound: CLOSE_TIMEOUT_S."""
        if self._closed:
            return
        self._closed = True
        timeout = CLOSE_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._staging.shut()      # wake submitters waiting for a staging slot
        self._read_slots.shut()   # and readers waiting for a read permit
        self._post(("stop", threading.Event()))
        self._writer.join(_left(deadline))
        if self._writer.is_alive():  # a write or fdatasync never returned
            with self._post_lock:
                self._stopped = self._abandoned = True
            self._fail_inflight()
            self._drain_queue()
        quiet = self._wait_io_idle(deadline)
        self._fail_live_ops()
        self._wio.shutdown(wait=False, cancel_futures=True)
        self._rio.shutdown(wait=False, cancel_futures=True)
        self._fio.shutdown(wait=False, cancel_futures=True)
        if self._writer.is_alive() or not quiet:
            logger.error("L3 rank %d: close() gave up after %.1f s: the device did not answer (%d I/O request(s) "
                         "still in flight); pending operations failed, the slab files and the index stay open "
                         "until the process exits", self.rank, timeout, self._io_tasks)
            return
        for pool in self._pools.values():
            pool.slab.close()
        self._index.close()
        self._staging.close()
        if self._native is not None:
            self._native.close()
        self._release_locks()

    def _release_locks(self) -> None:
        for lock in reversed(self._locks):
            lock.release()

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

    def _timed_out(self, op: OpState, counter: str) -> None:
        """A sync caller's bound passed: its unfinished pages are reported False from now on."""
        with op.cond:
            late = sum(r is None for r in op.results)
        with self._lock:
            self._live_ops.discard(op)
        self._count(counter, late)
        self._log.warning(counter, "L3 rank %d: %d page(s) not done within the caller's timeout (the device "
                          "is slow or not answering); reported as failed", self.rank, late)

    def _join_locked(self, task: WriteTask, op: OpState, i: int) -> bool:
        """Under self._lock: page i of op rides `task` (same key, already in flight). True when the page
        is final right away (ack_at_write and the task's pwrite already returned)."""
        self._counters["write_dedup_pages"] += 1
        if op.ack_at_write and task.written and task.error is None:
            return True
        task.waiters.append((op, i))
        return False

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

    def _submit_read(self, payload: str, keys: list[bytes], outs: list, sync: bool,
                     deadline: Optional[float] = None) -> OpState:
        pool = self._pool(payload)
        if len(outs) != len(keys):
            raise ValueError(f"submit_read: {len(keys)} keys but {len(outs)} outs; pass one buffer per key")
        views = [self._page_view(pool, o, i, "outs", writable=True) for i, o in enumerate(outs)]
        op = self._new_op(keys, sync, AckKind.READ)
        digests = list(map(self._digest, keys))
        ikeys = [index_key(pool.tag, d, self.rank) for d in digests]
        with self._lock:
            self._counters["reload_pages"] += len(keys)
            # Read-your-writes: look at pending pages before the index, so a page that commits in between
            # is still found (its slot is the same either way).
            pending = self._written_entries(ikeys) if self._ack_at_write and self._inflight else None
        try:
            entries = self._index.get_many(ikeys)
        except IndexUnavailable as e:
            self._fault("index_errors", "index", "L3 index read failed (%s); reads are misses", e)
            entries = [None] * len(keys)
        if pending:
            entries = [e if e is not None else pending.get(i) for i, e in enumerate(entries)]
        todo = []
        for i, e in enumerate(entries):
            if e is None or not pool.entry_fits(e):
                if e is not None:
                    self._drop_entry(pool, ikeys[i], e)
                self._count("misses")
                self._finish(op, i, AckKind.READ, False)
                continue
            todo.append((e.slot, i))
        runs = self._read_runs(pool, sorted(todo))
        for k, run in enumerate(runs):
            if not self._acquire_read_slots(len(run), deadline):
                # Past the caller's bound (permits held by reads stuck on the device) or closing.
                left = [i for r in runs[k:] for _, i in r]
                if deadline is not None and not self._closed:
                    self._count("read_timeouts", len(left))
                self._count("misses", len(left))
                for i in left:
                    self._finish(op, i, AckKind.READ, False)
                break
            with self._lock:
                self._reads_inflight += len(run)
            items = [(i, ikeys[i], digests[i], entries[i], views[i]) for _, i in run]
            self._submit_io(self._rio, self._read_io, op, pool, items)
        return op

    def _acquire_read_slots(self, n: int, deadline: Optional[float]) -> bool:
        for k in range(n):
            if not self._read_slots.acquire(deadline=deadline):
                for _ in range(k):
                    self._read_slots.release()
                return False
        return True

    def _take_area(self, pool: PayloadPool) -> memoryview:
        """A free landing area (I/O thread). Preadvs in flight hold at most io.threads of the
        _LANDING_PER_THREAD x io.threads areas, so this waits only for copy-outs under way (memory,
        never the disk); not getting one in CONTROL_TIMEOUT_S means an area leaked: loud."""
        with self._landing_cond:
            free = self._landing_free[pool.name]
            if not self._landing_cond.wait_for(lambda: free, CONTROL_TIMEOUT_S):
                raise L3InvariantError(f"payload {pool.name!r}: no read landing area came back in "
                                       f"{CONTROL_TIMEOUT_S:g} s (an area was not returned after its copy-out)")
            return free.pop()

    def _give_area(self, pool: PayloadPool, area: memoryview) -> None:
        """Only once the preadv into `area` returned and nothing reads it any more."""
        with self._landing_cond:
            self._landing_free[pool.name].append(area)
            self._landing_cond.notify()

    def _deliver(self, op: OpState, pairs: list[tuple[memoryview, memoryview]], oks: list[bool]) -> list[bool]:
        """Copy verified pages from the landing area into the caller's outs, unless the caller gave up:
        after a timeout its memory is off limits and those pages are misses."""
        if not any(oks):
            return oks
        if not op.begin_io():
            return [False] * len(oks)
        try:
            for (src, dst), ok in zip(pairs, oks):
                if ok:  # numpy copies without holding the GIL
                    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
        finally:
            op.end_io()
        return oks

    def _written_entries(self, ikeys: list[bytes]) -> dict:
        """Under self._lock: {i: entry} for keys written to a slot whose index commit is pending."""
        out = {}
        for i, k in enumerate(ikeys):
            t = self._inflight.get(k)
            if t is not None and t.written and t.error is None:
                out[i] = t.entry(self.rank)
        return out

    def _read_runs(self, pool: PayloadPool, todo: list[tuple[int, int]]) -> list:
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
        if pool.can_read_run():  # the slab geometry allows it
            return runs
        return [[r] for run in runs for r in run]

    def _read_io(self, op: OpState, pool: PayloadPool, items: list) -> None:
        """I/O thread: read whole slots into a free landing area, then hand it to a finisher (verify +
        copy out) and return to the next request: the device does not wait for the copy."""
        area, handed = None, False
        try:
            if op.cancelled:  # the sync caller timed out: skip the I/O
                return
            area = self._take_area(pool)
            got = self._land(op, pool, items, area)
            handed = self._submit_io(self._fio, self._finish_read, op, pool, items, area, got)
            if not handed:  # close() shut the finisher pool meanwhile: finish here
                handed = True
                self._finish_read(op, pool, items, area, got)
        except BaseException as err:  # a bug in our own code: fail loud on the caller's next call
            self._set_fatal(err)
        finally:
            if not handed:
                if area is not None:  # its preadv returned (or never started): reusable
                    self._give_area(pool, area)
                for i, ikey, _, _, _ in items:
                    self._page_done(op, i, pool, ikey, False)

    def _land(self, op: OpState, pool: PayloadPool, items: list, area: memoryview) -> list[bool]:
        """Read the items' slots (whole extents, payload then header) into `area`, one preadv for a run
        of consecutive slots; if that fails or comes back short, each page alone, so one bad sector or
        a truncated slab costs only its own pages. Per page: read in full."""
        ext, n = pool.extent, len(items)
        if n > 1:
            try:
                if pool.slab.read_slots(items[0][3].slot, n, [area[:n * ext]]) == n * ext:
                    return [True] * n
            except OSError:
                pass
        got = []
        for k, (_, ikey, _, e, _) in enumerate(items):
            ok = False
            if not op.cancelled:
                try:
                    got_b = pool.slab.read_slot(e.slot, [area[k * ext:(k + 1) * ext]])
                    ok = got_b == ext
                    if not ok:
                        self._bad_page(pool, ikey, e, BlobError("short_read", f"{got_b}/{ext} B"))
                except OSError as err:
                    self._fault("read_errors", f"read-{err.errno}", "L3 read of %s slot %d failed: %s",
                                pool.name, e.slot, err)
            got.append(ok)
        return got

    def _finish_read(self, op: OpState, pool: PayloadPool, items: list, area: memoryview, got: list[bool]) -> None:
        """Finisher thread: verify the landed pages, copy the good ones out, give the area back."""
        ext, pb = pool.extent, pool.page_bytes
        oks = [False] * len(items)
        try:
            if not op.cancelled:  # else the caller gave up: its memory is off limits anyway
                for k, (_, ikey, digest, e, _) in enumerate(items):
                    if got[k]:
                        try:
                            pool.verify_landed(area[k * ext:(k + 1) * ext], e.slot, digest)
                            oks[k] = True
                        except BlobError as err:
                            self._bad_page(pool, ikey, e, err)
                oks = self._deliver(op, [(area[k * ext:k * ext + pb], it[4]) for k, it in enumerate(items)], oks)
        except BaseException as err:  # a bug in our own code: fail loud on the caller's next call
            self._set_fatal(err)
        finally:
            self._give_area(pool, area)
            for k, (i, ikey, _, _, _) in enumerate(items):
                self._page_done(op, i, pool, ikey, oks[k])

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
        with self._lock:
            self._dropping.add(ikey)  # the hit query stops offering it now; the write thread clears it
        try:
            deleted = any(self._index.commit(deletes=[(ikey, e)]))
        except (IndexFull, IndexUnavailable) as err:
            self._fault("index_errors", "index-d", "L3 index delete of a bad page failed (%s)", err)
            deleted = None
        self._post(("drop", pool, ikey, e, deleted))

    def _written_pending(self):
        """Under backup_ack = "written": ikey -> True for pages written to their slot whose index commit
        is still pending (read-your-writes); None otherwise."""
        if not self._ack_at_write:
            return None
        inflight = self._inflight

        def written(ikey: bytes) -> bool:
            t = inflight.get(ikey)  # a dict lookup is atomic; the task's flags only ever go one way
            return t is not None and t.written and t.error is None
        return written

    def _exists(self, payloads: list[str], keys: list[bytes], classes: int, key_prefix: bytes = b""):
        """One hit query, counted with its keys and wall time (hit_queries, hit_query_keys,
        hit_query_ns: what an operator needs to see whether index.digest_threads would pay)."""
        t0 = time.perf_counter_ns()
        try:
            return self._exists_query(payloads, keys, classes, key_prefix)
        finally:
            spent = time.perf_counter_ns() - t0
            with self._lock:
                c = self._counters
                c["hit_queries"] += 1
                c["hit_query_keys"] += len(keys)
                c["hit_query_ns"] += spent

    def _exists_query(self, payloads: list[str], keys: list[bytes], classes: int, key_prefix: bytes = b""):
        """Hit query without LMDB: a page is durable on this rank iff it is in its pool's LRU. The write
        thread adds it there after its index commit and removes it after its index delete, and only this
        process writes this rank's entries (cold start seeds the LRU from the index), so the LRU is this
        rank's view of the index; a membership test of the write thread's dict is atomic under the GIL.
        In the windows around a commit or delete the answer errs towards a miss, or towards a hit that
        read_pages (which asks the index) turns into a miss: never wrong bytes. classes=0: the prefix
        length; else exists_each's flags.
        Cost: one digest per key for all payloads and one lookup of it in the pools' shared HeldDigests
        (a bit per payload; chunks of _TABLE_CHUNK keys or more in its vectorized table, smaller ones in
        its dict), over chunks that grow from 64 keys: a miss at key i costs about i keys of work; a chunk
        whose keys are all held is one count, no flags built. Pages pending a commit or being dropped
        take the per-payload path. Keys: all bytes or all str (UTF-8)."""
        self._raise_fatal()
        if not isinstance(key_prefix, bytes):
            raise TypeError(f"key_prefix: must be bytes, got {type(key_prefix).__name__}")
        pools = [self._pool(p) for p in payloads]
        cols = [(index_key_prefix(self.rank, pl.tag).__add__, pl.lru.bit) for pl in pools]
        mask = 0
        for pl in pools:
            mask |= pl.lru.bit
        get, many = self._held.get, self._held.many
        every = mask == (1 << len(self._pools)) - 1
        pending = self._written_pending()
        dropping = self._dropping or None
        n = len(keys)
        flags: list = []
        missed: set = set()
        s, step = 0, 64
        while s < n:
            e = min(n, s + step)
            step = min(step * 2, 4096)
            try:
                digests = self._digests(keys[s:e], key_prefix)
            except TypeError:
                raise mixed_keys_error(keys) from None  # the odd key's place in the whole list
            # Big chunks: the vectorized table (its probes' cache misses overlap); small ones: the dict.
            arr = many(digests) if e - s >= _TABLE_CHUNK else None
            if arr is not None:
                # Every key of the chunk held (the usual big chunk): one count, no flag list built.
                if dropping is None and np.count_nonzero((arr & mask) == mask) == e - s:
                    if classes:
                        flags += itertools.repeat(True, e - s)
                    s = e
                    continue
                held = arr.tolist()
            else:
                digests = digest_list(digests)
                held = list(map(get, digests, itertools.repeat(0, e - s)))
            # A query of every payload of the store (the usual one) needs no masking: one pass less.
            hit = list(map(mask.__eq__, held if every else map(mask.__and__, held)))
            if (pending is not None and False in hit) or dropping is not None:
                hit = self._exists_slow(cols, digest_list(digests), held, pending, dropping)
            if not classes:
                if False in hit:
                    return s + hit.index(False)
            else:
                flags += hit
                missed.update(i % classes for i in itertools.compress(range(s, e), map(operator.not_, hit)))
                if len(missed) == classes:
                    break
            s = e
        if not classes:
            return n
        if not missed and len(flags) == n:  # no miss anywhere
            return flags
        # Each class answers its prefix only: from its first miss on, its keys read False.
        out = flags + [False] * (n - len(flags))
        for c in range(classes):
            col = out[c::classes]
            if False in col:
                j = col.index(False)
                out[c + j * classes::classes] = [False] * (len(col) - j)
        return out

    @staticmethod
    def _exists_slow(cols, digests, held, pending, dropping) -> list[bool]:
        """The hit flags of one chunk payload by payload: pages written but not committed count
        (pending), pages being dropped do not."""
        hit = None
        for prefixed, bit in cols:
            h = [bool(v & bit) for v in held]
            ikeys = list(map(prefixed, digests))
            if pending is not None:
                h = [x or pending(k) for x, k in zip(h, ikeys)]
            if dropping is not None:
                h = [x and k not in dropping for x, k in zip(h, ikeys)]
            hit = h if hit is None else list(map(operator.and_, hit, h))
        return hit

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
        self._post((kind, done, box) + args)
        if not done.wait(CONTROL_TIMEOUT_S):
            raise TimeoutError(f"L3 rank {self.rank}: {kind} did not finish within {CONTROL_TIMEOUT_S:g} s "
                               "(the device is not answering); it runs once the device does")
        self._raise_fatal()
        if "result" not in box:  # settled unrun: close() stopped the write thread meanwhile
            raise RuntimeError("L3Store is closed")
        return box["result"]

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

    def _submit_io(self, pool: ThreadPoolExecutor, fn, *args) -> bool:
        """Executor futures swallow exceptions; a task that dies outside its own handlers is a bug in
        this store, so it turns fatal (and fails every waiting op) instead of leaving callers hanging.
        Tasks are counted so that close() can tell when no thread is inside a syscall any more.
        False: the pool was shut down (the caller settles what the task would have)."""
        with self._io_cond:
            self._io_tasks += 1
        try:
            fut = pool.submit(fn, *args)
        except RuntimeError:  # the pool was shut down by a close() that raced this submit
            self._io_task_done(None)
            return False  # close() fails the op's pages
        fut.add_done_callback(self._io_task_done)
        return True

    def _io_task_done(self, fut) -> None:
        with self._io_cond:
            self._io_tasks -= 1
            self._io_cond.notify_all()
        if fut is not None and not fut.cancelled() and fut.exception() is not None:
            self._set_fatal(fut.exception())

    def _wait_io_idle(self, deadline: float) -> bool:
        with self._io_cond:
            while self._io_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._io_cond.wait(left)
            return True

    # ================================================================ messages to the write thread

    def _post(self, msg: tuple) -> None:
        """Hand a message to the write thread, or, once it stopped taking messages, settle it here: a
        submit racing close() must not wait on a thread that is gone."""
        with self._post_lock:
            if not self._stopped:
                self._q.put(msg)
                return
        self._settle(msg)

    def _settle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "write":  # never dispatched: no I/O reads these buffers
            for t in msg[1]:
                with self._lock:
                    if self._inflight.get(t.ikey) is t:
                        del self._inflight[t.ikey]
                    waiters = list(t.waiters)
                t.release_buffer(self._staging)
                for op, i in waiters:
                    self._finish(op, i, AckKind.DURABLE, False)
        elif kind in ("delete", "clear", "stop"):
            msg[1].set()
        # "io_done", "committed", "drop": bookkeeping of a write thread that is gone; nothing waits

    def _drain_queue(self) -> None:
        while True:
            try:
                msg = self._q.get_nowait()
            except queue.Empty:
                return
            self._settle(msg)

    def _fail_inflight(self) -> None:
        """Fail every page waiting on the write thread (it stopped or was given up on). Their staging
        buffers are not reused: an I/O thread may still be writing from them."""
        with self._lock:
            stuck = list(self._inflight.values())
            self._inflight.clear()
        for t in stuck:
            for op, i in t.waiters:
                self._finish(op, i, op.final_kind, False)

    def _fail_live_ops(self) -> None:
        """close(): every operation still pending fails now. Reads are quiesced (a copy into the
        caller's memory under way finishes first: bounded, no disk involved); a zero-copy write's
        own caller waits for its I/O, as write_pages without a timeout promises."""
        with self._lock:
            ops = list(self._live_ops)
        for op in ops:
            if op.final_kind == AckKind.READ:
                op.cancel_and_quiesce()
            else:
                op.cancel()
            for i, r in enumerate(op.results):
                if r is None:
                    self._finish(op, i, op.final_kind, False)

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
        finally:
            # Unblock everyone waiting on this thread: their pages fail (after a crash the next call
            # raises); whatever is posted from now on is settled by the poster.
            with self._post_lock:
                self._stopped = True
            self._fail_inflight()
            self._drain_queue()


def _landing_bytes(pool: PayloadPool) -> int:
    """One landing area for a payload: the longest coalesced read (_read_runs), whole slot extents."""
    return max(1, _READ_IO_BYTES // pool.extent) * pool.extent


@dataclass(frozen=True)
class PendingWrite:
    """A write_pages call between start_write_pages and finish_write_pages."""
    op: OpState
    deadline: Optional[float]


def _left(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _check_args(config, rank, ranks_per_node, payloads, cold_start_mode) -> None:
    if not isinstance(config, L3Config):
        raise TypeError("config: pass the L3Config returned by load_l3_config(path)")
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node: must be an int >= 1, got {ranks_per_node!r}")
    if ranks_per_node > MAX_RANKS:
        raise ValueError(f"ranks_per_node: at most {MAX_RANKS} (the index key holds the rank in 2 bytes), "
                         f"got {ranks_per_node}")
    if not isinstance(rank, int) or not 0 <= rank < ranks_per_node:
        raise ValueError(f"rank: must be in [0, ranks_per_node={ranks_per_node}), got {rank!r}")
    if not isinstance(payloads, dict) or not payloads:
        raise ValueError("payloads: pass a non-empty dict {payload name: page bytes}")
    for name, b in payloads.items():
        if not isinstance(name, str) or not _PAYLOAD_NAME.match(name):
            raise ValueError(f"payloads: name {name!r} must match [A-Za-z0-9_-]{{1,64}} (it names a slab file)")
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"payloads[{name!r}]: page bytes must be a positive int, got {b!r}")
    check_mode(cold_start_mode)
    for r, name in config.rank_to_disk.items():
        if r >= ranks_per_node:
            logger.warning("L3: rank_to_disk.\"%d\" names a rank >= ranks_per_node=%d; ignored", r, ranks_per_node)
