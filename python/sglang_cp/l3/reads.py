"""The store's read path: submit, land, verify, deliver.

submit (caller thread): look the keys up among this rank's durable pages (and, under backup_ack =
"written", among the pages written but not yet committed), group consecutive slots into coalesced reads
and hand each to a read I/O thread. land (I/O thread): one preadv of whole slot extents into a landing area the store
owns; a failed or short run is read again page by page. verify + deliver (finisher thread): header
identity and payload CRC32C per page, then a copy into the caller's buffer, unless the caller gave up.
So a read that never comes back cannot touch the caller's pages, and the I/O thread's next preadv does
not wait for the copy. With io.read_engine = "native" (native/reads.py) land, verify and deliver are one
C call per run on the I/O thread, chunk by chunk, and the caller's pages are written only through the
op's gate, which OpState closes at the caller's bound; "uring" (native/uring.py) is the same call with the
run's reads in flight together on an io_uring. The index lookup, permits, results and bad-page handling
here are shared by all engines.

Where a page's slot comes from: its pool's LRU (PageLRU), the write thread's in-memory copy of this
rank's index entries. Only this process writes this rank's entries; the write thread adds an entry to
the LRU after its index commit and before the page leaves `inflight` (so before its durable ack), and
removes it after its index delete and before its slot is freed. So a slot found there holds the page,
or holds it until a reclaim that began after the lookup frees it; a read that then meets another page's
bytes fails the header identity check (key digest, slot, rank, payload) or the CRC: a miss, never wrong
bytes, as when the slot came from an LMDB snapshot. Reading the LRU from this thread relies on the GIL
(state.py's list).

What it uses of the shared state (StoreState), and so what a replacement must keep doing:
`durable_entries` and `written_entries` to find pages; `pool`, `digest`, `new_op`, `finish`,
`count`/`fault`, `touch` + `now` (a hit bumps the LRU), `submit_io`, `set_fatal`; under `lock`, `reads_inflight` and the reload counters;
a bad page is added to `dropping`, its exact index entry deleted, and a `Drop` posted to the write
thread, which frees its slot (index delete before slot free). close() calls shut() then shutdown().
"""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from . import native
from .acks import AckKind, OpState
from .format.aligned import huge_aligned_view
from .format.blob import BlobError
from .errors import L3InvariantError
from .format.index import IndexEntry, IndexFull, IndexUnavailable, index_key
from .io_threads import IoThreads
from .messages import Drop
from .native.reads import NativeReader
from .payload_slab import PayloadSlab
from .staging import Tokens
from .state import CONTROL_TIMEOUT_S, StoreState, page_view
from .native.uring import open_reader

# A coalesced read covers consecutive slots up to this many bytes (one preadv), while keeping at least
# 2 x io.threads requests per batch. Each request costs Python work (submit, GIL, verify); at 1 MiB pages
# one page per request read 0.90x raw over 4 GiB, three per request 0.97x. At 64 KiB pages the request
# count bound keeps requests near 1 MiB (fewer, larger ones read slower there: 1.35x vs 1.46x raw).
READ_IO_BYTES = 4 << 20
# Landing areas per read I/O thread: one in a preadv, the others with pages being verified and copied
# out by a finisher while the I/O thread already reads the next request.
_LANDING_PER_THREAD = 2
_BLOB_COUNTERS = {"crc_mismatch": "crc_errors", "short_read": "short_reads", "foreign_blob": "foreign_blobs"}


