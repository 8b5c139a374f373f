"""Upstream symbol: ``sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config``
(AFTER; the hybrid controller inherits it). The one place upstream builds the storage config, with the
device pools at hand. When our backend is the one configured, this hook does two things, in this order:

1. **Logical dtypes in the config.** fp8_e4m3fn and fp8_e5m2 both store as uint8 in the host pools,
   with the same page size, so a host pool alone cannot tell a page written under one format from a
   page written under the other (a restart under the other format would read it as a hit: wrong KV).
   Only the device pools know the logical dtype (``KVCache.dtype`` vs its ``store_dtype``), so each
   payload's logical dtype is recorded in ``extra_config[DTYPES_KEY]``; our backend puts it in its keys
   (``keys.py``) and refuses a uint8 pool without it. A sidecar registered after the attach (an EAGLE
   draft) gets its entry from a second hook, on
   ``sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.register_host_pool_entry``
   (BEFORE), where the entry still carries its device pool; the backend then reopens its store with
   that payload (``backend.register_mem_host_pool_v2``).
2. **Every rank writes.** Upstream lets only TP rank 0 write rank-replicated (MLA) KV
   (``HiCacheStorageConfig.is_storage_writer``). Our store is per rank: under KV sharding each rank
   persists its own stripe, and without sharding each rank keeps its own replica (no cross-rank
   reads). The hook returns a :class:`CpL3StorageConfig` whose ``is_storage_writer`` is always true.

Any other backend: the config is untouched. Seed items: "CP HiCache owner pages: every owner rank
persists its own stripe"; "keys that cannot collide across ranks" (and formats).
"""

from __future__ import annotations

import dataclasses

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from sglang_cp.args import L3_BACKEND_NAME
from sglang_cp.integration.hookspec import HookSpec

UPSTREAM_SYMBOLS = (
    "sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config",
    "sglang.srt.mem_cache.pool_host.group.HostPoolGroup",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.register_host_pool_entry",
)
DTYPES_KEY = "cp_l3_kv_dtypes"


class CpL3StorageConfig(HiCacheStorageConfig):
    """Every rank writes: our store is rank-local (see the module docstring)."""

    @property
    def is_storage_writer(self) -> bool:
        return True


def _pool_name(name) -> str:
    return getattr(name, "value", None) or str(name)


def logical_dtypes(controller) -> dict[str, str]:
    """{payload name: logical dtype} of the controller's device pools (target KV and sidecars)."""
    out: dict[str, str] = {}
    for entry in getattr(controller.mem_pool_host, "entries", None) or ():
        dtype = getattr(entry.device_pool, "dtype", None)
        if dtype is not None:
            out[_pool_name(entry.name)] = str(dtype)
    dtype = getattr(controller.mem_pool_device, "dtype", None)
    if dtype is not None:
        out["kv"] = str(dtype)
    return out


def generate_storage_config_after(result, controller, *args, **kwargs):
    extra = getattr(result, "extra_config", None)
    if not isinstance(extra, dict) or extra.get("backend_name") != L3_BACKEND_NAME:
        return None  # not ours: upstream's config object as it is
    extra[DTYPES_KEY] = logical_dtypes(controller)
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return CpL3StorageConfig(**fields)


def register_host_pool_entry_before(self, entry, *args, **kwargs):
    """A sidecar pool registered after the attach (an EAGLE draft: ``register_sidecar_pool``) reaches our
    backend through ``register_mem_host_pool_v2`` alone, which carries no device pool: its logical dtype
    is recorded here first, where the entry still has it, as the storage config's hook does for the rest."""
    sc = getattr(getattr(self, "storage_backend", None), "storage_config", None)
    extra = getattr(sc, "extra_config", None)
    if not isinstance(extra, dict) or extra.get("backend_name") != L3_BACKEND_NAME:
        return  # not ours
    dtype = getattr(getattr(entry, "device_pool", None), "dtype", None)
    if dtype is not None:
        extra.setdefault(DTYPES_KEY, {})[_pool_name(entry.name)] = str(dtype)


HOOKS = (
    HookSpec(
        target=("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
                ".register_host_pool_entry"),
        kind="before",
        fn=register_host_pool_entry_before,
        seed="keys name the logical KV dtype (fp8 formats share a storage dtype)",
        why="the one place a sidecar registered after the attach still carries its device pool",
    ),
    HookSpec(
        target="sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config",
        kind="after",
        fn=generate_storage_config_after,
        seed="CP HiCache owner pages: every owner rank persists its own stripe; keys name the logical "
             "KV dtype (fp8 formats share a storage dtype)",
        why="the one place upstream builds the storage config, with the device pools (logical dtypes) at hand",
    ),
)
