"""002#13 (second half): EAGLE draft CUDA-graph replay pads the raw batch to a
captured size; the attention metadata and the graph must see a seq_lens_sum
that counts the padded rows, and the caller must get its raw value back.

Drives the real ``EAGLEDraftCudaGraphRunner.execute`` on CPU with real
``EagleDraftInputBuffers``. Only the GPU boundary is replaced: the captured
graph replay (``_replay_graph``) and the draft attention backend's metadata
planning record what they are handed. The forward batch is a namespace with the
fields execute() reads (it copies it into a namespace itself for the backend).
"""

from __future__ import annotations

import types

import pytest
import torch

CAPTURED_BS = [1, 2, 4, 8]
STEPS, TOPK, HIDDEN, FILL = 3, 1, 16, 1


def _buffers(n):
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EagleDraftInputBuffers

    def z(*shape, dtype=torch.int64):
        return torch.zeros(*shape, dtype=dtype)

    return EagleDraftInputBuffers(
        input_ids=z(n), req_pool_indices=z(n), out_cache_loc=z(n * STEPS), positions=z(n),
        mrope_positions=z(3, n), rids_int=None, bootstrap_room_ids_int=None, seq_lens=z(n),
        seq_lens_cpu=z(n), extend_seq_lens=z(n), topk_p=z(n, TOPK, dtype=torch.float32),
        topk_index=z(n, TOPK), draft_probs=None, sampling_seed=None,
        hidden_states=z(n, HIDDEN, dtype=torch.float32), global_num_tokens_gpu=None,
        global_num_tokens_for_logprob_gpu=None,
    )


def _runner(seen):
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner

    class _DraftBackend:
        def init_forward_metadata_out_graph(self, fb):
            seen["metadata"] = (fb.batch_size, fb.seq_lens_sum, fb.num_padding)

    def _replay_graph(shape_key, fb):
        seen["replay"] = (shape_key.size, fb.seq_lens_sum, fb.seq_lens.tolist())
        n = shape_key.size
        return torch.zeros(n, 1), torch.zeros(n, 1), torch.zeros(n, 2), None

    r = object.__new__(EAGLEDraftCudaGraphRunner)
    r.deepep_adapter = types.SimpleNamespace(replay=lambda: None)
    r.buffers = _buffers(max(CAPTURED_BS))
    r.captured_req_width = 1
    r.require_mlp_tp_gather = False
    r.require_gathered_buffer = False
    r.capture_bs = CAPTURED_BS
    r.seq_len_fill_value = FILL
    r.speculative_num_steps = STEPS
    r.model_runner = types.SimpleNamespace(
        model_config=types.SimpleNamespace(vocab_size=100, model_is_mrope=False),
        device_timer=None,
    )
    r.draft_attn_backend = _DraftBackend()
    r._replay_graph = _replay_graph
    return r


def _forward_batch(seq_lens):
    raw = len(seq_lens)
    return types.SimpleNamespace(
        batch_size=raw, seq_lens=torch.tensor(seq_lens), seq_lens_sum=sum(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens), out_cache_loc=torch.arange(raw * STEPS),
        positions=torch.arange(raw), req_pool_indices=torch.arange(raw), mrope_positions=None,
        rids_int=None, bootstrap_room_ids_int=None, sampling_info=None,
        spec_info=types.SimpleNamespace(
            topk_p=torch.ones(raw, TOPK), topk_index=torch.ones(raw, TOPK, dtype=torch.int64),
            draft_probs=None, hidden_states=torch.ones(raw, HIDDEN), dsa_topk_indices=None,
        ),
    )


@pytest.mark.parametrize(
    "seq_lens, padded_bs",
    [([10, 20, 30], 4), ([5, 6, 7, 8], 4), ([9, 9, 9, 9, 9], 8), ([42], 1)],
)
def test_padded_replay_sees_padded_sum_and_caller_gets_raw_sum(seq_lens, padded_bs):
    from sglang.srt.runtime_context import get_context

    seen = {}
    runner = _runner(seen)
    fb = _forward_batch(seq_lens)
    raw_bs, raw_sum = len(seq_lens), sum(seq_lens)
    with get_context().override_server_args():
        out = runner.execute(fb)
    padded_sum = raw_sum + (padded_bs - raw_bs) * FILL
    assert seen["metadata"] == (padded_bs, padded_sum, padded_bs - raw_bs)
    assert seen["replay"][:2] == (padded_bs, padded_sum)
    # the graph's seq_lens hold the raw rows then fill rows: sum() == seq_lens_sum
    assert sum(seen["replay"][2]) == padded_sum
    assert fb.seq_lens_sum == raw_sum and fb.batch_size == raw_bs
    assert [t.shape[0] for t in out[:3]] == [raw_bs] * 3
