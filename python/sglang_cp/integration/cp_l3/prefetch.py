"""The restore path: every hook between upstream's prefetch of a request's prefix from storage and
the radix insert of what came back. Active only while our backend is attached (``RESTORE.attached``);
otherwise every hook falls through to upstream unchanged.

Upstream's calls on one prefetch, in order, and what each hook adds (``_CC`` = ``managers/
cache_controller.py::HiCacheController``, ``_HC`` = ``mem_cache/hybrid_cache/
hybrid_cache_controller.py::HybridCacheController``, ``_UTC`` = ``mem_cache/unified_cache/
unified_tree_core.py::UnifiedTreeCore``):

scheduler thread
 1. ``_UTC.prefetch_anchor_info(anchor)`` (AROUND): under KV sharding a chain's pages rotate over the
    ranks (owner of position-page P is ``(b + P) % N``, ``b`` the chain's ``rotation_base``). When the
    anchor already has a base, the prefetched pages must continue it: we note the phase its
    continuation starts at (``AnchorNote``; the replicated tree makes it identical on every rank).
 2. ``PrefetchOperation.__init__`` of either controller (AFTER): the ``PrefetchPlan`` is created with
    the operation, before upstream queues it, taking the anchor note when the operation continues
    that anchor. ``operation.cp_l3_plan`` is its one reference.
prefetch thread
 3. ``_CC/_HC._storage_hit_query`` (AROUND): opens the query on our backend, so each rank's
    ``batch_exists`` answers, per candidate phase, how long a prefix its own stripe holds
    (``plan.phase_vector``).
 4. ``_CC/_HC._sync_prefetch_hit_query`` (AROUND) + ``_CC._all_reduce`` (AROUND): that vector rides the
    hit-count MIN upstream already runs once per prefetch (appended to its tensor: one collective,
    same count, every rank). Every rank then picks the same phase and length (``plan.agree``): the
    durable prefix is agreed once, up front.
scheduler thread
 5. ``_CC/_HC.alloc_prefetch_host_buffers`` (AROUND): the host bounce is allocated with the agreed
    phase as ``start_owner``, so every page lands on the rank that persisted it; no agreed phase or
    no owner-classed room: nothing (a miss), never a plain allocation (seed 000: that fallback loaded
    KV into the wrong owner's slots). With ``--cp-hicache-placement-assert`` every rank's placement
    is compared (``_CC/_HC.attach_storage_backend`` builds the assert's own groups).
I/O thread
 6. ``_CC._page_transfer`` (AROUND; the hybrid controller's runs it through ``super()``): upstream
    reads 128 pages at a time, one payload after another, and reduces every batch's count with a MIN
    on its completion thread. We start every read of the prefetch at once (all pages, the KV and the
    KV-derived payloads such as the DSA indexer-K: one deep device queue), wait for them, and hand
    upstream ONE completion count: one MIN per prefetch instead of one per batch. A rank whose read
    failed reports a shorter prefix and the MIN makes it a miss on every rank (never a page served on
    one rank and not on another). Every rank emits exactly one count whatever its reads did, so the
    number of collectives never depends on rank-local timing.
scheduler thread
 7. ``_UTC.insert_host`` (AROUND): the prefetched nodes get the chain's rotation base, read from where
    the pages actually are (owner of the first host page, position of the anchor's end), so a later
    extension continues the rotation. If the span's base disagrees with the anchor's (cannot happen with
    step 1's forced phase) or with any node upstream's walk would match below the anchor (a path: a
    request that shares the prefix computed it under its own base while this prefetch was in flight), the
    insert is dropped through upstream's own ``host_insert_dropped`` path: a miss, never a mixed chain.

Why the tree core and the controller, not ``UnifiedRadixCache``: importing that module at plugin load
pulls in the reasoning-parser registry and would change the order of upstream's ``--reasoning-parser``
choices (flags-off neutrality). Why the Python ``UnifiedTreeCore`` and not upstream's default Rust core:
the tree-core steps (1, 7) act only under KV sharding, and upstream's sharding step selects the Python core
and refuses any other (``arg_groups/kv_shard_hook.py``; pinned by ``test_l3_backend_select.py``).

Seed items: "MIN-vector agreement riding existing collectives", "load that preserves the owner pattern (no
silent plain-alloc fallback)", "a page is durable only when every owner rank acked it", "reload on miss
with the partial-prefix slice", "placement-digest debug assert".
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Optional

import torch

from sglang_cp.integration.cp_l3.plan import (
    RESTORE,
    AnchorNote,
    PrefetchPlan,
    QueryRide,
    continuation_phase,
    rotation_base,
)
from sglang_cp.integration.hookspec import HookSpec
from sglang_cp.l3.ratelog import RateLimitedLog

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

_CC = "sglang.srt.managers.cache_controller.HiCacheController"
_HC = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
_UTC = "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore"
_CC_OP = "sglang.srt.managers.cache_controller.PrefetchOperation"
_HC_OP = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.PrefetchOperation"
PLAN_ATTR = "cp_l3_plan"




def _ours(controller):
    """Our backend when it is the controller's attached and open backend, else None."""
    backend = getattr(controller, "storage_backend", None)
    if backend is not None and backend is RESTORE.backend and backend.keys is not None:
        return backend
    return None


