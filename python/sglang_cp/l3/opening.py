"""Opening one rank's store: geometry, directories, ownership, index, slabs, staging, then cold start.

Order matters: nothing destructive (slab truncation, cold start) before this rank's locks are held, and
every allocation that can fail (staging, the read path's landing areas) before cold start, so a
failed open never follows a 'clear' that wiped the index. A failure undoes what was opened.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from .format.blob import write_extent
from .config import SLAB_SUBDIR, L3Config
from .format.disk_slab import DiskSlab, FaultInjector
from .errors import L3StartupError
from .format.files import private_dir, private_dirs
from .held import HeldDigests
from .format.index import MAX_RANKS, IndexFull, IndexUnavailable, SharedIndex
from .native.digests import native_digests
from .format.ownership import RankLock
from .payload_slab import PayloadSlab
from .recovery import check_mode, run_cold_start
from .staging import Staging
from .state import StoreState, logger, release_locks

_PAYLOAD_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Geometry:
    """Where this rank's slabs live and how many slots each payload gets (the same count for all)."""
    disk_index: int
    slab_dir: str
    slot_bytes: dict[str, int]
    num_slots: int


def check_args(config, rank, ranks_per_node, payloads, cold_start_mode) -> None:
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


def plan_geometry(config: L3Config, rank: int, ranks_per_node: int, payloads: dict[str, int]) -> Geometry:
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
    return Geometry(disk_i, config.slab_dir(disk.path), slot_bytes, num_slots)


def open_state(config: L3Config, rank: int, ranks_per_node: int, payloads: dict[str, int],
               fault_injector: Optional[FaultInjector], owner: Optional[str]) -> StoreState:
    """Everything up to cold start: on success the caller owns the files (StoreState.release_files)."""
    geo = plan_geometry(config, rank, ranks_per_node, payloads)
    disk_i, slab_dir = geo.disk_index, geo.slab_dir
    disk = config.disks[disk_i]
    private_dir(os.path.join(disk.path, SLAB_SUBDIR), f"disks[{disk_i}].path")  # 0700, ours, not a link
    if slab_dir != os.path.join(disk.path, SLAB_SUBDIR):
        private_dir(slab_dir, f"disks[{disk_i}].path")  # the namespace's own directory
    index_dir = config.index_dir
    private_dirs(index_dir, "index.dir")
    # index.digest_threads > 0: the hit query's digests in C over threads (loaded and checked here,
    # before anything is opened, so an installation without the native library is refused with
    # nothing to undo).
    native = native_digests(config.index.digest_threads)
    # Exclusive ownership of this rank's slabs and index entries before anything destructive (slab
    # truncation, cold start), held until close(): a second opener fails here (l3/format/ownership.py).
    owner = owner or f"L3 rank {rank}"
    if config.namespace:
        owner += f", namespace '{config.namespace}'"
    locks = [RankLock(slab_dir, rank, owner, what=f"disks[{disk_i}].path")]
    try:
        locks.append(RankLock(index_dir, rank, owner, what="index.dir"))
        index = SharedIndex(index_dir, config.index.map_size_bytes, config.index.max_map_size_bytes)
    except BaseException:
        release_locks(locks)
        raise
    pools: dict[str, PayloadSlab] = {}
    try:
        for p, b in payloads.items():
            slab = DiskSlab(os.path.join(slab_dir, f"r{rank}.{p}.s{geo.slot_bytes[p]}.slab"),
                            slot_bytes=geo.slot_bytes[p], num_slots=geo.num_slots, page_bytes=b,
                            fault_injector=fault_injector, disk_index=disk_i, field=f"disks[{disk_i}]")
            pools[p] = PayloadSlab(p, b, rank, slab)
        held = HeldDigests()
        for i, pool in enumerate(pools.values()):
            pool.lru.attach(held, 1 << i)
        if len({pool.tag for pool in pools.values()}) != len(pools):
            raise L3StartupError("payloads: two payload names hash to the same tag; rename one")
        staging = Staging(config.io.max_inflight_pages, {p.extent for p in pools.values()})
    except BaseException:
        for pool in pools.values():
            pool.slab.close()
        index.close()
        release_locks(locks)
        raise
    return StoreState(config, rank, index=index, pools=pools, held=held, staging=staging, slab_dir=slab_dir,
                      locks=locks, native=native)


def recover(st: StoreState, mode: str) -> dict:
    """Cold start: the first step that changes this rank's index entries."""
    try:
        return run_cold_start(mode, st.index, st.rank, st.by_tag, st.config.io.threads)
    except (IndexFull, IndexUnavailable) as e:
        raise L3StartupError(f"index.dir: the LMDB index failed during cold start '{mode}' ({e}); "
                             "check the disk under index.dir, or start with --cp-l3-cold-start clear") from None
