"""Upstream symbol: ``sglang.srt.mem_cache.hicache_storage.HiCacheStorage`` (subclassed).

Our L3 store behind upstream's HiCache storage interface, loaded by upstream's own
``StorageBackendFactory`` (``--hicache-storage-backend dynamic`` with
``interface_v1: 1``; ``l3_backend_select`` spells that for the user). Upstream's
controller keeps driving backup, prefetch and the rank agreement; this class only moves
pages between the host pools and the store.

What it adds over upstream's ``file`` backend: every page is a CRC'd, self-describing
O_DIRECT slot made durable (data -> fdatasync -> index) before it counts, a bad page is
one miss (never wrong bytes, never a failed batch), and under
``--enable-kv-cache-sharding`` each rank persists and reloads only the physical pages of
its own stripe (``PageInterleaveHostPool``: logical host page ``h`` belongs to rank
``h % N`` at local row ``h // N``), zero-copy from/to the host pool where the layout
keeps a page contiguous (``page_first``), through one bounce copy otherwise.

Sidecar pools (DSA indexer-K, draft/MTP KV) ride the v2 ``PoolTransfer`` API and are
stored as their own payloads under the same page keys, so a logical page is a hit only
when every payload of it is durable on its owner (``batch_exists_v2`` folds them).

Seed items: "CP HiCache owner pages", "draft/MTP KV in lockstep with target KV",
"validate_page_aligned_token_indices before native transfer code", "L3 store wired as
the HiCache storage tier".
"""

from __future__ import annotations

import contextlib

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

from sglang_cp.integration.cp_l3.host_views import HostPageBytes, as_bytes_view
from sglang_cp.integration.cp_l3.identity import derive_identity, runtime_topology
from sglang_cp.integration.cp_l3.keys import KeyIdentity, KeyScheme
from sglang_cp.integration.cp_l3.config import DTYPES_KEY
from sglang_cp.integration.cp_l3.page_groups import validate_page_aligned
from sglang_cp.integration.cp_l3.plan import RESTORE, PrefetchPlan, held_prefix_per_phase
from sglang_cp.integration.cp_l3.prefetch_outcomes import PrefetchOutcomes
from sglang_cp.l3.errors import L3StartupError
from sglang_cp.l3.ratelog import RateLimitedLog
from sglang_cp.l3.recovery import DEFAULT_COLD_START
from sglang_cp.l3.switch_interval import SwitchInterval

logger = logging.getLogger(__name__)

UPSTREAM_SYMBOLS = (
    "sglang.srt.mem_cache.hicache_storage.HiCacheStorage",
    "sglang.srt.mem_cache.pool_host.page_interleave.PageInterleaveHostPool",
    "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory._create_dynamic_backend",
)
KV_PAYLOAD = PoolName.KV.value
# Pools upstream queries with PoolHitPolicy.TRAILING_PAGES (a window of state that ends at the
# hit: SWA KV, Mamba/linear-attention state; hybrid_pool_assembler and unified_cache/components).
# Our existence check and CP agreement are per page over the whole prefix: refused at attach
# (docs_internal/cp_l3_integration.md, "Hybrid pools").
TRAILING_POOLS = frozenset(n.value for n in (
    PoolName.MAMBA, PoolName.SWA, PoolName.AUXILIARY_SWA, PoolName.DRAFT_SWA, PoolName.DEEPSEEK_V4_C4_STATE,
    PoolName.DEEPSEEK_V4_C4_INDEXER_STATE, PoolName.DEEPSEEK_V4_C128_STATE))
# Upstream's prefetch and backup threads call us synchronously; a stuck disk must not wedge
# them (and with them shutdown). Past READ_TIMEOUT_S the unfinished pages are misses; a read
# writes the host pages only while its op is live (the store's finisher check or gate), so
# nothing reaches them after read_pages returned. Past WRITE_TIMEOUT_S the pages not yet durable are reported not written; with a
# timeout the store copies the host pages into its staging memory first, so it never reads
# them after write_pages returned (upstream may free or reuse them then). Under the L3
# config's io.zero_copy_writes it writes aligned host pages directly instead, and a write
# still running at the timeout is never indexed (docs_internal/l3_store.md).
READ_TIMEOUT_S = 60.0
WRITE_TIMEOUT_S = 60.0