def plan_of(operation) -> Optional[PrefetchPlan]:
    return getattr(operation, PLAN_ATTR, None)


# ---------------------------------------------------------------- 1-2: the plan, with the operation
def prefetch_anchor_info_around(original, self, node_id):
    if RESTORE.shard_size > 1:
        node = self.node_by_id(node_id)
        phase = None if node is self.root_node else self.rotation_phase_of(node_id)
        pages = len(node.key) // self.page_size if node.key is not None else 0
        RESTORE.anchors.write(AnchorNote(
            last_hash=self.get_last_hash_value(node_id),
            phase=continuation_phase(phase, pages, RESTORE.shard_size)))
    return original(self, node_id)


def prefetch_operation_init_after(result, operation, *args, **kwargs):
    if not RESTORE.attached or plan_of(operation) is not None:
        return None
    n = max(RESTORE.shard_size, 1)
    plan = PrefetchPlan(request_id=str(getattr(operation, "request_id", "")), shard_size=n,
                        forced_phase=RESTORE.anchors.take(operation.last_hash) if n > 1 else None)
    plan.stamp("created")
    setattr(operation, PLAN_ATTR, plan)
    return None


# ---------------------------------------------------------------- 3-4: one agreement, up front
def storage_hit_query_around(original, self, operation):
    backend, plan = _ours(self), plan_of(operation)
    if backend is None or plan is None or not backend.sharded:
        return original(self, operation)
    from sglang_cp.integration.cp_l3.backend import OpenQuery

    plan.phase_vector = None  # a query answers afresh (a failed one leaves zeros: a miss)
    backend.open_query = OpenQuery(thread=threading.get_ident(), plan=plan)
    try:
        return original(self, operation)
    finally:
        backend.open_query = None
        plan.stamp("queried")


def sync_prefetch_hit_query_around(original, self, operation, storage_hit_count):
    backend, plan = _ours(self), plan_of(operation)
    if backend is None or plan is None or not backend.sharded:
        return original(self, operation, storage_hit_count)
    # Same shape on every rank, always (a rank whose query failed or was skipped sends zeros).
    ride = QueryRide(groups=self.prefetch_hits_sync_groups,
                     extra=plan.ride_vector() if storage_hit_count > 0 else [0] * plan.shard_size)
    backend.query_ride = ride
    try:
        upstream = original(self, operation, storage_hit_count)
    finally:
        backend.query_ride = None
    if ride.reduced is None:
        # Upstream ran no MIN over its hit-query groups (none configured: a single rank): the local
        # vector is the agreement.
        ride.reduced = ride.extra
    pages = plan.agree(ride.reduced)
    plan.stamp("agreed")
    return min(upstream, pages * self.page_size)