class ReadPath:
    def __init__(self, st: StoreState):
        self.st = st
        threads = st.config.io.threads
        # io.read_engine = "native": each run is one C call on its I/O thread (native/reads.py), with a
        # chunk buffer per thread instead of landing areas and no finisher hop; "uring" the same with a
        # ring per thread (native/uring.py), or "native" where io_uring is refused (self.engine says which).
        self._native, self.engine = open_reader(st.config.io, st.rank)
        # Where reads land before they are copied out, allocated (and faulted in: first touch is slow on
        # VMs) when the store opens, before cold start. An area is taken for one preadv and comes back
        # only after its pages were copied out, so a preadv stuck in the kernel keeps its area for good
        # and a late completion lands where nobody looks.
        self._landing_free = {
            p.name: [] if self._native else [huge_aligned_view(_landing_bytes(p))
                                              for _ in range(_LANDING_PER_THREAD * threads)]
            for p in st.pools.values()}
        self._landing_cond = threading.Condition()
        self._permits = max(st.config.io.max_inflight_pages, threads)
        self._slots = Tokens(self._permits)
        self._rio = IoThreads(threads, f"l3r-r{st.rank}")
        self._fio = IoThreads(threads, f"l3f-r{st.rank}")  # verify + copy out

    def landing_areas(self, payload: str) -> list[memoryview]:
        """The payload's landing areas not in use right now (for tests of their placement)."""
        return list(self._landing_free[payload])

    def shut(self) -> None:
        """Readers waiting for a read permit give up (close())."""
        self._slots.shut()

    def shutdown(self) -> None:
        self._rio.shutdown(wait=False, cancel_futures=True)
        self._fio.shutdown(wait=False, cancel_futures=True)
        if self._native is not None:
            self._native.close()

    def engine_stats(self) -> dict:
        """The C engine's own counters (the uring engine's rings), {} for the others."""
        return self._native.stats() if self._native is not None else {}

    # ---------------------------------------------------------------- submit (caller thread)

    def submit(self, payload: str, keys: list[bytes], outs: list, sync: bool,
               deadline: Optional[float] = None) -> OpState:
        st = self.st
        pool = st.pool(payload)
        if len(outs) != len(keys):
            raise ValueError(f"submit_read: {len(keys)} keys but {len(outs)} outs; pass one buffer per key")
        views = [page_view(pool, o, i, "outs", writable=True) for i, o in enumerate(outs)]
        op = st.new_op(keys, sync, AckKind.READ)
        if self._native is not None:
            gate = op.gate = self._native.new_gate()
            op.close_gate = lambda wait: self._native.close_gate(gate, wait)
        digests = list(map(st.digest, keys))
        ikeys = [index_key(pool.tag, d, st.rank) for d in digests]
        with st.lock:
            st.counters["reload_pages"] += len(keys)
            # Read-your-writes: look at pending pages before the LRU, so a page that commits in between
            # is still found (its slot is the same either way; the write thread adds a page to the LRU
            # before it leaves `inflight`).
            pending = st.written_entries(ikeys) if st.ack_at_write and st.inflight else None
        entries = st.durable_entries(pool, ikeys)  # the pool's LRU (the module docstring says why)
        if pending:
            entries = [e if e is not None else pending.get(i) for i, e in enumerate(entries)]
        todo = []
        for i, e in enumerate(entries):
            if e is None or not pool.entry_fits(e):
                if e is not None:
                    self._drop_entry(pool, ikeys[i], e)
                st.count("misses")
                st.finish(op, i, AckKind.READ, False)
                continue
            todo.append((e.slot, i))
        runs = self._runs(pool, sorted(todo))
        for k, run in enumerate(runs):
            if not self._acquire_permits(len(run), deadline):
                # Past the caller's bound (permits held by reads stuck on the device) or closing.
                left = [i for r in runs[k:] for _, i in r]
                if deadline is not None and not st.closed:
                    st.count("read_timeouts", len(left))
                st.count("misses", len(left))
                for i in left:
                    st.finish(op, i, AckKind.READ, False)
                break
            with st.lock:
                st.reads_inflight += len(run)
            items = [(i, ikeys[i], digests[i], entries[i], views[i]) for _, i in run]
            st.submit_io(self._rio, self._read_io if self._native is None else self._read_io_native, op, pool, items)
        return op

    def _acquire_permits(self, n: int, deadline: Optional[float]) -> bool:
        """A run's permits all at once (runs are at most half the permits, ``_runs``): readers on several
        threads holding parts of their runs while waiting for the rest would wait for each other for ever."""
        return self._slots.acquire_many(n, deadline=deadline)

    def _runs(self, pool: PayloadSlab, todo: list[tuple[int, int]]) -> list:
        """Group pages of consecutive slots into coalesced reads (<= READ_IO_BYTES, and at least
        2 x io.threads requests when there is enough work). The native engine reads page by page in
        chunks, so its runs need not be consecutive and are sized only to spread the pages over the
        threads (each run is one call, whose Python cost is paid once)."""
        threads = self.st.config.io.threads
        spread = -(-len(todo) // (2 * threads))
        if self._native is not None:
            # Every thread busy with one run queued behind it, within the read window: runs larger than
            # permits / (2 x threads) would leave threads idle while the window is full (a 256-page
            # restore in runs of 16 under 64 permits kept 4 of 8 threads reading).
            per_io = max(1, min(spread, self._permits // (2 * threads)))
            return [todo[k:k + per_io] for k in range(0, len(todo), per_io)]
        per_io = max(1, min(READ_IO_BYTES // pool.extent, spread, self._permits // 2))
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

    # ---------------------------------------------------------------- land (read I/O thread)

    def _take_area(self, pool: PayloadSlab) -> memoryview:
        """A free landing area. Preadvs in flight hold at most io.threads of the
        _LANDING_PER_THREAD x io.threads areas, so this waits only for copy-outs under way (memory,
        never the disk); not getting one in CONTROL_TIMEOUT_S means an area leaked: loud."""
        with self._landing_cond:
            free = self._landing_free[pool.name]
            if not self._landing_cond.wait_for(lambda: free, CONTROL_TIMEOUT_S):
                raise L3InvariantError(f"payload {pool.name!r}: no read landing area came back in "
                                       f"{CONTROL_TIMEOUT_S:g} s (an area was not returned after its copy-out)")
            return free.pop()

    def _give_area(self, pool: PayloadSlab, area: memoryview) -> None:
        """Only once the preadv into `area` returned and nothing reads it any more."""
        with self._landing_cond:
            self._landing_free[pool.name].append(area)
            self._landing_cond.notify()

    def _read_io(self, op: OpState, pool: PayloadSlab, items: list) -> None:
        """Read whole slots into a free landing area, then hand it to a finisher (verify + copy out)
        and return to the next request: the device does not wait for the copy."""
        area, handed = None, False
        try:
            if op.cancelled:  # the sync caller timed out: skip the I/O
                return
            area = self._take_area(pool)
            got = self._land(op, pool, items, area)
            handed = self.st.submit_io(self._fio, self._finish_read, op, pool, items, area, got)
            if not handed:  # close() shut the finisher pool meanwhile: finish here
                handed = True
                self._finish_read(op, pool, items, area, got)
        except BaseException as err:  # a bug in our own code: fail loud on the caller's next call
            self.st.set_fatal(err)
        finally:
            if not handed:
                if area is not None:  # its preadv returned (or never started): reusable
                    self._give_area(pool, area)
                for i, ikey, _, _, _ in items:
                    self._page_done(op, i, pool, ikey, False)

    def _land(self, op: OpState, pool: PayloadSlab, items: list, area: memoryview) -> list[bool]:
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
                    self.st.fault("read_errors", f"read-{err.errno}", "L3 read of %s slot %d failed: %s",
                                  pool.name, e.slot, err)
            got.append(ok)
        return got

    def _read_io_native(self, op: OpState, pool: PayloadSlab, items: list) -> None:
        """io.read_engine = "native" or "uring": the run in one C call (read, check, deliver through the op's
        gate), then each page's result, on this I/O thread."""
        oks = [False] * len(items)
        try:
            if op.cancelled:  # the sync caller timed out: skip the I/O
                return
            todo, offsets = [], []
            for k, (_, _, _, e, _) in enumerate(items):
                try:
                    offsets.append(pool.slab.slot_offset(e.slot))  # the slab's fault seam sees each read
                    todo.append(k)
                except OSError as err:
                    self.st.fault("read_errors", f"read-{err.errno}", "L3 read of %s slot %d failed: %s",
                                  pool.name, e.slot, err)
            if not todo:
                return
            got = self._native.read(pool, [items[k][3].slot for k in todo], offsets, [items[k][2] for k in todo],
                                    [items[k][4] for k in todo], op.gate)
            for k, status, detail in zip(todo, got["status"].tolist(), got["detail"].tolist()):
                if status == native.OK:
                    oks[k] = True
                elif status == native.READ_ERROR:
                    self.st.fault("read_errors", f"read-{detail}", "L3 read of %s slot %d failed: errno %d",
                                  pool.name, items[k][3].slot, detail)
                elif status != native.CANCELLED:
                    self._bad_page(pool, items[k][1], items[k][3], _native_blob_error(status, detail, pool))
        except BaseException as err:  # a bug in our own code: fail loud on the caller's next call
            self.st.set_fatal(err)
        finally:
            for k, (i, ikey, _, _, _) in enumerate(items):
                self._page_done(op, i, pool, ikey, oks[k])

    # ---------------------------------------------------------------- verify + deliver (finisher thread)

    def _finish_read(self, op: OpState, pool: PayloadSlab, items: list, area: memoryview, got: list[bool]) -> None:
        """Verify the landed pages, copy the good ones out, give the area back."""
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
                oks = _deliver(op, [(area[k * ext:k * ext + pb], it[4]) for k, it in enumerate(items)], oks)
        except BaseException as err:  # a bug in our own code: fail loud on the caller's next call
            self.st.set_fatal(err)
        finally:
            self._give_area(pool, area)
            for k, (i, ikey, _, _, _) in enumerate(items):
                self._page_done(op, i, pool, ikey, oks[k])

    def _page_done(self, op: OpState, i: int, pool: PayloadSlab, ikey: bytes, ok: bool) -> None:
        st = self.st
        if ok:
            with st.lock:
                st.counters["reload_hits"] += 1
                st.counters["reload_bytes"] += pool.page_bytes
                st.payload_counters[pool.name]["reload_hits"] += 1
            st.touch(pool, ikey, st.now())
        else:
            st.count("misses")
        with st.lock:
            st.reads_inflight -= 1
        self._slots.release()
        st.finish(op, i, AckKind.READ, ok)

    def _bad_page(self, pool: PayloadSlab, ikey: bytes, e: IndexEntry, err: BlobError) -> None:
        counter = _BLOB_COUNTERS.get(err.reason, "header_errors")
        with self.st.lock:
            self.st.payload_counters[pool.name][counter] += 1
        self.st.fault(counter, f"blob-{err.reason}",
                      "L3 %s slot %d: %s; dropping the page (miss)", pool.name, e.slot, err)
        self._drop_entry(pool, ikey, e)

    def _drop_entry(self, pool: PayloadSlab, ikey: bytes, e: IndexEntry) -> None:
        """Delete the exact bad entry from the index now (so the miss is final when acked), then let the
        write thread free the slot: index delete before slot free."""
        st = self.st
        with st.lock:
            st.dropping.add(ikey)  # the hit query stops offering it now; the write thread clears it
        try:
            deleted = any(st.index.commit(deletes=[(ikey, e)]))
        except (IndexFull, IndexUnavailable) as err:
            st.fault("index_errors", "index-d", "L3 index delete of a bad page failed (%s)", err)
            deleted = None
        st.post(Drop(pool, ikey, e, deleted))


def _deliver(op: OpState, pairs: list[tuple[memoryview, memoryview]], oks: list[bool]) -> list[bool]:
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


def _native_blob_error(status: int, detail: int, pool: PayloadSlab) -> BlobError:
    """The BlobError the Python engine raises for the same fault (so the same counters move)."""
    reason = native.BLOB_REASONS[status]
    if status == native.SHORT_READ:
        return BlobError(reason, f"{detail}/{pool.extent} B")
    if status == native.FOREIGN:
        return BlobError(reason, native.FOREIGN_DETAIL.get(detail, ""))
    return BlobError(reason)


def _landing_bytes(pool: PayloadSlab) -> int:
    """One landing area for a payload: the longest coalesced read (ReadPath._runs), whole slot extents."""
    return max(1, READ_IO_BYTES // pool.extent) * pool.extent
