"""002#12 on CPU: the real Scheduler._copy_result_to_cpu issues the result readback
on copy_stream after copy_stream waits for the forward stream, and the real
GenerationBatchResult.copy_to_cpu records copy_done there and skips the hidden-state D2H when the batch did
not ask for hidden states. Hidden states live on the meta device here: any
attempt to copy them raises, so "not copied" is observed, not assumed. The CUDA
twin (pinned async D2H, copy_done, record_stream) is test/gpu/test_seed_spec_v2_copy.py.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch


def _result():
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult

    out = LogitsProcessorOutput(
        next_token_logits=torch.zeros(4, 8), hidden_states=torch.empty(4, 16, device="meta")
    )
    return GenerationBatchResult(logits_output=out, next_token_ids=torch.arange(4))


def _scheduler(events):
    from sglang.srt.managers.scheduler import Scheduler

    class _Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name}.wait({other.name})")

    @contextlib.contextmanager
    def ctx():
        events.append("enter copy_stream")
        try:
            yield
        finally:
            events.append("exit copy_stream")

    s = object.__new__(Scheduler)
    s.copy_stream, s.forward_stream, s.copy_stream_ctx = _Stream("copy"), _Stream("forward"), ctx()
    s.enable_async_d2h_copy = False
    return s


@pytest.mark.parametrize("return_hidden_states", [False, True])
def test_readback_on_copy_stream_and_hidden_states_only_when_asked(return_hidden_states):
    events = []
    s = _scheduler(events)
    res = _result()
    res.copy_done = types.SimpleNamespace(record=lambda: events.append("copy_done.record"))
    hidden = res.logits_output.hidden_states
    batch = types.SimpleNamespace(return_logprob=False, return_hidden_states=return_hidden_states)
    if return_hidden_states:
        with pytest.raises(NotImplementedError, match="meta"):  # the D2H was attempted
            s._copy_result_to_cpu(res, batch)
    else:
        s._copy_result_to_cpu(res, batch)
        assert res.logits_output.hidden_states is hidden  # untouched: no D2H
        assert res.next_token_ids.tolist() == [0, 1, 2, 3]
    if return_hidden_states:
        assert events == ["copy.wait(forward)", "enter copy_stream", "exit copy_stream"]
    else:  # copy_done is recorded inside the copy stream, after the copies
        assert events == ["copy.wait(forward)", "enter copy_stream", "copy_done.record",
                          "exit copy_stream"]
