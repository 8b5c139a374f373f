"""One CP rank of test_rank_uniform_collectives: drives the real
UnifiedRadixCache.writing_check over a real gloo group with a write-ack queue
whose length differs from the other rank's (as async D2H acks drain at
rank-local times)."""

from __future__ import annotations

import json
import os
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist


class _DoneEvent:
    """CPU stand-in for a finished CUDA event (CPU tensors have no events)."""

    def query(self):
        return True

    def synchronize(self):
        return None


def main(rank: int, world: int, rendezvous: str, acks_per_round: list[int]) -> None:
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world
    )
    from sglang.srt.managers.cache_controller import HiCacheAck, HiCacheController
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    ctrl = object.__new__(HiCacheController)
    ctrl.ack_write_queue = []
    cache = object.__new__(UnifiedRadixCache)
    cache.cache_controller = ctrl
    cache.pp_rank, cache.pp_size, cache.pp_group = 0, 1, None
    cache.attn_cp_group = dist.group.WORLD  # the CP group the seed deadlocked on
    cache.attn_tp_group = None
    cache.tp_group, cache.tp_world_size = dist.group.WORLD, world
    cache.metrics_collector = None
    cache.ongoing_write_through = {}

    drained = []
    for n in acks_per_round:
        for _ in range(n):
            ctrl.ack_write_queue.append(
                HiCacheAck(start_event=_DoneEvent(), finish_event=_DoneEvent(), node_ids=[])
            )
        before = len(ctrl.ack_write_queue)
        cache.writing_check()
        drained.append(before - len(ctrl.ack_write_queue))
    dist.destroy_process_group()
    print("RANK_RESULT " + json.dumps({"rank": rank, "drained": drained}))
    # The work is done and reported. Leave without the interpreter's teardown: a torch/gloo thread
    # still joinable when C++ static objects are destroyed aborts the process ("terminate called
    # without an active exception", rc -6, seen once in CI after every collective had returned).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
