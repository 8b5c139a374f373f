"""Upstream symbol: ``sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config`` (AFTER).

Our storage keys must name the *logical* KV cache dtype: fp8_e4m3fn and fp8_e5m2 both store
as uint8 in the host pools, with the same page size, so the host pool alone cannot tell a
page written under one from a page written under the other (a restart with ``load`` under
the other format would read it as a hit: wrong KV). Only the device pools know the logical
dtype (``KVCache.dtype`` vs its ``store_dtype``), and only the controller holds them. When
our backend is the one being configured, this hook records each payload's logical dtype in
the storage config's ``extra_config`` (``cp_l3_kv_dtypes``), which upstream then hands to
our backend (``l3_storage_backend``, keys in ``l3_keys``). Any other backend: untouched.

Seed item: "keys that cannot collide across ranks" (and formats).
"""

from __future__ import annotations

from sglang_cp.args import L3_BACKEND_NAME
from sglang_cp.integration.hookspec import HookSpec

UPSTREAM_SYMBOLS = (
    "sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config",
    "sglang.srt.mem_cache.pool_host.group.HostPoolGroup",
)
DTYPES_KEY = "cp_l3_kv_dtypes"


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


def record_logical_dtypes(result, controller, *args, **kwargs):
    extra = getattr(result, "extra_config", None)
    if isinstance(extra, dict) and extra.get("backend_name") == L3_BACKEND_NAME:
        extra[DTYPES_KEY] = logical_dtypes(controller)
    return None  # keep upstream's config object


HOOKS = (
    HookSpec(
        target="sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config",
        kind="after",
        fn=record_logical_dtypes,
        seed="content hash is L3's key: keys name the logical KV dtype (fp8 formats share a storage dtype)",
        why="the one place upstream builds the storage config with the device pools (logical dtypes) at hand",
    ),
)
