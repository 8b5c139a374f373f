"""derive_identity over upstream's HiCacheStorageConfig for topologies the server test does not
spawn (attention DP x CP x TP x PP), and its loud refusals."""

import itertools

import pytest

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang_cp.integration.cp_l3.identity import Topology, derive_identity
from sglang_cp.l3.errors import L3InvariantError


def _sc(tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size, dp_rank):
    # What _generate_storage_config builds under DP attention: attention-TP rank/size, the group in dp_rank.
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                attn_cp_rank=cp_rank, attn_cp_size=cp_size, is_mla_model=True,
                                enable_storage_metrics=False, is_page_first_layout=True, model_name="m",
                                dp_rank=dp_rank)


def test_attention_dp_cp_tp_and_pp_give_every_process_its_own_rank():
    # --tp 8 --attn-dp-size 2 --attn-cp-size 2 (attention TP 2) --pp 2: 16 processes on one node.
    seen = {}
    for pp, adp, cp, atp in itertools.product(range(2), range(2), range(2), range(2)):
        full = (adp * 2 + cp) * 2 + atp
        ident = derive_identity(_sc(atp, 2, pp, 2, cp, 2, adp),
                                Topology(attn_dp_enabled=True, attn_dp_size=2, tp_size=8, pp_size=2, tp_rank=full))
        assert (ident.tp_rank, ident.local_count) == (full, 16)
        seen[ident.local_rank] = (pp, adp, cp, atp)
    assert sorted(seen) == list(range(16))


def test_a_disagreeing_runtime_rank_or_a_foreign_node_is_refused_loudly():
    sc = _sc(1, 2, 0, 1, 0, 1, 3)
    with pytest.raises(L3InvariantError, match="published TP rank 6"):
        derive_identity(sc, Topology(attn_dp_enabled=True, attn_dp_size=4, tp_size=8, pp_size=1, tp_rank=6))
    # TP rank 7 runs on node 1 of 2; a topology that says node 0 cannot place it.
    with pytest.raises(L3InvariantError, match="not launched on node 0 of 2"):
        derive_identity(sc, Topology(attn_dp_enabled=True, attn_dp_size=4, tp_size=8, pp_size=1, nnodes=2))
    ident = derive_identity(sc, Topology(attn_dp_enabled=True, attn_dp_size=4, tp_size=8, pp_size=1, nnodes=2,
                                         node_rank=1, tp_rank=7))
    assert (ident.local_rank, ident.local_count) == (3, 4)
