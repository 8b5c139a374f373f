"""Which L3 rank a scheduler process is: one per process that owns KV, numbered per node.

Upstream hands a storage backend a ``HiCacheStorageConfig`` whose ``tp_rank``/``tp_size`` are
the *attention*-TP values under ``--enable-dp-attention`` (``managers/cache_controller.py``,
``_generate_storage_config``), with the attention-DP group in ``dp_rank``. ``--dp N`` without
attention DP runs N replicas, each its own world with TP ranks from 0, and the storage config
does not carry the replica at all. ``tp_rank + tp_size * pp_rank`` therefore named several
KV owners the same L3 rank (``--tp 8 --dp 8 --enable-dp-attention``: all eight were rank 0).

A KV-owning process is exactly one (replica, PP rank, full TP rank) of one server, where the
full TP rank is upstream's ``(attn_dp_rank * attn_cp_size + attn_cp_rank) * attn_tp_size +
attn_tp_rank`` (``runtime_context.derive_attention_ranks``); DCP ranks live inside attention TP.
The L3 rank is that process's index among the ones launched on *this node* (upstream's
``entrypoints/engine._calculate_rank_ranges`` split of PP and TP ranks over ``--nnodes``), and
the disk capacity is split over that node-local count, not the world size. Servers sharing one
node's directories are kept apart by the config's ``namespace``; a process that still collides
is refused by the store's per-rank lock (``l3/format/ownership.py``).

Helper module (no hook): upstream symbols it reads are ``runtime_context.get_parallel`` and
``layers.dp_attention.is_dp_attention_enabled`` (the flag upstream's controller branched on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_cp.l3.errors import L3InvariantError

UPSTREAM_SYMBOLS = (
    "sglang.srt.runtime_context.get_parallel",
    "sglang.srt.layers.dp_attention.is_dp_attention_enabled",
    "sglang.srt.entrypoints.engine._calculate_rank_ranges",
)


@dataclass(frozen=True)
class Topology:
    """The widths the storage config does not carry, as this process's runtime published them."""

    attn_dp_enabled: bool = False
    attn_dp_size: int = 1
    tp_size: Optional[int] = None  # full TP width of one replica; None: the storage config's tp_size
    pp_size: Optional[int] = None
    replicas: int = 1  # --dp replicas (separate worlds); 1 under attention DP
    replica: int = 0
    nnodes: int = 1
    node_rank: int = 0
    tp_rank: Optional[int] = None  # full TP rank as published (cross-check), None if unknown


@dataclass(frozen=True)
class L3Identity:
    replica: int
    pp_rank: int
    tp_rank: int  # full TP rank within the replica
    attn_dp_rank: int
    attn_cp_rank: int
    attn_tp_rank: int
    node_rank: int
    local_rank: int  # the L3 rank: index among this node's KV-owning processes of this server
    local_count: int

    def label(self) -> str:
        return (f"L3 rank {self.local_rank} of {self.local_count} on node {self.node_rank}: replica {self.replica}, "
                f"PP {self.pp_rank}, TP {self.tp_rank} (attention DP {self.attn_dp_rank}, CP {self.attn_cp_rank}, "
                f"TP {self.attn_tp_rank})")


