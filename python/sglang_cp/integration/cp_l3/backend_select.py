"""Hook point: resolution step ``handle_kv_cache_sharding`` (``arg_groups/kv_shard_hook.py``),
plus the backend selection helper used by ``args_resolution``.

``--enable-cp-l3`` selects our store as the HiCache storage backend: we declare
``hicache_storage_backend="dynamic"`` and the JSON ``extra_config`` upstream's
``StorageBackendFactory._create_dynamic_backend`` loads (``backend_name``,
``module_path``, ``class_name``, ``interface_v1: 1`` for the zero-copy page path), with
``declare_resolution`` so the operator's raw input stays intact. Users never spell the
dynamic backend.

Upstream refuses every storage backend under ``--enable-kv-cache-sharding`` ("the
storage path reads and writes whole pages per rank, not each rank's own stripe"). Ours
reads and writes exactly each rank's stripe, so around that step we hide *our* backend
from upstream's check and restore it afterwards; any other backend is refused as before.

Seed item: "validate supported CP HiCache backend/layout combinations at server
startup"; lifts "storage backends remain unsupported for CP shared KV".
"""

from __future__ import annotations

import json
import os

from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

from sglang_cp import args as cp_args
from sglang_cp.integration.hookspec import HookSpec

BACKEND_MODULE = "sglang_cp.integration.cp_l3.backend"
BACKEND_CLASS = "CpL3Storage"


def backend_extra_config(server_args) -> str:
    """The storage config we declare: our backend, and upstream's prefetch settings the user gave in
    --hicache-storage-backend-extra-config (validated by ``cp_args.validate``; upstream's controller
    consumes them, the same as for any backend)."""
    f = cp_args.flags_of(server_args)
    cfg = resolving_view(server_args)
    return json.dumps({
        **cp_args.user_prefetch_tuning(cfg),
        "backend_name": cp_args.L3_BACKEND_NAME,
        "module_path": BACKEND_MODULE,
        "class_name": BACKEND_CLASS,
        "interface_v1": 1,
        "cp_l3_config": os.path.abspath(f.cp_l3_config),
        "cp_l3_cold_start": f.cp_l3_cold_start,
        "cp_strategy": getattr(cfg, "cp_strategy", None) if getattr(cfg, "enable_prefill_cp", False) else None,
    }, sort_keys=True)


def select_backend(server_args) -> None:
    """Declare our store as the storage backend when --enable-cp-l3 is on (idempotent)."""
    if not cp_args.flags_of(server_args).enable_cp_l3:
        return
    if _ours_selected(server_args):
        return
    declare_resolution(
        server_args, "sglang_cp.select_l3_backend",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=backend_extra_config(server_args),
    )


def check_no_live_owner(server_args) -> None:
    """Refuse (CpArgsError) an L3 config whose ranks a live process owns: a server started with it
    would fail when its store opens (``l3/format/ownership.py``). For ``sglang-cp check-args`` only: a
    server's own processes hold these locks while it runs."""
    f = cp_args.flags_of(server_args)
    if not (f.enable_cp_l3 and f.cp_l3_config):
        return
    from sglang_cp.l3.format.ownership import probe

    cfg = cp_args.load_config(f.cp_l3_config)
    for directory in [cfg.index_dir] + [cfg.slab_dir(d.path) for d in cfg.disks]:
        held = probe(directory)
        if held:
            rank, holder = held[0]
            ns = f"namespace '{cfg.namespace}'" if cfg.namespace else "no namespace"
            raise cp_args.CpArgsError(
                f"--cp-l3-config {f.cp_l3_config}: L3 rank {rank} of this config ({ns}) is owned by live pid "
                f"{holder.pid} ({holder.owner or 'owner not recorded'}) through '{directory}'; a server started "
                "with it would fail when its store opens. Stop that server, or give this one its own "
                "`namespace` in its L3 TOML")


def _ours_selected(server_args) -> bool:
    """args' test of "our store is the backend", on the values as resolution sees them so far."""
    return cp_args.storage_backend_is_ours(resolving_view(server_args))


def kv_sharding_around(server_args, previous):
    if not (cp_args.flags_of(server_args).enable_cp_l3 and _ours_selected(server_args)):
        return previous(server_args)
    extra = resolving_view(server_args).hicache_storage_backend_extra_config
    declare_resolution(server_args, "sglang_cp.hide_l3_from_kv_shard_check", hicache_storage_backend=None)
    try:
        previous(server_args)
    finally:
        declare_resolution(server_args, "sglang_cp.restore_l3_after_kv_shard_check",
                           hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=extra)


HOOKS = (
    HookSpec(
        target="handle_kv_cache_sharding",
        kind="resolution",
        fn=kv_sharding_around,
        seed="CP HiCache with a storage tier (lifts 'storage backends unsupported for CP shared KV')",
        why="upstream's refusal of storage backends under KV sharding lives in this step",
    ),
)