@dataclass
class OpenQuery:
    """A hit query in progress on upstream's prefetch thread (``prefetch.storage_hit_query_around``):
    the plan our per-phase answers go into, and how many pages earlier calls of it covered."""
    thread: int
    plan: PrefetchPlan
    queried_pages: int = 0


@dataclass
class OpenBackup:
    """An upstream backup operation in progress on its backup thread (``backup.page_backup_around``,
    under ``durability.backup_ack = "operation"``): the writes it staged, each with the operation page
    of its call's first key, and how many pages its calls covered so far."""
    thread: int
    writes: list = field(default_factory=list)  # (first page, [(key i, host row)], PendingWrite)
    pages: int = 0


@dataclass
class PayloadRead:
    """One payload's reads of one restore, between start and finish."""
    payload: str
    n_keys: int
    mine: list  # [(page i, local host row)] of this rank's pages
    copies: list  # per read page: a bounce tensor to copy into the pool, or None (read in place)
    pending: Any  # l3.contract.PendingRead


@dataclass
class RestoreReads:
    """Every payload's reads of one prefetch, started at once (``start_restore``)."""
    reads: list  # [PayloadRead]


class CpL3Storage(HiCacheStorage):
    """HiCacheStorage over :class:`sglang_cp.l3.L3Store` (one store per rank process)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.prefetch_outcomes = PrefetchOutcomes()  # upstream's per-rank prefetch outcomes, for /metrics
        extra = dict(storage_config.extra_config or {})
        self.l3_config_path = extra.get("cp_l3_config")
        self.cold_start = extra.get("cp_l3_cold_start", DEFAULT_COLD_START)
        self.cp_strategy = extra.get("cp_strategy") or "none"
        if not self.l3_config_path:
            raise ValueError(
                "sglang-cp L3 backend: extra_config lacks 'cp_l3_config'; start the server with "
                "--enable-cp-l3 --cp-l3-config PATH instead of spelling the dynamic backend by hand"
            )
        if not extra.get("interface_v1"):
            raise ValueError(
                "sglang-cp L3 backend: extra_config lacks 'interface_v1': 1, so upstream would move pages "
                "through the legacy get/set API, which this backend refuses (it serves the zero-copy v1/v2 "
                "page API only); start the server with --enable-cp-l3 --cp-l3-config PATH instead of "
                "spelling the dynamic backend by hand"
            )
        self.store = None
        self.mem_pool_host = None
        self.registered_pools: dict[Any, Any] = {}
        self.keys: Optional[KeyScheme] = None
        self.placement = None
        self.shard_rank = 0
        self.shard_size = 1
        self._metrics = None
        self.identity = None
        self.unsupported_queries = 0  # hit queries naming a pool policy we do not store (each a miss)
        self.open_query: Optional[OpenQuery] = None  # set by the prefetch hook around one hit query
        self.open_backup: Optional[OpenBackup] = None  # set by the backup hook around one operation
        self.query_ride = None  # prefetch.QueryRide: our vector on upstream's hit-count MIN, for one call
        self.placement_assert_groups = None  # gloo groups of --cp-hicache-placement-assert (debug)
        self.host_bytes = HostPageBytes()  # host-pool pages as bytes, no GIL release per page (host_views)
        self.switch_interval: Optional[SwitchInterval] = None  # io.gil_switch_interval_ms, set at store open
        self._log = RateLimitedLog(logger)

    # ------------------------------------------------------------------ setup
    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        if isinstance(mem_pool_host, PageInterleaveHostPool):
            self.placement = mem_pool_host.placement
            self.shard_rank = mem_pool_host.shard_rank
            self.shard_size = mem_pool_host.shard_size
        # The plain HiCacheController fires on_host_pools_registered itself; the hybrid one
        # registers sidecars first. Either way the store opens once all payloads are known.

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        """Upstream registers most sidecar pools before ``on_host_pools_registered``, but a draft registered
        as a sidecar after the attach (EAGLE / EAGLE3: ``UnifiedRadixCache.register_sidecar_pool``) arrives
        here alone, once the store is open. Its pages are backed up with the target KV's, so the store is
        opened again with that payload (at startup, before any request): a store without it failed every
        backup and every hit query, leaving the tier on but empty."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if self.store is None or pool_key(host_pool_name) in self.payloads:
            return
        self._refuse_trailing_pools()
        old = self.store
        self.store = None
        old.close()
        self._open_store(cold_start="load")  # what the first open did stays (a 'clear' left it empty)
        logger.info("sglang-cp L3: payload %s registered after the store opened; store reopened with payloads %s",
                    pool_key(host_pool_name), self.payloads)

    def _refuse_trailing_pools(self) -> None:
        trailing = sorted(pool_key(n) for n in self.registered_pools if pool_key(n) in TRAILING_POOLS)
        if trailing:
            raise L3StartupError(
                f"--enable-cp-l3: this model has hybrid pools ({', '.join(trailing)}) whose pages upstream "
                "restores as a trailing window (SWA KV, Mamba state); the sglang-cp L3 store serves full-prefix "
                "pools only (target KV, DSA indexer, draft KV). Drop --enable-cp-l3 for this model (upstream's "
                "--hicache-storage-backend file serves it), or turn the hybrid pools off where the model allows "
                "(e.g. --disable-hybrid-swa-memory)")

    def on_host_pools_registered(self) -> None:
        if self.store is not None:
            return
        self._refuse_trailing_pools()
        sc = self.storage_config
        # One L3 rank per KV-owning process of this node (DP replica, attention DP/CP/TP, PP), numbered
        # among the node's own processes; the store's lock refuses a second owner (l3_identity).
        self.identity = derive_identity(sc, runtime_topology())
        cfg = self._open_store(self.cold_start)
        RESTORE.attach(self, self.shard_size)  # the restore path's hooks act from here on (prefetch.py)
        # This is the serving process (upstream's scheduler): its GIL hand-offs bound a restore's waits.
        self.switch_interval = SwitchInterval(cfg.io.gil_switch_interval_ms)
        self._metrics = _start_metrics(sc, self.shard_rank if self.sharded else sc.attn_cp_rank, self.l3_stats)
        logger.info("sglang-cp L3 backend ready: %s, shard %d/%d, payloads %s, backup ack %s",
                    self.identity.label(), self.shard_rank, self.shard_size, self.payloads,
                    self.store.config.backup_ack)

    def _open_store(self, cold_start: str):
        """The store over every registered payload, and the keys that name its pages (the digest covers
        each payload's page bytes); returns the L3 config."""
        from sglang_cp.args import load_config
        from sglang_cp.l3 import L3Store

        payloads = {KV_PAYLOAD: self._page_bytes(self._native(self.mem_pool_host))}
        for name, pool in self.registered_pools.items():
            pname = pool_key(name)
            if pname != KV_PAYLOAD:
                payloads[pname] = self._page_bytes(pool)
        cfg = load_config(self.l3_config_path)
        sc = self.storage_config
        rank, ranks_per_node = self.identity.local_rank, self.identity.local_count
        logical_dtypes = self._logical_dtypes(payloads)
        self.store = L3Store(cfg, rank=rank, ranks_per_node=ranks_per_node, payloads=payloads,
                             cold_start=cold_start, owner=self.identity.label())
        native = self._native(self.mem_pool_host)
        self.keys = KeyScheme(KeyIdentity(
            model=str(sc.model_name or ""),
            dtype=str(native.dtype),
            page_size=int(native.page_size),
            layout=str(native.layout),
            rank_replicated=bool(sc.is_mla_model),
            tp_rank=0 if sc.is_mla_model else sc.tp_rank,
            tp_size=1 if sc.is_mla_model else sc.tp_size,
            pp_rank=sc.pp_rank,
            pp_size=sc.pp_size,
            cp_size=max(self.shard_size, sc.attn_cp_size),
            cp_strategy=self.cp_strategy,
            sharded=self.placement is not None,
            page_bytes=tuple(sorted(payloads.items())),
            logical_dtypes=logical_dtypes,
        ))
        self.payloads = payloads
        return cfg

    def _logical_dtypes(self, payloads: dict) -> tuple:
        """((payload, logical KV dtype), ...) as the device pools declare them (l3_storage_config)."""
        recorded = dict((self.storage_config.extra_config or {}).get(DTYPES_KEY) or {})
        out = []
        for p in sorted(payloads):
            dtype = recorded.get(p)
            if dtype is None:
                stored = self._native(self._pool_for(p)).dtype
                if stored == torch.uint8:
                    raise L3StartupError(
                        f"sglang-cp L3: cannot tell the logical KV dtype of payload '{p}': its host pool stores "
                        "uint8, which fp8_e4m3 and fp8_e5m2 share, and the storage config lacks "
                        f"'{DTYPES_KEY}' (the sglang-cp plugin's hooks are not active in this process; "
                        "start the server with the plugin loaded)")
                dtype = str(stored)
            out.append((p, dtype))
        return tuple(out)

    @staticmethod
    def _native(pool):
        return pool.host_pool if isinstance(pool, PageInterleaveHostPool) else pool

    @staticmethod
    def _page_bytes(pool) -> int:
        page = pool.get_data_page(0, flat=True)
        return page.numel() * page.element_size()

    @property
    def sharded(self) -> bool:
        return self.placement is not None

    def _owner_key_rank(self) -> int:
        """The rank coordinate in our keys: the stripe owner under sharding, else this rank's replica."""
        if self.sharded:
            return self.shard_rank
        sc = self.storage_config
        return sc.attn_cp_rank if sc.attn_cp_size > 1 else 0

    # ------------------------------------------------------------------ page addressing
    def _pages(self, host_indices: torch.Tensor, n_pages: int):
        """(page i, local row start) for the pages of this rank in a logical index run."""
        ps = self._native(self.mem_pool_host).page_size
        starts = validate_page_aligned(host_indices, ps, n_pages)
        if not self.sharded:
            return [(i, s) for i, s in enumerate(starts)]
        # Upstream's placement arithmetic (``PageInterleavePlacement``: ``%`` and ``//`` only) on Python
        # ints, not on a tensor: three torch ops would each release the GIL (see page_groups.py).
        # test_hook_targets checks that the pinned placement gives the tensor's answers for ints.
        owner_of, local_index, me = self.placement.owner_of, self.placement.local_index, self.shard_rank
        return [(i, local_index(s)) for i, s in enumerate(starts) if owner_of(s) == me]

    def _pool_for(self, name) -> Any:
        if pool_key(name) == KV_PAYLOAD:
            return self._native(self.mem_pool_host)
        for key, pool in self.registered_pools.items():
            if pool_key(key) == pool_key(name):
                return self._native(pool)
        raise KeyError(f"sglang-cp L3: no host pool registered for payload {name!r}")

    # ------------------------------------------------------------------ v1 (zero-copy) API
    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._set(KV_PAYLOAD, keys, host_indices)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._get(KV_PAYLOAD, keys, host_indices)

    def _set(self, payload: str, keys: List[str], host_indices) -> List[bool]:
        results = [True] * len(keys)  # pages of other ranks' stripes are theirs to report
        mine = self._pages(host_indices, len(keys))
        if not mine:
            return results
        pool = self._pool_for(payload)
        pages = [self._page_source(payload, pool, row) for _i, row in mine]
        store_keys = self.keys.keys([keys[i] for i, _ in mine], self._owner_key_rank())
        # Returns per the L3 config's durability.backup_ack: "durable" (data -> fdatasync -> index
        # commit, the default) or "written" (in its slot and readable by this process; durable once
        # its group commit lands). Upstream only needs the page readable by this process; a restart
        # reads the index alone. "operation": inside an upstream backup operation (begin_backup, by
        # the backup.py hook) the call returns once its pages are staged, and end_backup
        # waits for all of them before upstream acks the operation. docs_internal/l3_write_ack.md.
        backup = self.open_backup
        if backup is not None and backup.thread == threading.get_ident():
            base = backup.pages
            backup.pages += len(keys)
            backup.writes.append((base, mine, self.store.start_write_pages(payload, store_keys, pages,
                                                                           timeout=WRITE_TIMEOUT_S)))
            return results  # provisional for our pages: end_backup reports the ones not stored
        ok = self.store.write_pages(payload, store_keys, pages, timeout=WRITE_TIMEOUT_S)
        for (i, _row), good in zip(mine, ok):
            results[i] = bool(good)
        return results

    # ------------------------------------------------------------------ backup operations
    @property
    def backup_per_operation(self) -> bool:
        """durability.backup_ack = "operation": one upstream backup operation waits once, at its end."""
        return self.store is not None and self.store.config.backup_ack == "operation"

    def begin_backup(self) -> None:
        """Open an upstream backup operation on this (the backup) thread: until end_backup, each
        batch_set returns once its pages are staged, so the next batch is staged while this one is
        written, and no batch waits for its own fdatasync and index commit."""
        if self.open_backup is not None:
            raise RuntimeError("sglang-cp L3: begin_backup while a backup operation is open (upstream runs "
                               "one backup operation at a time on its backup thread)")
        self.open_backup = OpenBackup(thread=threading.get_ident())

    def end_backup(self) -> Optional[int]:
        """Close the open operation: wait for each of its writes within the write's own bound, then
        return the operation's first page that was not stored (None: every page is durable). Every
        write is waited for even if one raises, so no zero-copy write reads upstream's host pages
        after the operation's ack releases them."""
        backup, self.open_backup = self.open_backup, None
        ops = backup.writes if backup is not None else []
        first_bad, error = None, None
        for base, mine, pending in ops:
            try:
                ok = self.store.finish_write_pages(pending)
            except Exception as e:  # noqa: BLE001  (re-raised below, after the other writes)
                error = error or e
                ok = [False] * len(mine)
            for (i, _row), good in zip(mine, ok):
                if not good and (first_bad is None or base + i < first_bad):
                    first_bad = base + i
        if error is not None:
            raise error
        return first_bad

    def _page_source(self, payload: str, pool, row):
        """A page's bytes to write: the host pool's own memory where the page is contiguous, else a flat
        copy of it (layer_first), in upstream's flat order."""
        out = self.host_bytes.row(payload, pool, row)
        return out if out is not None else as_bytes_view(pool.get_data_page(row, flat=False))

    def _get(self, payload: str, keys: List[str], host_indices) -> List[bool]:
        return self._finish_get(self._start_get(payload, keys, host_indices))

    def _start_get(self, payload: str, keys: List[str], host_indices) -> PayloadRead:
        """Look this rank's pages up and put their reads on the device (into the host pool where a
        page is contiguous there, else into a bounce); ``_finish_get`` waits and reports."""
        mine = self._pages(host_indices, len(keys))
        if not mine:
            return PayloadRead(payload, len(keys), [], [], None)
        pool = self._pool_for(payload)
        outs, copies = [], []
        for _i, row in mine:
            out = self.host_bytes.row(payload, pool, row)
            if out is not None:
                outs.append(out)  # zero-copy: into the host pool
                copies.append(None)
            else:
                view = pool.get_data_page(row, flat=False)
                bounce = torch.empty(view.numel(), dtype=view.dtype)
                outs.append(as_bytes_view(bounce))
                copies.append(bounce)
        store_keys = self.keys.keys([keys[i] for i, _ in mine], self._owner_key_rank())
        pending = self.store.start_read_pages(payload, store_keys, outs, timeout=READ_TIMEOUT_S)
        return PayloadRead(payload, len(keys), mine, copies, pending)

    def _finish_get(self, read: PayloadRead) -> List[bool]:
        """Per key: True for this rank's pages read up to its first miss and for other ranks' pages
        (theirs to report); nothing after this rank's first miss counts (prefix semantics)."""
        results = [True] * read.n_keys
        if not read.mine:
            return results
        ok = self.store.finish_read_pages(read.pending)  # first: whatever raises after, the read is over
        pool = self._pool_for(read.payload)
        first_miss = next((j for j, good in enumerate(ok) if not good), len(ok))
        for j, ((i, row), good) in enumerate(zip(read.mine, ok)):
            results[i] = bool(good) and j < first_miss
            if results[i] and read.copies[j] is not None:
                pool.set_from_flat_data_page(row, read.copies[j])
        # No explicit touch: the store bumps every page it reads back (GC keeps hot pages).
        if first_miss < len(read.mine):
            cut = read.mine[first_miss][0]
            for i in range(cut, len(results)):
                results[i] = False
        return results

    # ------------------------------------------------------------------ whole-prefetch restore
    def start_restore(self, keys: List[str], host_indices, payloads: List[str]) -> RestoreReads:
        """Start the reads of a whole prefetch, every payload of every page at once, so the device
        queue stays deep instead of draining at each of upstream's 128-page batches (``prefetch``'s
        ``page_transfer_around``). The store bounds how many are in flight. If starting one payload
        raises, the reads already started are finished before the error goes up: they read into
        upstream's host pages, which the miss that follows hands back to the pool."""
        started = RestoreReads([])
        try:
            for p in payloads:
                started.reads.append(self._start_get(p, keys, host_indices))
        except BaseException:
            with contextlib.suppress(Exception):  # the error going up is this one
                self.finish_restore(started)
            raise
        return started

    def finish_restore(self, reads: RestoreReads) -> int:
        """Wait for a started restore; the prefix (in pages) that every payload of it restored, as
        this rank sees it: other ranks' pages count as present (the completion MIN answers for them),
        and a page counts only with every payload of it (a KV page without its indexer-K is a miss).
        Every payload is finished even past a miss or an error (the first error is raised after the
        last one): no read outlives the restore and writes host pages the pool has handed on."""
        done, error = None, None
        for read in reads.reads:
            try:
                got = self._finish_get(read)
            except BaseException as e:  # noqa: BLE001  (re-raised below, after the other payloads)
                error = error or e
                got = [False] * read.n_keys
            prefix = next((i for i, ok in enumerate(got) if not ok), len(got))
            done = prefix if done is None else min(done, prefix)
        if error is not None:
            raise error
        return done or 0

    # ------------------------------------------------------------------ existence
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return self._exists_prefix([KV_PAYLOAD], keys)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        payloads = [KV_PAYLOAD]
        for t in pool_transfers or []:
            if t.hit_policy != PoolHitPolicy.ALL_PAGES:
                # Refused at attach for the pools we know; one registered later is a miss, not an
                # exception on upstream's prefetch thread.
                self.unsupported_queries += 1
                self._log.warning("unsupported_policy", "sglang-cp L3: pool %s asks for hit policy %s; only "
                                  "full-prefix pools are stored, so this query is a miss", t.name, t.hit_policy)
                if self.sharded:
                    self._fold_into_query(len(keys), [0] * self.shard_size)
                return PoolTransferResult(kv_hit_pages=0, extra_pool_hit_pages={})
            payloads.append(pool_key(t.name))
        hit = self._exists_prefix(payloads, keys)
        return PoolTransferResult(kv_hit_pages=hit,
                                  extra_pool_hit_pages={pool_key(t.name): hit for t in pool_transfers or []})

    def _exists_prefix(self, payloads: list[str], page_hashes: List[str]) -> int:
        if not page_hashes:
            return 0
        if not self.sharded:
            return self.store.exists_prefix_multi(payloads, page_hashes,  # str tails: the store encodes them
                                                  key_prefix=self.keys.prefix(self._owner_key_rank()))
        # Under sharding which rank holds page i depends on the chain's rotation phase b (owner of
        # page i = (b + i) % N), which only the allocator that wrote it knew. One store query answers
        # every phase: page i falls in class i % N (the store stops once every class has missed);
        # each phase's answer is how long a prefix this rank's own stripe covers. The prefetch hooks
        # reduce that vector with upstream's MIN and pick the phase; upstream gets the best length.
        held = self.store.exists_each(payloads, page_hashes, classes=self.shard_size,
                                      key_prefix=self.keys.prefix(self.shard_rank))
        vector = held_prefix_per_phase(held, self.shard_rank, self.shard_size)
        self._fold_into_query(len(page_hashes), vector)
        return max(vector)

    def _fold_into_query(self, n_pages: int, vector: list[int]) -> None:
        """Give the per-phase answer of one hit-query call to the plan of the query open on this
        thread (upstream's base controller asks in 128-page batches, the hybrid one at once)."""
        q = self.open_query
        if q is None or q.thread != threading.get_ident():
            return  # not inside a prefetch's hit query (a direct call): nothing to agree on
        q.plan.add_query_batch(q.queried_pages, n_pages, vector)
        q.queried_pages += n_pages

    # ------------------------------------------------------------------ v2 (sidecars)
    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        return {pool_key(t.name): self._set(pool_key(t.name), t.keys or [], t.host_indices) for t in transfers}

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        return {pool_key(t.name): self._get(pool_key(t.name), t.keys or [], t.host_indices) for t in transfers}

    # ------------------------------------------------------------------ legacy (non-v1) API
    # Refused. Upstream calls get/set/batch_get/batch_set only on its generic page path (a dynamic
    # backend without interface_v1): whole logical pages by key, copies of host pages, no CP stripes,
    # no sidecar payloads. Served here it read into a copy of a non-contiguous target and reported a
    # hit, and under sharding it would store every rank's whole pages. __init__ refuses a config that
    # would take that path; a direct call fails loud instead of moving the wrong bytes.
    def exists(self, key: str) -> bool:
        return self._exists_prefix([KV_PAYLOAD], [key]) == 1

    def get(self, key, target_location=None, target_sizes=None):
        raise _legacy_api("get")

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        raise _legacy_api("batch_get")

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        raise _legacy_api("set")

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        raise _legacy_api("batch_set")

    def clear(self) -> None:
        if self.store is not None:
            self.store.clear()

    def get_stats(self):
        # Our own metrics go through sglang_cp.metrics, labelled by cp/tp rank; what we return is the empty
        # StorageMetrics upstream would make itself, kept so its prefetch outcomes reach /metrics too.
        return self.prefetch_outcomes.for_upstream()

    def l3_stats(self) -> Optional[dict]:
        if self.store is None:
            return None
        stats = self.store.stats()
        outcomes = self.prefetch_outcomes.latest()
        if outcomes is not None:
            stats["prefetch_outcomes"] = outcomes
        return stats

    def close(self) -> None:
        RESTORE.detach(self)
        if self.switch_interval is not None:
            self.switch_interval.restore()
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None
        if self.store is not None:
            self.store.close()
            self.store = None


_collector = None  # prometheus metrics are process-global: one collector per process


def _start_metrics(sc: HiCacheStorageConfig, cp_rank: int, stats_fn):
    """Publish L3 metrics when the server runs with --enable-metrics."""
    global _collector
    try:
        from sglang.srt.runtime_context import get_server_args

        enabled = bool(getattr(get_server_args(), "enable_metrics", False))
    except Exception:  # no published server args (tools, tests): no metrics
        enabled = False
    if not enabled:
        return None
    from sglang_cp.metrics import CpL3MetricsCollector, MetricsPublisher

    if _collector is None:
        _collector = CpL3MetricsCollector(
            {"cp_rank": str(cp_rank), "tp_rank": str(sc.tp_rank), "pp_rank": str(sc.pp_rank)})
    return MetricsPublisher(_collector, stats_fn)


def _legacy_api(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"sglang-cp L3 backend: {name}() is upstream's legacy page API, which this backend does not serve; "
        "pages move through batch_get_v1/batch_set_v1 and the v2 pool transfers (interface_v1: 1, which "
        "--enable-cp-l3 selects)")


def pool_key(name) -> str:
    return name.value if isinstance(name, PoolName) else str(name)
