"""What one cachebench rank process runs (inside ``cp_testbed.run_ranks``).

Per request, the way a HiCache scheduler serves a prefix:
1. L2: the longest prefix of the request's pages resident in the host pool (an LRU of
   pages over upstream's host pool, leaves evicted first as the radix cache does);
2. L3: for the rest, upstream's ``prefetch`` (hit query -> gloo MIN -> transfer into
   host pages allocated by ``allocate_storage_hit``), bytes checked against what was written;
3. compute: pages neither tier had are "computed" (filled with their pattern) and backed
   up through upstream's ``write_storage``.
The scheduler's ``prefetch_threshold`` is replayed as UnifiedRadixCache applies it: a request
whose missing part is shorter than the threshold issues no L3 lookup (declined), and an agreed
hit shorter than it is revoked at drain time (the pages were read, then freed and computed).
Every decision is a function of the replicated workload and of agreed values (the MIN'd
hit count), so all ranks take the same branch and enter the same collectives.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from sglang_cp.cachebench.cp_testbed import PAGE, Rank, emit

from .workload import Request


def _pattern(h: str, k: int, n: int):
    import torch

    seed = (int(h[:16], 16) ^ (0x9E3779B97F4A7C15 * (k + 1))) & (2**64 - 1)
    return torch.frombuffer(bytearray(np.random.default_rng(seed).bytes(n)), dtype=torch.uint8)


class Bench:
    def __init__(self, r: Rank, l2_pages: int, prefetch_threshold: int = 0):
        self.r = r
        self.l2_pages = l2_pages
        self.prefetch_threshold = prefetch_threshold
        self.l2: collections.OrderedDict[str, object] = collections.OrderedDict()  # hash -> host idx
        self.errors: list[str] = []

    def _evict_for(self, need: int, protect: set) -> None:
        while len(self.l2) + need > self.l2_pages:
            for h in self.l2:
                if h not in protect:
                    break
            else:
                raise AssertionError(f"L2 model: {need} pages needed, every resident page is in use")
            self.r.group.free(self.l2.pop(h))

    def _owned(self, idx) -> bool:
        return self.r.owner_of_page_start(int(idx[0])) == self.r.rank

    def _fill(self, h: str, idx) -> None:
        if not self._owned(idx):
            return
        for k, pool in self.r._pools():
            row = self.r.local_row(int(idx[0]))
            self.r._write_page(pool, row, lambda n: _pattern(h, k, n))

    def _equal(self, h: str, idx) -> bool:
        if not self._owned(idx):
            return True
        for k, pool in self.r._pools():
            view = self.r._page_view(pool, self.r.local_row(int(idx[0])))
            if not self.r.torch.equal(view, _pattern(h, k, view.numel())):
                return False
        return True

    def serve(self, req: Request, rid: str) -> dict:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        r = self.r
        tokens = req.tokens(PAGE)
        n = len(tokens) // PAGE
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE) if n else []
        k = 0
        while k < n and hashes[k] in self.l2:
            k += 1
        self._evict_for(n - k, set(hashes[:k]))
        l3 = declined = revoked = partial = 0
        t_read = t_write = 0.0
        if 0 < (n - k) * PAGE < self.prefetch_threshold:
            declined = n - k  # UnifiedRadixCache.prefetch_from_storage: "declined_too_short", no lookup
        elif k < n:
            t0 = time.perf_counter()
            hit, completed, hi = r.prefetch(tokens[k * PAGE:], rid=rid, timeout=300,
                                            last_hash=hashes[k - 1] if k else None)
            t_read = time.perf_counter() - t0
            if hit and hi is None:
                self.errors.append(f"{rid}: {hit} hit tokens but no host pages for them")
            if hi is not None:
                # Fewer pages than agreed: the existence check reads only the index, so damage (a CRC
                # mismatch after a `load` restart, a torn header, a read error) shows up only now. The
                # store dropped those pages as misses (no byte is wrong): a partial hit, its cause counted
                # by run_phases from the store's counters. Wrong bytes are checked below and are errors.
                partial = (hit - completed) // PAGE
                loaded = completed // PAGE
                for i in range(loaded):  # revoked or not, what was read must be what was written
                    if not self._equal(hashes[k + i], hi[i * PAGE:(i + 1) * PAGE]):
                        self.errors.append(f"{rid}: page {k + i} reloaded with wrong bytes")
                if 0 < completed < self.prefetch_threshold:
                    # The drain-time check ("below_threshold"): the hit is revoked, its pages freed.
                    revoked = loaded
                else:
                    l3 = loaded
                for i in range(l3):
                    self.l2[hashes[k + i]] = hi[i * PAGE:(i + 1) * PAGE]
                if len(hi) > l3 * PAGE:
                    r.group.free(hi[l3 * PAGE:])
        start = k + l3
        computed = n - start
        if computed:
            hi = r.alloc_host(computed * PAGE, start_owner=start % r.world)
            if hi is None:
                raise AssertionError(f"{rid}: host pool cannot hold {computed} pages (L2 model out of sync)")
            for i in range(computed):
                idx = hi[i * PAGE:(i + 1) * PAGE]
                self._fill(hashes[start + i], idx)
                self.l2[hashes[start + i]] = idx
            t0 = time.perf_counter()
            backed = r.backup(tokens[start * PAGE:], hi, timeout=300, hashes=hashes[start:])
            t_write = time.perf_counter() - t0
            if backed != computed * PAGE:
                self.errors.append(f"{rid}: backup acked {backed} of {computed * PAGE} tokens")
        for h in reversed(hashes):  # the root most recent: leaves go first, as in a radix tree
            self.l2.move_to_end(h)
        return {"pages": n, "l2": k, "l3": l3, "computed": computed, "t_read": t_read, "t_write": t_write,
                "l3_declined": declined, "l3_revoked": revoked, "l3_partial": partial}


# Store counters that explain an agreed hit read short: detected damage or a failed read, each page a miss
# and never a wrong byte. They are the causes of partial hits, not errors of the run.
PARTIAL_CAUSES = ("crc_errors", "header_errors", "foreign_blobs", "short_reads", "read_errors")
# Store counters that are errors of the run: pages that could not be stored or indexed.
_ERROR_COUNTERS = ("write_errors", "index_errors")


def _log_to(path: str) -> None:
    """SGLang and torch log every pool they build; keep that in a per-rank file so the
    console shows the progress bars and the table (the file is named in the report)."""
    import os
    import warnings

    warnings.filterwarnings("ignore")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def rss_bytes() -> int:
    """This process's resident set (VmRSS), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _live(stats) -> int:
    return sum(o["durable"] for o in stats["occupancy"].values())


