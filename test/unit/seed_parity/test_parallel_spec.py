"""Seed items on CP rank gating, CP shard padding, EAGLE spec-v2 and MegaMoE,
already upstream in 0.5.23 (or not applicable: spec v1 was removed).

- 002#15 stats logging / scheduler metrics gated on attn_cp_rank == 0
- 002#41 DSA/NSA CP gather/scatter with uneven per-rank shards (pad to max_rank_len)
- 002#09 spec-v1 MTP index reuse: not applicable, spec v1 EAGLE is gone
- 002#10 spec-v2 MTP index reuse only at topk == 1, cleared after each draft forward
- 002#11 DSA draft-extend-v2 graph: static page-table width, v2 mode kept separate
- 002#14 plan stream is opt-in (default: no extra stream)
- 002#01-04 MegaMoE: a2a backend enum + CLI choice, NVFP4 scale group 16 vs 32,
  GLM-5 (GlmMoeDsa) runs the DeepseekV2 MoE block that carries the MegaMoE fast path
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types

import pytest
import torch

from conftest import topology


# ---- 002#15 stats-logging rank gate ---------------------------------------------


@pytest.mark.parametrize(
    "attn_tp_rank, attn_cp_rank, expected",
    [(0, 0, True), (0, 1, False), (1, 0, False), (1, 1, False)],
)
def test_stats_logging_rank_requires_cp_rank_zero(attn_tp_rank, attn_cp_rank, expected):
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(enable_metrics=False) as server_args:
        with topology(
            tp_size=4,
            attn_tp_size=2,
            attn_cp_size=2,
            attn_tp_rank=attn_tp_rank,
            attn_cp_rank=attn_cp_rank,
            pp_rank=0,
        ):
            ctx = SchedulerMetricsCollector.init_new(
                server_args=server_args,
                enable_priority_scheduling=False,
                enable_lora=False,
                enable_hierarchical_cache=False,
            )
    assert ctx.is_stats_logging_rank is expected
    assert ctx.enable_kv_cache_events is False


# ---- 002#41 uneven CP shards are padded to one physical length ----------------------


@pytest.mark.parametrize("strategy", ["zigzag", "interleave"])
@pytest.mark.parametrize("seq_lens", [[37, 33], [5], [64, 1, 9]])
def test_cp_shards_pad_to_equal_length_and_cover_every_token(strategy, seq_lens):
    from sglang.srt.layers.cp.interleave import InterleaveCPStrategy
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

    cls = {"zigzag": ZigzagCPStrategy, "interleave": InterleaveCPStrategy}[strategy]
    cp = 4
    total = sum(seq_lens)
    x = torch.arange(total, dtype=torch.float32).unsqueeze(1) + 1.0  # no zero rows
    shards, logical = [], []
    for rank in range(cp):
        with topology(
            tp_size=cp, attn_tp_size=1, attn_cp_size=cp, attn_cp_rank=rank
        ):
            strat = cls(cp)
            md = strat.build_metadata(
                num_tokens=total, seqs_len=seq_lens, extend_seqs_len=list(seq_lens)
            )
            pad_logical_token_to_physical(md)
            fb = types.SimpleNamespace(attn_cp_metadata=md)  # the only field read
            shards.append(strat.shard_hidden_states(x, fb))
            logical.append(md.per_rank_logical_token[rank])
    # The all-gather-into-tensor contract: every rank contributes the same rows.
    assert len({s.shape[0] for s in shards}) == 1
    assert shards[0].shape[0] == md.max_rank_len[0]
    # Valid rows are a prefix of each shard; padding rows are zero.
    valid = torch.cat([s[:n] for s, n in zip(shards, logical)]).squeeze(1)
    pads = torch.cat([s[n:] for s, n in zip(shards, logical)])
    assert sorted(valid.tolist()) == (x.squeeze(1)).tolist()
    assert pads.numel() == 0 or bool((pads == 0).all())


# ---- 002#09 / 002#10 MTP index reuse ------------------------------------------------


def test_spec_v1_eagle_worker_is_gone_so_v1_items_do_not_apply():
    assert importlib.util.find_spec("sglang.srt.speculative.eagle_worker") is None
    assert importlib.util.find_spec("sglang.srt.speculative.eagle_worker_v2")


def _draft_worker(topk, **hf):
    from transformers import PretrainedConfig

    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    worker = object.__new__(EagleDraftWorker)  # upstream's own harness pattern
    worker.topk = topk
    worker.draft_runner = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=PretrainedConfig(**hf))
    )
    worker._init_dsa_index_share_state()
    return worker


@pytest.mark.parametrize(
    "topk, declared, expected",
    [(1, True, True), (2, True, False), (4, True, False), (1, False, False)],
)
def test_mtp_index_share_only_at_topk_one_and_when_declared(topk, declared, expected):
    worker = _draft_worker(topk, index_share_for_mtp_iteration=declared, index_topk=2048)
    assert worker.index_share_for_mtp_iteration is expected
    assert worker.seed_dsa_topk_from_draft_extend is expected


def test_mtp_index_share_state_cleared_after_draft_forward_even_on_error():
    from sglang.srt.layers.attention.index_topk_share import IndexTopKShareState

    spec_info = types.SimpleNamespace(dsa_topk_indices=torch.ones(2, 4, dtype=torch.int32))
    fb = types.SimpleNamespace(spec_info=spec_info, reuse_dsa_topk_indices=False)
    with IndexTopKShareState.mtp_iteration(fb, enabled=True) as state:
        assert fb.reuse_dsa_topk_indices is True
        assert state.topk_indices is None  # stale carry dropped at entry
        spec_info.dsa_topk_indices = torch.zeros(2, 4, dtype=torch.int32)
    assert fb.reuse_dsa_topk_indices is False and spec_info.dsa_topk_indices is None

    spec_info.dsa_topk_indices = torch.ones(2, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError):
        with IndexTopKShareState.mtp_iteration(fb, enabled=True, keep_carry_seed=True):
            raise RuntimeError("draft forward failed")
    assert fb.reuse_dsa_topk_indices is False and spec_info.dsa_topk_indices is None

    with IndexTopKShareState.mtp_iteration(fb, enabled=False) as state:
        assert state is None and fb.reuse_dsa_topk_indices is False


# ---- 002#11 draft-extend v2 graph metadata --------------------------------------------


def test_draft_extend_v2_is_its_own_mode_and_not_a_plain_extend():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = ForwardMode.DRAFT_EXTEND_V2
    assert not hasattr(ForwardMode, "DRAFT_EXTEND")  # the v1 variable-length mode is gone
    assert mode.is_draft_extend_v2()
    assert not mode.is_extend() and mode.is_extend(include_draft_extend_v2=True)


def test_dsa_graph_page_table_width_is_static_req_to_token_width():
    from sglang.srt.layers.attention.dsa_backend import (
        DeepseekSparseAttnBackend,
        DSAMetadata,
    )

    required = [
        f.name
        for f in dataclasses.fields(DSAMetadata)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    backend = object.__new__(DeepseekSparseAttnBackend)
    backend.req_to_token = torch.zeros(8, 4096, dtype=torch.int32)
    fused = DSAMetadata(**{name: None for name in required})
    # Fused decode graphs drop the wide table: replay must use the captured
    # req_to_token width, never a host-derived max(seq_lens).
    assert backend._graph_page_table_width(fused) == 4096
    wide = DSAMetadata(**{**{name: None for name in required}, "page_table_1": torch.zeros(8, 512)})
    assert backend._graph_page_table_width(wide) == 512


# ---- 002#14 plan stream -----------------------------------------------------------------


def test_plan_stream_is_opt_in(monkeypatch):
    import contextlib

    from sglang.srt.environ import envs
    from sglang.srt.speculative.spec_utils import get_plan_stream

    monkeypatch.delenv("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", raising=False)
    stream, ctx = get_plan_stream("cpu")
    assert stream is None and isinstance(ctx, contextlib.nullcontext)
    with envs.SGLANG_ENABLE_OVERLAP_PLAN_STREAM.override(True):
        stream, ctx = get_plan_stream("cpu")
    assert isinstance(stream, torch.cpu.Stream) and not isinstance(ctx, contextlib.nullcontext)


def test_plan_stream_is_fenced_on_both_sides_of_draft_extend_planning(monkeypatch):
    """002#14, the seed's ordering fix, on the real EagleDraftWorker._draft_extend_for_decode:
    the plan stream waits for the current stream before prepare_for_draft_extend runs in
    its context, and the current stream waits for the plan stream before the draft
    forward. Streams are recorders (CPU has no concurrent streams); the planning step is
    recorded and the draft forward is stopped at its first step (can_run_graph)."""
    import contextlib

    from sglang.srt.speculative import eagle_worker_v2 as m

    events = []

    class _Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name}.wait({other.name})")

    @contextlib.contextmanager
    def plan_ctx():
        events.append("enter plan")
        yield
        events.append("exit plan")

    class _Stop(Exception):
        pass

    def prepare(*args, **kwargs):
        events.append("prepare_for_draft_extend")
        return types.SimpleNamespace(input_ids=torch.zeros(2))

    def can_run_graph(fb):
        raise _Stop

    current = _Stream("current")
    monkeypatch.setattr(m, "prepare_for_draft_extend", prepare)
    monkeypatch.setattr(torch.cpu, "current_stream", lambda *a, **k: current)
    worker = object.__new__(m.EagleDraftWorker)
    worker.device = "cpu"
    worker.plan_stream, worker.plan_stream_ctx = _Stream("plan"), plan_ctx()
    worker.speculative_num_draft_tokens = 2
    worker.draft_runner = None
    worker.cuda_graph_runner_for_draft_extend = types.SimpleNamespace(can_run_graph=can_run_graph)
    result = types.SimpleNamespace(
        prepared_draft_extend_inputs=(torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.int64)),
        logits_output=types.SimpleNamespace(hidden_states=torch.zeros(2, 4)),
        accept_lens=torch.ones(1, dtype=torch.int32),
        next_token_ids=torch.zeros(2, dtype=torch.int64),
    )
    with pytest.raises(_Stop):
        worker._draft_extend_for_decode(types.SimpleNamespace(seq_lens=torch.ones(1)), result)
    assert events == [
        "plan.wait(current)", "enter plan", "prepare_for_draft_extend", "exit plan",
        "current.wait(plan)",
    ]


# ---- 002#01-04 MegaMoE -----------------------------------------------------------------


def test_megamoe_backend_is_a_known_a2a_backend_and_cli_choice():
    from sglang.srt.layers.moe.utils import MoeA2ABackend
    from sglang.srt.server_args import prepare_server_args

    assert MoeA2ABackend("megamoe").is_megamoe()
    args = prepare_server_args(["--model-path", "dummy", "--moe-a2a-backend", "megamoe"])
    assert args.moe_a2a_backend == "megamoe"


@pytest.mark.parametrize(
    "mma_type, hidden, ok",
    [
        ("nvfp4xnvfp4", 768, True),  # K/16 scale groups: hidden % 256
        ("mxf4xmxf4", 768, False),  # K/32 scale groups: hidden % 512
        ("mxf4xmxf4", 1024, True),
        ("nvfp4xnvfp4", 6144, True),  # GLM-5 hidden size
    ],
)
def test_megamoe_scale_group_follows_fp4_flavour(mma_type, hidden, ok):
    from sglang.srt.layers.moe.mega_moe import check_mega_moe_shapes

    if ok:
        check_mega_moe_shapes(hidden=hidden, intermediate=2048, mma_type=mma_type)
    else:
        with pytest.raises(ValueError, match="hidden_size"):
            check_mega_moe_shapes(hidden=hidden, intermediate=2048, mma_type=mma_type)


def test_modelopt_nvfp4_experts_select_the_group16_megamoe_recipe():
    """The ModelOpt NVFP4 MoE method marks its layer nvfp4 (group 16) instead of
    the K/32 path, so GLM/ModelOpt K/16 scale layouts never hit the K/32 recipe."""
    from sglang.srt.layers.moe.mega_moe import _mega_moe_mma_type

    layer = types.SimpleNamespace(_mega_moe_nvfp4=True, _mega_moe_w4a4=False)
    assert _mega_moe_mma_type(layer) == "nvfp4xnvfp4"
    layer = types.SimpleNamespace(_mega_moe_nvfp4=False, _mega_moe_w4a4=True)
    assert _mega_moe_mma_type(layer) == "mxf4xmxf4"
    # The builder that sets _mega_moe_nvfp4 runs in test_megamoe_executed.py.


def test_megamoe_resolution_refuses_without_a_capable_gpu():
    from sglang.srt.server_args import prepare_server_args

    if torch.cuda.is_available():
        pytest.skip("covered by test/gpu/test_seed_megamoe_args.py on a GPU")
    args = prepare_server_args(
        ["--model-path", "dummy", "--moe-a2a-backend", "megamoe", "--tp-size", "8"]
    )
    with pytest.raises(ValueError, match="megamoe needs a CUDA SM90 GPU"):
        args.resolve_once()


# ---- 002#42 CP-local draft hidden side channel ---------------------------------------------


def test_hidden_capture_is_per_forward_and_no_draft_hidden_side_channel_exists():
    """The seed leaked a sticky capture_draft_hidden_states flag on a reused
    worker batch and a draft_hidden_states tensor on LogitsProcessorOutput. In
    0.5.23 the capture mode is a keyword argument of each forward (a fresh
    ForwardBatch is built from it) and the output carries no such tensor."""
    import inspect

    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.tp_worker import TpModelWorker

    fields = {f.name for f in dataclasses.fields(LogitsProcessorOutput)}
    assert "draft_hidden_states" not in fields
    param = inspect.signature(TpModelWorker.forward_batch_generation).parameters[
        "capture_hidden_mode"
    ]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None


# ---- 002#12 grouped small copies for draft graph replay ---------------------------------------


def test_draft_replay_small_copies_are_grouped_and_exact():
    import inspect

    from sglang.srt.model_executor.runner_utils.buffers import _grouped_foreach_copy_
    from sglang.srt.speculative import (
        eagle_draft_cuda_graph_runner,
        eagle_draft_extend_cuda_graph_runner,
    )

    dsts = [torch.zeros(5, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
            torch.zeros(4, dtype=torch.float32), torch.zeros(2, dtype=torch.int64)]
    srcs = [torch.arange(5, dtype=torch.int32), torch.arange(3, dtype=torch.int32),
            torch.ones(4, dtype=torch.bfloat16), torch.tensor([7, 9])]
    _grouped_foreach_copy_(dsts, srcs)  # mixed dtype pairs, one foreach per pair
    assert dsts[0].tolist() == [0, 1, 2, 3, 4] and dsts[0].dtype == torch.int64
    assert dsts[1].tolist() == [0, 1, 2] and dsts[2].tolist() == [1.0] * 4
    assert dsts[3].tolist() == [7, 9]
    for mod in (eagle_draft_cuda_graph_runner, eagle_draft_extend_cuda_graph_runner):
        assert "_grouped_foreach_copy_(copy_dsts, copy_srcs)" in inspect.getsource(mod)


def test_megamoe_spans_experts_over_tp_ranks():
    """002#04: --moe-a2a-backend megamoe forces ep_size = tp_size (the post-process
    step upstream runs during resolution; a pure function of the resolving view)."""
    from sglang.srt.arg_groups.overrides import _A2A_EP_SPANNING_BACKENDS, _a2a_ep_size

    assert "megamoe" in _A2A_EP_SPANNING_BACKENDS
    view = types.SimpleNamespace(moe_a2a_backend="megamoe", ep_size=1, tp_size=8)
    assert _a2a_ep_size(view) == {"ep_size": 8}
    assert _a2a_ep_size(types.SimpleNamespace(moe_a2a_backend="none", ep_size=1, tp_size=8)) == {}