def all_reduce_around(original, self, tensor, op, groups):
    backend = _ours(self)
    ride = getattr(backend, "query_ride", None) if backend is not None else None
    if ride is None or ride.reduced is not None or groups is not ride.groups \
            or op != torch.distributed.ReduceOp.MIN:
        return original(self, tensor, op, groups)
    if tensor.device.type != "cpu" or tensor.requires_grad or not tensor.is_contiguous():
        flat = tensor.reshape(-1)
        packed = torch.cat([flat, torch.tensor(ride.extra, dtype=flat.dtype)])
        original(self, packed, op, groups)
        flat.copy_(packed[: flat.numel()])
        ride.reduced = packed[flat.numel():].tolist()
        return None
    # Upstream's CPU count (gloo), through a numpy view of its memory: a freed torch view (reshape, a
    # slice) releases the GIL, which beside a busy scheduler thread costs up to 5 ms each time.
    mine = tensor.numpy().reshape(-1)
    n = mine.size
    packed = torch.tensor(mine.tolist() + list(ride.extra), dtype=tensor.dtype)
    original(self, packed, op, groups)
    reduced = packed.tolist()
    mine[:] = reduced[:n]
    ride.reduced = reduced[n:]
    return None


# ---------------------------------------------------------------- 5: owner-preserving allocation
def alloc_prefetch_host_buffers_around(original, self, operation, need_size):
    backend, plan = _ours(self), plan_of(operation)
    if backend is None or plan is None or not backend.sharded:
        return original(self, operation, need_size)
    start = plan.start_owner
    if start is None:
        indices = None  # no agreed owner pattern: a miss, never a plain allocation
    else:
        indices = self.mem_pool_host.alloc(need_size, start_owner=start)
    plan.stamp("allocated")
    groups = backend.placement_assert_groups
    if groups is not None:
        assert_placement_agrees(backend, operation, start, indices, groups)
    return indices


class PlacementMismatch(RuntimeError):
    pass


def placement_digest(backend, operation, start, indices) -> int:
    h = hashlib.sha256()
    h.update(repr((list(getattr(operation, "hash_value", None) or []), start)).encode())
    if indices is not None:
        starts = indices.reshape(-1)[:: backend.mem_pool_host.page_size].to(torch.int64)
        h.update(backend.placement.owner_of(starts).numpy().tobytes())
    else:
        h.update(b"no-allocation")
    return int.from_bytes(h.digest()[:7], "little")  # fits a gloo int64 MIN/MAX


def assert_placement_agrees(backend, operation, start, indices, groups) -> None:
    d = placement_digest(backend, operation, start, indices)
    t = torch.tensor([d, -d], dtype=torch.int64)
    for g in groups:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=g)
    lo, hi = int(t[0]), -int(t[1])
    if lo != hi:
        raise PlacementMismatch(
            f"CP placement diverged across ranks for prefetch {getattr(operation, 'request_id', '?')}: "
            f"digest min {lo:#x} != max {hi:#x} (this rank {d:#x}, phase {start}). Ranks would load "
            f"KV into different owners' slots; stopping (--cp-hicache-placement-assert).")


_warned = {"placement": False}


def attach_storage_backend_after(result, self, *args, **kwargs):
    backend = _ours(self)
    if backend is None:
        return result
    try:
        from sglang.srt.runtime_context import get_server_args

        on = bool(getattr(get_server_args(), "cp_hicache_placement_assert", False))
    except Exception:
        on = False
    if on and backend.placement_assert_groups is None:
        if not _warned["placement"]:
            _warned["placement"] = True
            logger.warning(
                "--cp-hicache-placement-assert is on: every L3 prefetch allocation runs a "
                "digest MIN/MAX collective across the CP group. Debug only; turn it off in production.")
        # The scheduler thread allocates while the prefetch thread owns upstream's groups: the assert
        # needs its own. All ranks attach in lockstep, so they build them together here.
        backend.placement_assert_groups = self._create_sync_groups()
    return result