def run_phases(rank, world, rendezvous, l3_config, phases, l2_pages, layers, cold_start, host_pages, sidecars,
               log_path=None, prefetch_threshold=0, soak=False):
    """``phases``: [(name, [Request, ...])]. Returns per-request records and per-phase totals.

    ``soak`` (cachebench --soak): every rank emits ("pid", pid) once its store is open and each new
    error as ("error", text), rank 0 ("served", phase, i, l2, l3, computed) per answered request, so the
    parent keeps what it needs when a rank is SIGKILLed mid-phase; the result adds the store's state at
    the start and the end, RSS samples and the staging high-water mark."""
    if log_path:
        _log_to(log_path.format(rank=rank))
    import os

    import torch

    # Page compares and copies are ~300 KB each: torch's intra-op thread pool only adds
    # barrier spinning, and N ranks already share the cores.
    torch.set_num_threads(1)
    r = Rank(rank, world, rendezvous, l3_config, sharded=world > 1, layers=layers, host_pages=host_pages,
             cold_start=cold_start, sidecars=sidecars)
    try:
        b = Bench(r, l2_pages, prefetch_threshold)
        records = []
        page_bytes = {"kv": r.native_host.get_data_page(0, flat=True).numel() * 2}
        for name, pool in r.sidecar_hosts.items():
            page_bytes[name.value] = r._page_view(pool, 0).numel()
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        get_storage_hash_str(list(range(PAGE)), None, page_size=PAGE)  # loads the native hash: not timed
        start = r.backend.l3_stats()
        rss, staging_max, sent = [rss_bytes()], 0, 0
        if soak:
            emit(("pid", os.getpid()))
        r.dist.barrier()
        for phase, reqs in phases:
            if rank == 0:
                emit(("phase", phase, len(reqs)))
            for i, req in enumerate(reqs):
                before = r.backend.l3_stats()["counters"]
                t0 = time.time()
                rec = b.serve(req, f"{phase}-{i}")
                after = r.backend.l3_stats()["counters"]
                rec.update(phase=phase, t=t0, dt=time.time() - t0,
                           read_bytes=after["reload_bytes"] - before["reload_bytes"],
                           write_bytes=after["spill_bytes"] - before["spill_bytes"],
                           store_errors=sum(after[c] - before[c] for c in _ERROR_COUNTERS),
                           l3_partial_causes={c: after[c] - before[c] for c in PARTIAL_CAUSES
                                              if after[c] != before[c]})
                records.append(rec)
                if rank == 0:
                    emit(("tick", 1))
                if soak:
                    for e in b.errors[sent:]:
                        emit(("error", e))
                    sent = len(b.errors)
                    staging_max = max(staging_max, r.backend.l3_stats()["inflight"]["staging_pages"])
                    if rank == 0:
                        emit(("served", phase, i, rec["l2"], rec["l3"], rec["computed"]))
                    if i % 16 == 15:
                        rss.append(rss_bytes())
        stats = r.backend.l3_stats()
        rss.append(rss_bytes())
        return {"rank": rank, "records": records, "errors": b.errors, "page_bytes": page_bytes,
                "cold_start": stats["cold_start"], "occupancy": stats["occupancy"],
                "counters": stats["counters"], "live_start": _live(start), "live_end": _live(stats),
                "counters_start": start["counters"], "rss": rss, "staging_max": staging_max,
                "staging_end": stats["inflight"]["staging_pages"], "staging_limit": stats["inflight"]["staging_limit"],
                "index": stats["index"]}
    finally:
        r.close()
