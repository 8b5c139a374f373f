"""L3Store: the per-rank, crash-consistent NVMe page store (engine-independent).

The facade: it opens the store (opening.py), holds its parts and their shared state (state.py), routes
each primitive of the contract (contract.py) to the part that serves it, and closes within a bound.
  writes    submit.py (caller side) -> writer.py (write thread) -> commit.py (group commit)
  reads     reads.py (submit, land, verify, deliver)
  hit query hits.py
Durability order per group of writes: data -> fdatasync -> index commit -> DURABLE ack. Deletes: index
delete -> slot free. read_pages / write_pages with a timeout and close() return within their bound
even when the device never answers. Design and crash guarantees: docs_internal/l3_store.md.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from .acks import Ack, OpState
from .config import L3Config
from .contract import PageStore, PendingRead, PendingWrite
from .format.disk_slab import FaultInjector
from .hits import HitQuery
from .format.index import index_key
from .messages import UNANSWERED, Clear, Delete, Reply, Stop
from .opening import check_args, open_state, recover
from .reads import ReadPath
from .recovery import DEFAULT_COLD_START
from .state import CONTROL_TIMEOUT_S, StoreState
from .submit import WriteSubmitter
from .writer import WriteThread

logger = logging.getLogger(__name__)
# close() waits this long for in-flight I/O and the last group commit; past it, pending operations fail
# and the files stay open for threads still inside a syscall (a hung device).
CLOSE_TIMEOUT_S = 30.0


class L3Store(PageStore):
    """One rank's store. `state` (StoreState) is the seam for tests and tools that need to look inside
    (index, pools, held digests); `reads` is the read path. Neither is part of the contract."""

    def __init__(self, config: L3Config, *, rank: int, ranks_per_node: int, payloads: dict[str, int],
                 cold_start: str = DEFAULT_COLD_START, fault_injector: Optional[FaultInjector] = None,
                 owner: Optional[str] = None):
        """`owner` describes this rank's identity in ownership errors (e.g. the server's DP/PP/TP ranks)."""
        check_args(config, rank, ranks_per_node, payloads, cold_start)
        self.config = config
        self.rank = rank
        self.ranks_per_node = ranks_per_node
        st = open_state(config, rank, ranks_per_node, payloads, fault_injector, owner)
        reads = None
        try:
            reads = self.reads = ReadPath(st)  # its landing areas too are allocated before cold start
            st.cold_start = recover(st, cold_start)
            st.record_cold_start(st.cold_start)
            self._hits = HitQuery(st)
            self._writes = WriteSubmitter(st)
            self._writer = WriteThread(st)
        except BaseException:
            # A store that failed to open leaves nothing behind: its I/O threads, rings and landing
            # memory go with its files and rank locks, so the caller can fix the cause and open again.
            if reads is not None:
                reads.shut()
                reads.shutdown()
            st.release_files()
            raise
        self.state = st
        self._writer.start()

    # ================================================================ writes

    def submit_write(self, payload: str, keys: list[bytes], pages: list) -> int:
        """Stage pages (blocks only for backpressure) and return an op id; acks GATHERED then DURABLE."""
        return self._writes.submit(payload, keys, pages, False).op_id

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
                          timeout: Optional[float] = None) -> PendingWrite:
        """write_pages' first half: stage the pages (copied, or under zero-copy referenced) and return
        without waiting for the disk; finish_write_pages(pending) is the second half. Between the two,
        zero-copy writes may still read `pages`: the caller keeps them unchanged until it has finished
        (upstream's backup keeps its host pages locked until the backup operation's ack). The timeout
        counts from this call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        zero_copy = timeout is None or self.config.io.zero_copy_writes
        op = self._writes.submit(payload, keys, pages, True, zero_copy=zero_copy, deadline=deadline,
                                 ack_at_write=self.state.ack_at_write)
        return PendingWrite(op, deadline)

    def finish_write_pages(self, pending: PendingWrite) -> list[bool]:
        """Wait for a started write as write_pages does, within its deadline; per page True if stored."""
        op, deadline = pending.op, pending.deadline
        if not op.done.wait(_left(deadline)):
            self._timed_out(op, "write_timeouts")
        # Zero-copy only: no I/O may read the caller's pages after we return. Without a bound, wait for
        # it; with one (io.zero_copy_writes), a write still running at the deadline is abandoned: it
        # finishes into its still-reserved slot and is never indexed (write_io.WriteIo._write).
        op.cancel_and_quiesce(deadline)
        self.state.raise_fatal()
        return op.final()

    # ================================================================ reads

    def submit_read(self, payload: str, keys: list[bytes], outs: list) -> int:
        """Read + verify pages into `outs`; one READ ack per page (ok=False: miss, outs[i] unspecified)."""
        return self.reads.submit(payload, keys, outs, False).op_id

    def read_pages(self, payload: str, keys: list[bytes], outs: list, timeout: Optional[float] = None) -> list[bool]:
        """Read, verify and wait. With a timeout it returns within it whatever the device does: a page
        not read in time is a miss. A read writes `outs` only while its op is live (the Python engine's
        finisher skips an op its caller gave up on; the native engines write through the op's gate,
        closed before this returns), so a read that completes late never touches `outs`; a miss's
        `outs[i]` is unspecified (the native and uring engines copy a page as they checksum it)."""
        return self.finish_read_pages(self.start_read_pages(payload, keys, outs, timeout))

    def start_read_pages(self, payload: str, keys: list[bytes], outs: list,
                         timeout: Optional[float] = None) -> PendingRead:
        """read_pages' first half: look the pages up and put their reads on the device, then return
        (it blocks only while the store's read window is full); finish_read_pages(pending) waits. A
        caller restoring several payloads or batches starts them all, then finishes them in turn, so
        the device sees one deep queue instead of one batch at a time. `outs` are written only by
        finish_read_pages' copies and by reads that complete before it returns; the timeout counts
        from this call."""
        t0 = time.perf_counter_ns()
        deadline = None if timeout is None else time.monotonic() + timeout
        return PendingRead(self.reads.submit(payload, keys, outs, True, deadline), deadline, t0)

    def finish_read_pages(self, pending: PendingRead) -> list[bool]:
        """Wait for a started read as read_pages does, within its deadline; per page True if read."""
        op, deadline = pending.op, pending.deadline
        try:
            if not op.done.wait(_left(deadline)):
                self._timed_out(op, "read_timeouts")
            op.cancel_and_quiesce()  # waits only for copies into `outs` under way (memory, never the disk)
            self.state.raise_fatal()
            return op.final()
        finally:
            # read_ns / read_calls: the wall time from start to finish (index lookup, reads, checks,
            # copy-out), which a restore's time splits into against upstream's own work around it
            spent = time.perf_counter_ns() - pending.started_ns
            with self.state.lock:
                self.state.counters["read_calls"] += 1
                self.state.counters["read_ns"] += spent

    def drain_acks(self, max_n: Optional[int] = None) -> list[Ack]:
        st = self.state
        st.raise_fatal()
        out = []
        while st.acks and (max_n is None or len(out) < max_n):
            try:
                out.append(st.acks.popleft())
            except IndexError:
                break
        return out

    # ================================================================ hit queries
    # `key_prefix`: the keys asked about are key_prefix + keys[i] (a caller whose keys share a constant
    # head passes it once instead of building every full key; the answer is the same).

    def exists_prefix(self, payload: str, keys: list, key_prefix: bytes = b"") -> int:
        return self._hits.exists([payload], keys, 0, key_prefix)

    def exists_prefix_multi(self, payloads: list[str], keys: list, key_prefix: bytes = b"") -> int:
        return self._hits.exists(payloads, keys, 0, key_prefix)

    def exists_each(self, payloads: list[str], keys: list, classes: int = 1,
                    key_prefix: bytes = b"") -> list[bool]:
        """Per key: is it present in every payload? Keys fall in `classes` residue classes (key i in class
        i % classes) and only each class's prefix is answered: after a class's first miss its keys read
        False (a CP rank's hit query for every rotation phase at once)."""
        if not isinstance(classes, int) or classes < 1:
            raise ValueError(f"classes: must be an int >= 1, got {classes!r}")
        return self._hits.exists(payloads, keys, classes, key_prefix)

    # ================================================================ maintenance

    def touch(self, payload: str, keys: list[bytes]) -> None:
        st = self.state
        pool = st.pool(payload)
        now = st.now()
        for k in keys:
            st.touch(pool, index_key(pool.tag, st.digest(k), st.rank), now)

    def delete(self, payload: str, keys: list[bytes]) -> int:
        st = self.state
        pool = st.pool(payload)
        ikeys = [index_key(pool.tag, st.digest(k), st.rank) for k in keys]
        return self._control("delete", Delete(Reply(), pool, ikeys))

    def clear(self) -> bool:
        """Drop every page of this rank; False (and the clear_errors counter) if the index failed."""
        return bool(self._control("clear", Clear(Reply())))

    def stats(self) -> dict:
        st = self.state
        with st.lock:
            counters = dict(st.counters)
            payload_counters = {p: dict(c) for p, c in st.payload_counters.items()}
            inflight_writes = len(st.inflight)
        counters["map_grows"] = st.index.grows
        return {
            "rank": self.rank,
            "occupancy": {p: {"used": pl.slots.used, "total": pl.slots.num_slots, "durable": len(pl.lru)}
                          for p, pl in st.pools.items()},
            "counters": counters,
            "payload_counters": payload_counters,
            "inflight": {"writes": inflight_writes, "reads": st.reads_inflight,
                         "staging_pages": st.staging.in_use, "staging_limit": st.staging.limit},
            "queues": {"write_thread": st.queue.qsize(), "touches": len(st.touches), "acks": len(st.acks)},
            "index": {"map_size": st.index.map_size(), "max_map_size": st.index.max_map_size},
            "cold_start": st.cold_start,
            # io.read_engine as it reads: "native" where "uring" was configured and io_uring is refused.
            "read_engine_effective": self.reads.engine,
            "read_engine_stats": self.reads.engine_stats(),
        }

    # ================================================================ lifecycle

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop: let writes in flight commit, then close files. Returns within `timeout` even when the
        device never answers: past it every pending operation fails (DURABLE/READ ok=False, sync calls
        return False), submitters blocked on backpressure give up their remaining pages, and files and
        the index stay open for the threads still inside a syscall (released at process exit).
        Default bound: CLOSE_TIMEOUT_S."""
        st = self.state
        if st.closed:
            return
        st.closed = True
        timeout = CLOSE_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        st.staging.shut()  # wake submitters waiting for a staging slot
        self.reads.shut()  # and readers waiting for a read permit
        st.post(Stop(Reply()))
        self._writer.join(_left(deadline))
        if self._writer.is_alive():  # a write or fdatasync never returned
            with st.post_lock:
                st.stopped = st.abandoned = True
            st.fail_inflight()
            st.drain_queue()
        quiet = st.wait_io_idle(deadline)
        st.fail_live_ops()
        self._writer.shutdown_io()
        self.reads.shutdown()
        if self._writer.is_alive() or not quiet:
            logger.error("L3 rank %d: close() gave up after %.1f s: the device did not answer (%d I/O request(s) "
                         "still in flight); pending operations failed, the slab files and the index stay open "
                         "until the process exits", self.rank, timeout, st.io_tasks)
            return
        st.release_files()

    # ================================================================ helpers

    def _control(self, what: str, msg: Delete | Clear):
        st = self.state
        st.raise_fatal()
        if st.closed:
            raise RuntimeError("L3Store is closed")
        st.post(msg)
        if not msg.reply.done.wait(CONTROL_TIMEOUT_S):
            raise TimeoutError(f"L3 rank {self.rank}: {what} did not finish within {CONTROL_TIMEOUT_S:g} s "
                               "(the device is not answering); it runs once the device does")
        st.raise_fatal()
        if msg.reply.result is UNANSWERED:  # settled unrun: close() stopped the write thread meanwhile
            raise RuntimeError("L3Store is closed")
        return msg.reply.result

    def _timed_out(self, op: OpState, counter: str) -> None:
        """A sync caller's bound passed: its unfinished pages are reported False from now on."""
        st = self.state
        with op.cond:
            late = sum(r is None for r in op.results)
        with st.lock:
            st.live_ops.discard(op)
        st.count(counter, late)
        st.log.warning(counter, "L3 rank %d: %d page(s) not done within the caller's timeout (the device "
                       "is slow or not answering); reported as failed", self.rank, late)


def _left(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
