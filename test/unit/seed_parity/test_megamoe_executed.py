"""002#01 / #02 / #03 MegaMoE, executed instead of read.

The MegaMoE kernels live in DeepGEMM, which needs an SM90/SM100 GPU and is not
installable on a CPU machine. These tests run upstream's own Python around the
kernels -- the ModelOpt NVFP4 weight builder, the routed-expert dispatch and
the DeepSeek-V2 MoE block's fast-path choice -- with a recording ``deep_gemm``
module standing in for the library (it records each call and returns tensors
of the right shape). What is checked is the Python's decisions: which recipe
and scale group reach DeepGEMM, which layout is kept, when the fast path runs.
The numerical kernels themselves are not exercised (that needs deep_gemm on a
Blackwell GPU; see the audit row).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

E, H, I = 2, 512, 256  # experts, hidden, intermediate (nvfp4 shape rules hold)


class _Recorder(types.ModuleType):
    def __init__(self):
        super().__init__("deep_gemm")
        self.calls = []
        utils = types.ModuleType("deep_gemm.utils")
        math_ = types.ModuleType("deep_gemm.utils.math")
        math_.transform_ue4m3_sf_into_required_layout = self._rec(
            "transform_ue4m3_sf_into_required_layout", lambda sf, mn: sf.clone()
        )
        utils.math = math_
        self.utils = utils
        self.modules = {"deep_gemm": self, "deep_gemm.utils": utils, "deep_gemm.utils.math": math_}
        self.transform_weights_for_mega_moe = self._rec(
            "transform_weights_for_mega_moe",
            lambda l1, l2, mma_type: ((l1[0].clone(), l1[1].clone()), (l2[0].clone(), l2[1].clone())),
        )
        self.mega_moe_pre_dispatch = self._rec("mega_moe_pre_dispatch", lambda *a, **k: None)
        self.fp8_fp4_mega_moe = self._rec("fp8_fp4_mega_moe", lambda y, *a, **k: y.fill_(1.0))
        self.get_num_sms = lambda: 132
        self.set_num_sms = lambda n: None

    def _rec(self, name, fn):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return fn(*args, **kwargs)

        return call

    def named(self, name):
        return [(a, k) for n, a, k in self.calls if n == name]


@pytest.fixture
def deep_gemm(monkeypatch):
    rec = _Recorder()
    for name, mod in rec.modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return rec


def _nvfp4_layer():
    """A ModelOpt NVFP4 expert layer as its create_weights leaves it after loading:
    packed FP4 weights (2 values per byte) and FP8-E4M3 block scales, one per 16
    input values (the K/16 layout the seed had to infer)."""
    layer = torch.nn.Module()
    p = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
    layer.w13_weight = p(torch.randint(0, 255, (E, 2 * I, H // 2), dtype=torch.uint8))
    layer.w13_weight_scale = p(torch.randint(0, 120, (E, 2 * I, H // 16), dtype=torch.uint8))
    layer.w2_weight = p(torch.randint(0, 255, (E, H, I // 2), dtype=torch.uint8))
    layer.w2_weight_scale = p(torch.randint(0, 120, (E, H, I // 16), dtype=torch.uint8))
    layer.w13_weight_scale_2 = p(torch.full((E, 2), 0.5))
    layer.w2_weight_scale_2 = p(torch.full((E,), 0.25))
    layer.w2_input_scale = p(torch.full((E,), 2.0))
    layer.moe_runner_config = types.SimpleNamespace(is_gated=True)
    layer.num_local_experts = E
    layer.num_experts = E
    layer.moe_ep_rank = 0
    return layer


def _method(trtllm_layout: bool):
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod

    method = object.__new__(ModelOptNvFp4FusedMoEMethod)  # the builder reads only this
    method.use_flashinfer_trtllm_weight_layout = trtllm_layout
    return method


def test_modelopt_nvfp4_builder_selects_the_group16_recipe_and_replaces_the_checkpoint_layout(deep_gemm):
    """002#01 and #03: the real ModelOpt NVFP4 MegaMoE builder hands DeepGEMM the K/16
    scales with the nvfp4xnvfp4 recipe, marks the layer nvfp4 (so dispatch picks group
    16), and keeps no checkpoint-layout copy to fall back to."""
    from sglang.srt.layers.moe.mega_moe import _mega_moe_mma_type

    layer = _nvfp4_layer()
    _method(trtllm_layout=False)._build_mega_moe_weights(layer)
    [(args, kwargs)] = deep_gemm.named("transform_weights_for_mega_moe")
    assert kwargs["mma_type"] == "nvfp4xnvfp4"
    sf_calls = deep_gemm.named("transform_ue4m3_sf_into_required_layout")
    assert [a[0].shape[-1] for a, _ in sf_calls] == [H // 16, I // 16]  # one scale per 16 values
    assert layer._mega_moe_nvfp4 and layer._mega_moe_weights_built
    layer._mega_moe_w4a4 = False
    assert _mega_moe_mma_type(layer) == "nvfp4xnvfp4"
    # The checkpoint layout is replaced by the mega layout: no sidecar, no fallback copy.
    assert layer.w13_weight.data_ptr() == layer.mega_l1_weights[0].data_ptr()
    assert layer.w2_weight.data_ptr() == layer.mega_l2_weights[0].data_ptr()
    assert layer.mega_l1_alphas.shape == (E, 2) and layer.mega_l2_act_scales.shape == (E,)


def test_modelopt_nvfp4_builder_refuses_the_trtllm_runner_layout(deep_gemm):
    """002#03: the seed built the sidecar before FlashInfer TRT-LLM alignment to keep
    that layout as a fallback. Upstream refuses the combination outright."""
    layer = _nvfp4_layer()
    with pytest.raises(AssertionError, match="canonical W13 layout"):
        _method(trtllm_layout=True)._build_mega_moe_weights(layer)
    assert not deep_gemm.named("transform_weights_for_mega_moe")


def test_nvfp4_megamoe_token_budget_is_enforced_at_startup():
    """002#03: with no fallback, a batch over the MegaMoE token cap has nowhere to go,
    so upstream requires NVFP4 experts to size the cap to the decode bound at startup."""
    from sglang.srt.arg_groups.mega_moe_hook import (
        mega_moe_needs_token_budget,
        validate_mega_moe_token_budget,
    )
    from sglang.srt.environ import envs
    from sglang.srt.server_args import prepare_server_args

    assert mega_moe_needs_token_budget("GlmMoeDsaForCausalLM", {"quant_algo": "NVFP4"}, None)
    assert mega_moe_needs_token_budget("GlmMoeDsaForCausalLM", {}, "modelopt_fp4")
    assert not mega_moe_needs_token_budget("GlmMoeDsaForCausalLM", {"quant_algo": "FP8"}, "fp8")
    def args(chunk):
        return prepare_server_args([
            "--model-path", "dummy", "--moe-a2a-backend", "megamoe", "--tp-size", "1",
            "--chunked-prefill-size", str(chunk),
        ])

    with envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.override(4096):
        with pytest.raises(ValueError, match="requires chunked prefill to be enabled"):
            validate_mega_moe_token_budget(args(-1), "GlmMoeDsaForCausalLM")
        with pytest.raises(ValueError, match="at least 8192"):
            validate_mega_moe_token_budget(args(8192), "GlmMoeDsaForCausalLM")
        validate_mega_moe_token_budget(args(4096), "GlmMoeDsaForCausalLM")  # fits: accepted


def _ready_nvfp4_experts(deep_gemm):
    layer = _nvfp4_layer()
    _method(trtllm_layout=False)._build_mega_moe_weights(layer)
    layer._mega_moe_w4a4 = False
    layer._mega_moe_trtllm_layout = False
    return layer


def test_nvfp4_dispatch_quantizes_activations_in_groups_of_16(deep_gemm, monkeypatch):
    """002#01 at run time: the real run_mega_routed_experts on an nvfp4 layer sends
    activations to DeepGEMM's pre-dispatch with group_size=16 and runs the fused
    kernel with the (1, 1, 16) recipe and the builder's alphas (SM100 branch).
    Stand-ins: the SM version, the symmetric-memory buffer and the EP group (CUDA/NVSHMEM)."""
    from sglang.srt import runtime_context
    from sglang.srt.layers.moe import mega_moe

    experts = _ready_nvfp4_experts(deep_gemm)
    monkeypatch.setattr(mega_moe, "_device_sm", 100)
    monkeypatch.setattr(mega_moe, "_mega_moe_max_num_sms", lambda: None)
    buf = types.SimpleNamespace(x="x", x_sf="x_sf", topk_idx="ti", topk_weights="tw", x_scales="xs")
    monkeypatch.setattr(mega_moe, "_get_mega_moe_symm_buffer", lambda *a, **k: buf)
    monkeypatch.setattr(
        runtime_context, "get_parallel",
        lambda: types.SimpleNamespace(moe_ep_group=types.SimpleNamespace(device_group=None)),
    )
    n = 3
    y = mega_moe.run_mega_routed_experts(
        experts, torch.randn(n, H, dtype=torch.bfloat16), torch.zeros(n, 2, dtype=torch.int64),
        torch.ones(n, 2), hidden_size=H, intermediate_size=I, top_k=2, num_tokens=n,
    )
    [(args, kw)] = deep_gemm.named("mega_moe_pre_dispatch")
    assert kw["group_size"] == 16 and kw["mma_type"] == "nvfp4xnvfp4" and kw["buf_x_scales"] == "xs"
    [(args, kw)] = deep_gemm.named("fp8_fp4_mega_moe")
    assert kw["recipe"] == (1, 1, 16) and kw["use_x_scales"] is True
    assert kw["l1_alphas"] is experts.mega_l1_alphas and "weight_layout" not in kw
    assert args[1] is experts.mega_l1_weights and y.shape == (n, H)


def test_glm5_moe_block_takes_the_megamoe_fast_path_before_any_other_dispatch(monkeypatch):
    """002#02: GLM-5 (GlmMoeDsaForCausalLM) runs DeepseekV2's MoE block; its real
    forward asks the real should_use_mega_moe first and returns the MegaMoE result,
    and over the token cap it goes on to the normal dispatch (here: the gate, which
    this bare block lacks). forward_mega_moe itself is the recorded step."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.moe import mega_moe
    from sglang.srt.layers.moe.utils import MoeA2ABackend, get_moe_a2a_backend
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2MoE
    from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLM
    from sglang.srt.runtime_context import get_flags

    assert issubclass(GlmMoeDsaForCausalLM, DeepseekV2ForCausalLM)
    get_moe_a2a_backend()
    monkeypatch.setattr(get_flags().moe, "a2a_backend", MoeA2ABackend.MEGAMOE)
    monkeypatch.setattr(mega_moe, "_device_sm", 100)
    taken = []
    monkeypatch.setattr(mega_moe, "forward_mega_moe", lambda moe, hs, fb, **k: taken.append(hs.shape[0]) or "mega")
    moe = DeepseekV2MoE.__new__(DeepseekV2MoE)
    torch.nn.Module.__init__(moe)
    moe.experts = types.SimpleNamespace(_mega_moe_weights_built=True)
    with envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.override(8):
        assert DeepseekV2MoE.forward(moe, torch.zeros(8, 4)) == "mega"
        with pytest.raises(AttributeError, match="gate"):
            DeepseekV2MoE.forward(moe, torch.zeros(9, 4))
    assert taken == [8]