# ---------------------------------------------------------------- 6: the whole prefetch's reads, one count
def page_transfer_around(original, self, operation):
    backend, plan = _ours(self), plan_of(operation)
    if backend is None or plan is None:
        return original(self, operation)
    from sglang.srt.managers.cache_controller import PrefetchAck
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from sglang_cp.integration.cp_l3.backend import KV_PAYLOAD, pool_key

    payloads = [KV_PAYLOAD] + [
        pool_key(t.name) for t in getattr(operation, "pool_transfers", None) or []
        if t.indices_from_pool == PoolName.KV]
    keys = list(operation.hash_value)
    pages = 0
    plan.stamp("read_started")
    if keys and not operation.is_terminated():
        try:
            host = operation.host_indices[: len(keys) * self.page_size]
            plan.reads = backend.start_restore(keys, host, payloads)
            pages = backend.finish_restore(plan.reads)
        except Exception:  # a fault on the data path is a miss on this rank, and so on every rank
            logger.exception("sglang-cp L3: restore of prefetch %s failed; it is a miss", plan.request_id)
            pages = 0
        finally:
            plan.reads = None
    plan.read_pages = pages
    plan.stamp("read_done")
    # Exactly one completion count per prefetch on every rank: the completion thread MIN-reduces it.
    self.prefetch_sync_queue.put(PrefetchAck(rid=operation.request_id, completed_tokens=pages * self.page_size,
                                             operation=operation))
    return pages


# ---------------------------------------------------------------- 7: the rotation of prefetched nodes
def _tokens_to_end_of(tree_core, node) -> int:
    n = 0
    while node is not None and node is not tree_core.root_node:
        n += len(node.key) if node.key is not None else 0
        node = node.parent
    return n


