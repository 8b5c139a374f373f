"""002#08 decode-queue receiver lifetime and idle check (PD disaggregation),
already upstream in 0.5.23.

- A request leaving decode-side transfer ownership through the (deferred)
  release path has its kv_receiver cleared and its metadata slot returned.
- Scheduler.is_fully_idle is False while decode retracted requests or deferred
  releases still exist, so idle housekeeping cannot run under handoff state.
"""

from __future__ import annotations

from array import array

import pytest
import torch

from conftest import WORDS


class _ClearTracking:
    """Wraps upstream's FakeKVReceiver to observe clear()."""

    def __init__(self):
        from sglang.srt.disaggregation.fake.conn import FakeKVReceiver

        self.inner = object.__new__(FakeKVReceiver)
        FakeKVReceiver.__init__(self.inner, mgr=None, bootstrap_addr="fake")
        self.cleared = 0

    def clear(self):
        self.cleared += 1
        self.inner.clear()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _decode_req(host_staged: bool):
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("r0", "hello", array("i", [2]), SamplingParams(max_new_tokens=4),
              vocab_size=len(WORDS), bootstrap_room=1234)
    receiver = _ClearTracking()
    return DecodeRequest(req=req, kv_receiver=receiver, metadata_buffer_index=3,
                         host_staged=host_staged), receiver


def _transfer_queue():
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator

    q = object.__new__(DecodeTransferQueue)
    q.queue = []
    q._deferred_releases = []
    q.enable_staging = False
    q.enable_host_receive = True  # host-staged destination: no device KV row to free
    q.scheduler = type("S", (), {"enable_hisparse": False})()
    q.tree_cache = None
    q.metadata_buffers = MetadataBuffers(size=8, hidden_size=16,
                                         hidden_states_dtype=torch.float32,
                                         max_sampling_mask_tokens=0)
    q.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(8)
    return q


def test_deferred_release_clears_receiver_and_returns_metadata_slot():
    q = _transfer_queue()
    alloc = q.req_to_metadata_buffer_idx_allocator
    idx = alloc.alloc()
    decode_req, receiver = _decode_req(host_staged=True)
    decode_req.metadata_buffer_index = idx
    q.metadata_buffers.bootstrap_room[idx] = 1234
    free_before = alloc.available_size()

    q._do_release(decode_req, idx)

    assert decode_req.kv_receiver is None and receiver.cleared == 1
    assert alloc.available_size() == free_before + 1
    assert bool((q.metadata_buffers.bootstrap_room[idx] == 0).all())  # next owner: "unwritten"


def _idle_scheduler(retracted, deferred):
    from sglang.srt.constrained.grammar_manager import GrammarManager
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.dllm.mixin.scheduler import DllmManager
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    s = object.__new__(Scheduler)
    s.running_batch = object.__new__(ScheduleBatch)
    s.running_batch.reqs = []
    s.chunked_req = None
    s.dllm_manager = DllmManager(None)
    s.last_batch = None
    s.enable_overlap = False
    s.waiting_queue = []
    s._engine_paused = False
    s.disaggregation_mode = DisaggregationMode.DECODE
    s.grammar_manager = object.__new__(GrammarManager)
    s.grammar_manager.grammar_queue = []
    s.disagg_decode_prealloc_queue = object.__new__(DecodePreallocQueue)
    s.disagg_decode_prealloc_queue.queue = []
    s.disagg_decode_prealloc_queue.retracted_queue = list(retracted)
    s.disagg_decode_transfer_queue = object.__new__(DecodeTransferQueue)
    s.disagg_decode_transfer_queue.queue = []
    s.disagg_decode_transfer_queue._deferred_releases = list(deferred)
    s.decode_offload_manager = None
    s.enable_hisparse = False
    s.enable_hierarchical_cache = False
    s.enable_lmcache = False
    return s


@pytest.mark.parametrize(
    "retracted, deferred, idle",
    [([], [], True), (["retracted-req"], [], False), ([], [("held",)], False)],
)
def test_idle_check_counts_decode_retracted_and_deferred_state(retracted, deferred, idle):
    from conftest import topology

    s = _idle_scheduler(retracted, deferred)
    with topology(tp_size=1, attn_tp_size=1, attn_cp_size=1, pp_size=1):
        assert s.is_fully_idle() is idle
        if retracted:
            # the health check must not treat a retracted decode as idle either
            assert s.is_fully_idle(for_health_check=True) is False
