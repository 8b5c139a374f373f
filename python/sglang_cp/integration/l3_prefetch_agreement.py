"""Hook point: upstream's HiCache controller storage paths (``managers/cache_controller.py``
``HiCacheController`` and ``mem_cache/hybrid_cache/hybrid_cache_controller.py``
``HybridCacheController``), active only when our L3 backend is attached.

Targets and why:
- ``HiCacheController._generate_storage_config`` (AFTER): upstream lets only TP rank 0
  write rank-replicated (MLA) KV (``HiCacheStorageConfig.is_storage_writer``). Our store
  is per rank: under sharding each rank must persist its own stripe, and without sharding
  each rank keeps its own replica (no cross-rank reads). We return a config whose
  ``is_storage_writer`` is true on every rank.
- ``HiCacheController._storage_hit_query`` / ``HybridCacheController._storage_hit_query``
  (AROUND): forget the previous query's phase vector before a new one, so a failed or
  cancelled query can never send stale data into the reduce.
- ``HiCacheController._sync_prefetch_hit_query`` / ``HybridCacheController.
  _sync_prefetch_hit_query`` (AROUND) together with ``HiCacheController._all_reduce``
  (AROUND): under ``--enable-kv-cache-sharding`` each rank's backend reports, per
  candidate rotation phase, how long a prefix its own stripe covers. That vector rides
  the very MIN all-reduce upstream already runs per prefetch operation over the
  attention-CP/TP (and PP) gloo groups -- appended to upstream's tensor, one collective,
  same count. Every rank then derives the same (phase, length) from the reduced vector.
  No collective per scheduler tick; an idle tick enters none (prefetch ops are created
  from broadcast requests, identically on every rank).
- ``HiCacheController.alloc_prefetch_host_buffers`` / ``HybridCacheController.
  alloc_prefetch_host_buffers`` (AROUND): allocate the host bounce with the agreed phase
  as ``start_owner``, so every reloaded page lands on the rank that persisted it. If the
  owner-classed allocator cannot give that, the prefetch gets nothing (a miss): never a
  plain allocation that would load bytes into another rank's slots.

- ``HiCacheController.attach_storage_backend`` / ``HybridCacheController.
  attach_storage_backend`` (AFTER): with ``--cp-hicache-placement-assert`` (debug), warn
  once that it costs collectives and build dedicated gloo groups for it (the scheduler
  thread must not share the prefetch thread's groups). Every prefetch allocation then
  MIN/MAX-reduces a digest of (page keys, agreed phase, owner of every allocated page);
  a mismatch is a broken invariant and raises on every rank at the point of violation.

Seed items: "MIN-vector agreement riding existing collectives", "placement-digest debug
assert (warn once)", "load that preserves
the owner pattern (no silent plain-alloc fallback)", "a page is durable only when every
owner rank acked it" (a hit needs every owner's stripe: MIN over ranks).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from sglang_cp.args import L3_BACKEND_NAME
from sglang_cp.integration.hookspec import HookSpec

logger = logging.getLogger(__name__)

_CC = "sglang.srt.managers.cache_controller.HiCacheController"
_HC = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"

_ride = threading.local()


class CpL3StorageConfig(HiCacheStorageConfig):
    """Every rank writes: our store is rank-local (see module docstring)."""

    @property
    def is_storage_writer(self) -> bool:
        return True


def _ours(controller) -> bool:
    """Our backend is attached and open (its keys exist once every host pool registered)."""
    from sglang_cp.integration.l3_storage_backend import CpL3Storage

    backend = getattr(controller, "storage_backend", None)
    return isinstance(backend, CpL3Storage) and backend.keys is not None


def _sharded_backend(controller):
    backend = getattr(controller, "storage_backend", None)
    if _ours(controller) and backend.sharded:
        return backend
    return None


def generate_storage_config_after(result, self, model_name=None, storage_backend_extra_config=None):
    extra = result.extra_config or {}
    if extra.get("backend_name") != L3_BACKEND_NAME:
        return result
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return CpL3StorageConfig(**fields)


def storage_hit_query_around(original, self, operation):
    if _sharded_backend(self) is not None:
        from sglang_cp.integration.l3_storage_backend import clear_phase_vector

        clear_phase_vector()
    return original(self, operation)


def sync_prefetch_hit_query_around(original, self, operation, storage_hit_count):
    backend = _sharded_backend(self)
    if backend is None:
        return original(self, operation, storage_hit_count)
    from sglang_cp.integration.l3_storage_backend import clear_phase_vector, last_phase_vector

    n = backend.shard_size
    vector = last_phase_vector() if storage_hit_count > 0 else None
    clear_phase_vector()
    if vector is None or len(vector) != n:
        vector = [0] * n  # same shape on every rank, always
    _ride.extra = torch.tensor(vector, dtype=torch.int)
    _ride.result = None
    try:
        upstream = original(self, operation, storage_hit_count)
        reduced = _ride.result if _ride.result is not None else _ride.extra.tolist()
    finally:
        _ride.extra = None
        _ride.result = None
    forced = getattr(operation, "_cp_l3_forced_phase", None)  # set from the replicated radix anchor
    if forced is not None:
        best = forced  # the prefetched pages must continue the anchor chain's rotation
    else:
        best = max(range(n), key=lambda b: (reduced[b], -b))  # ties -> lowest phase, on every rank
    pages = reduced[best]
    operation._cp_l3_start_owner = best if pages > 0 else None
    return min(upstream, pages * self.page_size)


def all_reduce_around(original, self, tensor, op, groups):
    extra = getattr(_ride, "extra", None)
    if extra is None or op != torch.distributed.ReduceOp.MIN:
        return original(self, tensor, op, groups)
    _ride.extra = None  # one ride per hit query
    flat = tensor.reshape(-1)
    packed = torch.cat([flat, extra.to(flat.dtype)])
    original(self, packed, op, groups)
    flat.copy_(packed[: flat.numel()])
    _ride.result = packed[flat.numel():].tolist()
    return None


def alloc_prefetch_host_buffers_around(original, self, operation, need_size):
    backend = _sharded_backend(self)
    if backend is None:
        return original(self, operation, need_size)
    start = getattr(operation, "_cp_l3_start_owner", None)
    if start is None:
        indices = None  # no agreed owner pattern: a miss, never a plain allocation
    else:
        indices = self.mem_pool_host.alloc(need_size, start_owner=start)
        if indices is not None:
            from sglang_cp.integration.l3_prefetch_rotation import remember_stamp

            # The radix insert of this span stamps the chain's rotation base from it.
            remember_stamp(indices, start, getattr(operation, "storage_start", 0), self.page_size,
                           backend.shard_size)
    groups = getattr(self, "_cp_l3_assert_groups", None)
    if groups is not None:
        assert_placement_agrees(self, backend, operation, start, indices, groups)
    return indices


class PlacementMismatch(RuntimeError):
    pass


def placement_digest(backend, operation, start, indices) -> int:
    import hashlib

    h = hashlib.sha256()
    h.update(repr((list(getattr(operation, "hash_value", None) or []), start)).encode())
    if indices is not None:
        starts = indices.reshape(-1)[:: backend.mem_pool_host.page_size].to(torch.int64)
        h.update(backend.placement.owner_of(starts).numpy().tobytes())
    else:
        h.update(b"no-allocation")
    return int.from_bytes(h.digest()[:7], "little")  # fits a gloo int64 MIN/MAX


def assert_placement_agrees(controller, backend, operation, start, indices, groups) -> None:
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
    if not _ours(self):
        return result
    try:
        from sglang.srt.runtime_context import get_server_args

        on = bool(getattr(get_server_args(), "cp_hicache_placement_assert", False))
    except Exception:
        on = False
    if on and getattr(self, "_cp_l3_assert_groups", None) is None:
        if not _warned["placement"]:
            _warned["placement"] = True
            logger.warning(
                "--cp-hicache-placement-assert is on: every L3 prefetch allocation runs a "
                "digest MIN/MAX collective across the CP group. Debug only; turn it off in production.")
        self._cp_l3_assert_groups = self._create_sync_groups()
    return result


_SEED_AGREE = "MIN-vector agreement riding existing collectives"
HOOKS = (
    HookSpec(f"{_CC}._generate_storage_config", "after", generate_storage_config_after,
             seed="CP HiCache owner pages: every owner rank persists its own stripe",
             why="upstream makes only TP rank 0 a writer of rank-replicated KV"),
    HookSpec(f"{_CC}._storage_hit_query", "around", storage_hit_query_around, seed=_SEED_AGREE,
             why="a new hit query must not reuse the previous query's phase vector"),
    HookSpec(f"{_HC}._storage_hit_query", "around", storage_hit_query_around, seed=_SEED_AGREE,
             why="the hybrid controller overrides the hit query"),
    HookSpec(f"{_CC}._sync_prefetch_hit_query", "around", sync_prefetch_hit_query_around,
             seed=_SEED_AGREE, why="upstream's one MIN per prefetch op; we extend its tensor"),
    HookSpec(f"{_HC}._sync_prefetch_hit_query", "around", sync_prefetch_hit_query_around,
             seed=_SEED_AGREE, why="the hybrid controller packs pool verdicts into the same MIN"),
    HookSpec(f"{_CC}._all_reduce", "around", all_reduce_around, seed=_SEED_AGREE,
             why="the single place both controllers issue the gloo MIN"),
    HookSpec(f"{_CC}.alloc_prefetch_host_buffers", "around", alloc_prefetch_host_buffers_around,
             seed="load that preserves the owner pattern (no silent plain-alloc fallback)",
             why="upstream allocates the prefetch bounce without an owner phase"),
    HookSpec(f"{_CC}.attach_storage_backend", "after", attach_storage_backend_after,
             seed="placement-digest debug assert (warn once)",
             why="all ranks attach in lockstep: the one place to build the assert's own groups"),
    HookSpec(f"{_HC}.attach_storage_backend", "after", attach_storage_backend_after,
             seed="placement-digest debug assert (warn once)",
             why="the hybrid controller overrides attach (sidecar registration)"),
    HookSpec(f"{_HC}.alloc_prefetch_host_buffers", "around", alloc_prefetch_host_buffers_around,
             seed="load that preserves the owner pattern (no silent plain-alloc fallback)",
             why="the hybrid controller overrides the prefetch allocation"),
)
