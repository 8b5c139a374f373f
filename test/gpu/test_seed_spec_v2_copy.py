"""002#12 (spec-v2 D2H): hidden states are copied to the host only when the
batch asked for them, and every copy is a pinned async D2H recorded on the
result's copy_done event. Needs CUDA (events, pinned memory), no weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    # The lent GPU machine runs Python 3.12 and sglang 0.5.23's wheel is cp311-only:
    # these drive upstream code, so they need a CUDA machine with the pinned sglang.
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang 0.5.23"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _result(hidden):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult

    out = LogitsProcessorOutput(
        next_token_logits=torch.zeros(4, 32, device="cuda"), hidden_states=hidden
    )
    res = GenerationBatchResult(
        logits_output=out, next_token_ids=torch.arange(4, device="cuda")
    )
    res.copy_done = torch.cuda.Event()
    return res


@pytest.mark.parametrize("return_hidden_states", [False, True])
def test_hidden_state_copy_gated_and_async_pinned(return_hidden_states):
    hidden = torch.randn(4, 64, device="cuda")
    res = _result(hidden)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the scheduler's copy_stream
        res.copy_to_cpu(return_logprob=False, return_hidden_states=return_hidden_states)
    res.copy_done.synchronize()
    assert res.next_token_ids.device.type == "cpu" and res.next_token_ids.is_pinned()
    assert res.next_token_ids.tolist() == [0, 1, 2, 3]
    hs = res.logits_output.hidden_states
    if return_hidden_states:
        assert hs.device.type == "cpu" and hs.is_pinned()
        assert torch.equal(hs, hidden.cpu())
    else:
        assert hs.device.type == "cuda"  # no D2H for a batch that did not ask


def test_grouped_small_copy_on_cuda_matches_per_tensor_copy():
    from sglang.srt.model_executor.runner_utils.buffers import _grouped_foreach_copy_

    srcs = [torch.arange(n, device="cuda", dtype=dt) for n, dt in
            [(7, torch.int32), (64, torch.int64), (3, torch.int64), (5, torch.float32)]]
    dsts = [torch.empty(s.shape, device="cuda", dtype=torch.int64 if s.dtype != torch.float32 else torch.float32)
            for s in srcs]
    _grouped_foreach_copy_(dsts, srcs)
    torch.cuda.synchronize()
    for d, s in zip(dsts, srcs):
        assert torch.equal(d.cpu(), s.cpu().to(d.dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_draft_extend_inputs_kernel_on_cuda(dtype):
    """002#12/#13 on the compiled Triton kernel: strided select_index, int64 ids."""
    from sglang.kernels.ops.speculative.eagle import prepare_draft_extend_inputs

    accept = torch.tensor([1, 3, 2, 4], dtype=torch.int32, device="cuda")
    predict = (torch.arange(16, device="cuda") + 1000).to(dtype)
    correct, select, ids = prepare_draft_extend_inputs(accept, predict, 4)
    assert select.tolist() == [0, 6, 9, 15] and correct.tolist() == [0, 2, 1, 3]
    assert ids.dtype == torch.int64 and ids.tolist() == predict.tolist()


def test_async_d2h_records_the_source_on_the_issuing_stream(monkeypatch):
    """002#14 ownership: upstream's async_d2h marks the device source as used by the
    stream that issued the copy (record_stream), so the caching allocator cannot hand
    the block to the next forward while the copy on copy_stream is still reading it."""
    from sglang.srt.utils.common import async_d2h

    seen = []
    original = torch.Tensor.record_stream

    def record(self, stream):
        seen.append((self.data_ptr(), stream))
        return original(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", record)
    src = torch.arange(1 << 16, device="cuda", dtype=torch.int32)
    copy_stream = torch.cuda.Stream()
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        host = async_d2h(src)
    copy_stream.synchronize()
    assert seen == [(src.data_ptr(), copy_stream)]
    assert host.is_pinned() and torch.equal(host, src.cpu())