def span_rotation_base(host_value: torch.Tensor, start_page: int, page_size: int, shard_size: int):
    """The rotation base of a host span from where its pages are (owner of logical host page h is
    ``h % N``), or None when they do not rotate cyclically (then no base can describe them)."""
    firsts = host_value.reshape(-1)[::page_size].to(torch.int64)
    owners = (firsts // page_size) % shard_size
    expected = (owners[0] + torch.arange(owners.numel())) % shard_size
    if not torch.equal(owners, expected):
        return None
    return rotation_base(int(owners[0]), start_page, shard_size)


def chain_bases_below(tree_core, anchor, key) -> list:
    """The rotation bases (None where unset) of the anchor (unless it is the root) and of every node that
    upstream's ``insert_host`` walk from it would match with ``key``: a read-only mirror of that walk, as
    upstream's ``_rotation_conflict`` mirrors its insert's. The walk fills a matched node's missing host
    copy with the span's pages and hangs the rest under the deepest match, so the span must continue the
    rotation of every node it meets there, not only the anchor's: nodes a request computed while this
    prefetch was in flight sit below the anchor by then, allocated under their own base."""
    bases = [] if anchor is tree_core.root_node else [anchor.rotation_base]
    node = anchor
    while len(key) > 0:
        child = node.children.get(key.child_key(tree_core.page_size))
        if child is None:
            break
        matched = child.key.match(key, page_size=tree_core.page_size)
        bases.append(child.rotation_base)
        node, key = child, key[matched:]
        if matched < len(child.key):
            break  # the walk splits here; the fragment keeps this node's base
    return bases


def insert_host_around(original, self, node_id, key, host_value, hash_value):
    n = RESTORE.shard_size
    if n <= 1 or host_value is None or not host_value.numel():
        return original(self, node_id, key, host_value, hash_value)
    from sglang.srt.mem_cache.base_prefix_cache import InsertResult

    anchor = self.node_by_id(node_id)
    start_page = _tokens_to_end_of(self, anchor) // self.page_size
    base = span_rotation_base(host_value, start_page, self.page_size, n)
    met = chain_bases_below(self, anchor, key)
    if base is None or any(b is not None and b != base for b in met):
        _log.warning("rotation_conflict", "sglang-cp L3: a prefetched span does not continue the rotation of "
                     "the chain it lands on (chain bases %s, span base %s); dropped, its tokens are recomputed",
                     sorted({b for b in met if b is not None}), base)
        return InsertResult(prefix_len=0, total_len=len(key), host_insert_dropped=True)
    result = original(self, node_id, key, host_value, hash_value)
    if getattr(result, "inserted_host_node", None) is None:
        return result
    node = self.node_by_id(result.inserted_host_node)
    while node is not None and node is not anchor and node is not self.root_node:
        if node.rotation_base is None:
            node.rotation_base = base
        node = node.parent
    return result


_SEED_AGREE = "MIN-vector agreement riding existing collectives"
_SEED_OWNER = "load that preserves the owner pattern (no silent plain-alloc fallback)"
HOOKS = (
    HookSpec(f"{_UTC}.prefetch_anchor_info", "around", prefetch_anchor_info_around, seed=_SEED_OWNER,
             why="prefetch_from_storage asks the tree core about the anchor right before submitting"),
    HookSpec(f"{_CC_OP}.__init__", "after", prefetch_operation_init_after, seed=_SEED_AGREE,
             why="the plan is created with the operation, before upstream queues it"),
    HookSpec(f"{_HC_OP}.__init__", "after", prefetch_operation_init_after, seed=_SEED_AGREE,
             why="the hybrid controller's own operation class (not a subclass of the base one)"),
    HookSpec(f"{_CC}._storage_hit_query", "around", storage_hit_query_around, seed=_SEED_AGREE,
             why="each rank's per-phase answer goes into the plan of the query it answers"),
    HookSpec(f"{_HC}._storage_hit_query", "around", storage_hit_query_around, seed=_SEED_AGREE,
             why="the hybrid controller overrides the hit query"),
    HookSpec(f"{_CC}._sync_prefetch_hit_query", "around", sync_prefetch_hit_query_around,
             seed=_SEED_AGREE, why="upstream's one MIN per prefetch op; we extend its tensor"),
    HookSpec(f"{_HC}._sync_prefetch_hit_query", "around", sync_prefetch_hit_query_around,
             seed=_SEED_AGREE, why="the hybrid controller packs pool verdicts into the same MIN"),
    HookSpec(f"{_CC}._all_reduce", "around", all_reduce_around, seed=_SEED_AGREE,
             why="the single place both controllers issue the gloo MIN"),
    HookSpec(f"{_CC}.alloc_prefetch_host_buffers", "around", alloc_prefetch_host_buffers_around,
             seed=_SEED_OWNER, why="upstream allocates the prefetch bounce without an owner phase"),
    HookSpec(f"{_HC}.alloc_prefetch_host_buffers", "around", alloc_prefetch_host_buffers_around,
             seed=_SEED_OWNER, why="the hybrid controller overrides the prefetch allocation"),
    HookSpec(f"{_CC}.attach_storage_backend", "after", attach_storage_backend_after,
             seed="placement-digest debug assert (warn once)",
             why="all ranks attach in lockstep: the one place to build the assert's own groups"),
    HookSpec(f"{_HC}.attach_storage_backend", "after", attach_storage_backend_after,
             seed="placement-digest debug assert (warn once)",
             why="the hybrid controller overrides attach (sidecar registration)"),
    HookSpec(f"{_CC}._page_transfer", "around", page_transfer_around,
             seed="a page is durable only when every owner rank acked it",
             why="upstream reads and reduces 128 pages at a time; one prefetch is one read and one MIN"),
    HookSpec(f"{_UTC}.insert_host", "around", insert_host_around,
             seed="reload on miss with the partial-prefix slice",
             why="creates the prefetched nodes; upstream leaves their rotation base empty"),
)