def node_rank_ranges(tp_size: int, pp_size: int, nnodes: int, node_rank: int) -> tuple[range, range]:
    """(PP ranks, TP ranks) launched on ``node_rank``: upstream's ``_calculate_rank_ranges``."""
    pp_per_node = max(pp_size // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp_size, 1)
    pp_range = range(pp_per_node * (node_rank // nnodes_per_pp_rank),
                     pp_per_node * (node_rank // nnodes_per_pp_rank + 1))
    tp_per_node = tp_size // nnodes_per_pp_rank
    tp_range = range(tp_per_node * (node_rank % nnodes_per_pp_rank),
                     tp_per_node * (node_rank % nnodes_per_pp_rank + 1))
    return pp_range, tp_range


def derive_identity(sc, topo: Topology) -> L3Identity:
    """The L3 identity of the process whose storage config is ``sc`` (upstream's ``HiCacheStorageConfig``)."""
    cp_size, cp_rank = max(1, int(sc.attn_cp_size)), int(sc.attn_cp_rank)
    if topo.attn_dp_enabled:
        attn_tp_size, attn_tp_rank, attn_dp_rank = int(sc.tp_size), int(sc.tp_rank), int(sc.dp_rank)
        full_rank = (attn_dp_rank * cp_size + cp_rank) * attn_tp_size + attn_tp_rank
        full_size = topo.tp_size if topo.tp_size is not None else topo.attn_dp_size * cp_size * attn_tp_size
    else:
        full_rank, full_size, attn_dp_rank = int(sc.tp_rank), int(sc.tp_size), 0
        if topo.tp_size is not None and topo.tp_size != full_size:
            raise L3InvariantError(f"sglang-cp L3 identity: storage config tp_size {full_size} differs from the "
                                   f"published TP width {topo.tp_size} without attention DP")
        attn_tp_size = max(1, full_size // cp_size)
        attn_tp_rank = full_rank % attn_tp_size
    if topo.attn_dp_size * cp_size * attn_tp_size != full_size:
        raise L3InvariantError(
            f"sglang-cp L3 identity: attention DP {topo.attn_dp_size} x CP {cp_size} x TP {attn_tp_size} "
            f"does not tile TP {full_size}")
    if topo.tp_rank is not None and topo.tp_rank != full_rank:
        raise L3InvariantError(
            f"sglang-cp L3 identity: the storage config places this process at TP rank {full_rank}, the runtime "
            f"published TP rank {topo.tp_rank}; refusing to guess which L3 rank it owns")
    pp_size = int(topo.pp_size if topo.pp_size is not None else sc.pp_size)
    pp_rank = int(sc.pp_rank)
    if not (0 <= full_rank < full_size and 0 <= pp_rank < pp_size and 0 <= topo.replica < topo.replicas):
        raise L3InvariantError(f"sglang-cp L3 identity: ranks out of range (TP {full_rank}/{full_size}, "
                               f"PP {pp_rank}/{pp_size}, replica {topo.replica}/{topo.replicas})")
    pp_range, tp_range = node_rank_ranges(full_size, pp_size, topo.nnodes, topo.node_rank)
    if pp_rank not in pp_range or full_rank not in tp_range:
        raise L3InvariantError(
            f"sglang-cp L3 identity: PP {pp_rank} / TP {full_rank} is not launched on node {topo.node_rank} of "
            f"{topo.nnodes} (that node runs PP {list(pp_range)}, TP {list(tp_range)})")
    per_replica = len(pp_range) * len(tp_range)
    local = (topo.replica * per_replica + (pp_rank - pp_range.start) * len(tp_range)
             + (full_rank - tp_range.start))
    return L3Identity(replica=topo.replica, pp_rank=pp_rank, tp_rank=full_rank, attn_dp_rank=attn_dp_rank,
                      attn_cp_rank=cp_rank, attn_tp_rank=attn_tp_rank, node_rank=topo.node_rank,
                      local_rank=local, local_count=topo.replicas * per_replica)


def runtime_topology() -> Topology:
    """This scheduler process's topology from upstream's published parallel context.

    Without a published context (tools, direct construction in tests) the storage config is
    the whole truth: one node, one replica, no attention DP.
    """
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        attn_dp = bool(is_dp_attention_enabled())
    except (ValueError, RuntimeError, AttributeError):
        return Topology()

    def read(name, default=None):
        try:
            value = getattr(p, name)
        except (ValueError, RuntimeError, AttributeError):  # not written in this process
            return default
        return default if value is None else int(value)

    return Topology(
        attn_dp_enabled=attn_dp, attn_dp_size=read("attn_dp_size", 1) if attn_dp else 1,
        tp_size=read("tp_size"), pp_size=read("pp_size"),
        # Under attention DP the spawn's dp_rank is the attention-DP group, not a replica.
        replicas=1 if attn_dp else max(1, read("dp_size", 1)), replica=0 if attn_dp else read("dp_rank", 0),
        nnodes=read("nnodes", 1), node_rank=read("node_rank", 0), tp_rank=read("tp_rank"))
