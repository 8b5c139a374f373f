"""One attention-CP rank of test_cp_interleave_collectives: upstream's DSA
interleave CP gather (InterleaveCPStrategy._gather_interleaved_tensor) and
reduce-scatter (layer_boundary.ops.attn_cp_interleave_reduce_scatter) over a
real sglang GroupCoordinator on a gloo process group, on uneven (page-aligned
or not) per-rank shards. Prints this rank's results for the parent to compare
with a single-process reference."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main(rank: int, world: int, rendezvous: str, cases: list[list[int]], hidden: int) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    # Upstream's CPU-engine branch of GroupCoordinator (torch.distributed on the
    # group's own process group); the CUDA branch goes through a CUDA-only custom op.
    parallel_state._is_cpu = True
    group = GroupCoordinator(
        group_ranks=[list(range(world))], local_rank=rank, torch_distributed_backend="gloo",
        use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
        use_xpu_communicator=False, group_name="attn_cp",
    )
    results = []
    for seq_lens in cases:
        results.append(_one_case(rank, world, group, seq_lens, hidden))
    dist.destroy_process_group()
    print("RANK_RESULT " + json.dumps({"rank": rank, "cases": results}))
    # The work is done and reported. Leave without the interpreter's teardown: a torch/gloo thread
    # still joinable when C++ static objects are destroyed aborts the process ("terminate called
    # without an active exception", rc -6, seen once in CI after every collective had returned).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _one_case(rank, world, group, seq_lens, hidden):
    import types

    from sglang.srt.layers.cp.interleave import InterleaveCPStrategy
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical
    from sglang.srt.layers.layer_boundary.ops import attn_cp_interleave_reduce_scatter
    from sglang.srt.runtime_context import get_parallel

    total = sum(seq_lens)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(total, hidden, generator=gen)  # the same full sequence on every rank
    out = {}
    with get_parallel().override(
        tp_size=world, moe_tp_size=world, attn_tp_size=1, attn_cp_size=world,
        attn_cp_rank=rank, attn_cp_group=group,
    ):
        strat = InterleaveCPStrategy(world)
        md = strat.build_metadata(num_tokens=total, seqs_len=seq_lens, extend_seqs_len=list(seq_lens))
        pad_logical_token_to_physical(md)
        fb = types.SimpleNamespace(attn_cp_metadata=md)
        shard = strat.shard_hidden_states(x, fb)
        gathered = strat._gather_interleaved_tensor(shard, fb)
        out["shard_rows"] = shard.shape[0]
        out["gathered_equals_input"] = bool(torch.equal(gathered, x))
        out["gathered_shape"] = list(gathered.shape)
        # Reduce-scatter: every rank holds a rank-major partial output of
        # world * max_rank_len rows; rank r keeps the sum of everyone's slice r.
        rows = world * max(md.per_rank_actual_token)
        partial = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(100 + rank))
        mine = attn_cp_interleave_reduce_scatter(partial.clone())
        out["reduce_scatter"] = mine.tolist()
        out["max_rank_len"] = int(max(md.per_rank_actual_token))
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]))
