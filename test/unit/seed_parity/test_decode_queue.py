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

from conftest import WORDS, gloo_rendezvous


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


# ---- failure path of pop_transferred, executed ------------------------------------------


class _FailingReceiver(_ClearTracking):
    """Upstream's FakeKVReceiver whose transfer failed (the peer died)."""

    def __init__(self):
        super().__init__()
        self.drained = False
        self.aborted = 0

    def poll(self):
        from sglang.srt.disaggregation.base.conn import KVPoll

        return KVPoll.Failed

    def failure_exception(self):
        raise RuntimeError("prefill peer died")

    def abort(self):
        self.aborted += 1

    def is_abort_release_safe(self):
        return self.drained


class _RecordingTree:
    """The tree cache the release path talks to (records calls; a host-staged
    destination holds no device KV row, so nothing is freed there)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append(name)


class _Streamer:
    def __init__(self):
        self.sent = []

    def stream_output(self, reqs, return_logprob):
        self.sent += [r.rid for r in reqs]


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """pop_transferred agrees on holds with an all-reduce over its gloo group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=gloo_rendezvous(tmp_path), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_failed_transfer_aborts_streams_and_releases_the_receiver_once_drained(gloo_world_of_one):
    """002#08 failure path: the real DecodeTransferQueue.pop_transferred on a failed
    transfer aborts the request, streams the abort, removes it from the queue and
    holds it (the remote write may still land in the host-staged slot); the real
    resolve_deferred_releases then clears the receiver and frees the metadata slot
    once the receiver reports the abort drained -- not before."""
    from conftest import topology
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    q = _transfer_queue()
    q.tp_rank = 0
    q.gloo_group = gloo_world_of_one
    q.tree_cache = _RecordingTree()
    q.enable_deferred_kv_release = False
    q.deferred_kv_release_timeout = 30.0
    q.scheduler.enable_decode_hicache = False
    q.scheduler.output_streamer = _Streamer()
    q.scheduler.metrics_reporter = type("M", (), {"enable_metrics": False})()
    alloc = q.req_to_metadata_buffer_idx_allocator
    idx = alloc.alloc()
    decode_req, _ = _decode_req(host_staged=True)
    receiver = _FailingReceiver()
    decode_req.kv_receiver, decode_req.metadata_buffer_index = receiver, idx
    q.queue = [decode_req]
    free_before = alloc.available_size()
    with topology(tp_size=1, attn_tp_size=1, attn_cp_size=1):
        assert q.pop_transferred() == []
        assert q.queue == [] and q.scheduler.output_streamer.sent == ["r0"]
        assert isinstance(decode_req.req.finished_reason, FINISH_ABORT)
        assert receiver.aborted == 1  # host destination: the receiver is told to stop
        # Held, not released: the slot may still be written by the dying transfer.
        assert [d for d, *_ in q._deferred_releases] == [decode_req]
        assert decode_req.kv_receiver is receiver and alloc.available_size() == free_before
        q.resolve_deferred_releases()  # not drained yet: still held
        assert decode_req.kv_receiver is receiver and q._deferred_releases
        receiver.drained = True
        q.resolve_deferred_releases()
    assert decode_req.kv_receiver is None and receiver.cleared == 1
    assert q._deferred_releases == [] and alloc.available_size() == free_before + 1
