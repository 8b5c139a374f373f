"""The GPU tests' weight shaping (test/gpu/kv_sensitive/sitecustomize.py), checked on CPU.

1. It patches the names upstream's loader and spec worker call, in a real sglang import, only when
   asked to (and the RED seam only under its own switch).
2. On modules laid out with upstream's attribute names (fused_qkv_a_proj_with_mqa rows
   [q_lora | kv_lora | rope], kv_b_proj rows per head [k_nope | v], o_proj columns per head), the
   shaped layer-0 attention plus the embedding-tied head predicts a prompt's planted token, and does
   not once the prefix's values are gone: what makes the GPU tests' "same ids" and "same accept
   length" able to fail.
"""

import importlib.util
import os
import random
import sys

import torch

from suite_helpers import run_all

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOOK_DIR = os.path.join(REPO, "test", "gpu", "kv_sensitive")
spec = importlib.util.spec_from_file_location("kv_sensitive_hook", os.path.join(HOOK_DIR, "sitecustomize.py"))
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)

PROBE = ("import sglang.srt.model_loader.loader as L, sglang.srt.speculative.base_spec_worker as B; "
         "import sglang_cp.integration.cp_l3.backend as S; "
         "print(L.initialize_dummy_weights.__qualname__, B.BaseSpecWorker._build_hicache_draft_plan.__name__, "
         "S.CpL3Storage._get.__qualname__)")


def _probe_job(**env_extra):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([HOOK_DIR, env.get("PYTHONPATH", "")])
    # A new interpreter each: its start-up (sitecustomize, reading these variables) is what is checked.
    return [sys.executable, "-c", PROBE], {"env": env, "fresh_interpreter": True}


def test_hook_patches_upstream_only_when_asked():
    runs = run_all({  # three fresh interpreters at once: each only imports and prints
        "plain": _probe_job(),
        "shaped": _probe_job(SGLANG_CP_TEST_KV_SENSITIVE="1"),
        "red_seams": _probe_job(SGLANG_CP_TEST_KV_SENSITIVE="1", SGLANG_CP_TEST_DRAFT_HICACHE="off",
                                SGLANG_CP_TEST_LOCKSTEP="off"),
    }, timeout=300)
    for name, p in runs.items():
        assert p.returncode == 0, (name, p.stderr[-3000:])
    assert runs["plain"].stdout.split() == ["initialize_dummy_weights", "_build_hicache_draft_plan", "CpL3Storage._get"]
    assert runs["shaped"].stdout.split() == [
        "_patch_loader.<locals>.initialize_dummy_weights", "_build_hicache_draft_plan", "CpL3Storage._get"]
    assert runs["red_seams"].stdout.split() == [
        "_patch_loader.<locals>.initialize_dummy_weights", "no_draft_plan", "_patch_backend.<locals>._get"]


H, Q_LORA, KV_LORA, ROPE, NOPE, V, HEADS, VOCAB = 256, 64, 128, 16, 32, 64, 4, 2000


class _Lin(torch.nn.Module):
    def __init__(self, rows, cols):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, cols).uniform_(-1e-3, 1e-3))


class _RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n).uniform_(-1e-3, 1e-3))

    def forward(self, x):
        return x / x.pow(2).mean(-1, keepdim=True).sqrt() * self.weight


class _Attn(torch.nn.Module):
    kv_lora_rank, qk_nope_head_dim, v_head_dim, qk_rope_head_dim = KV_LORA, NOPE, V, ROPE

    def __init__(self):
        super().__init__()
        self.fused_qkv_a_proj_with_mqa = _Lin(Q_LORA + KV_LORA + ROPE, H)
        self.kv_a_layernorm = _RMSNorm(KV_LORA)
        self.kv_b_proj = _Lin(HEADS * (NOPE + V), KV_LORA)
        self.o_proj = _Lin(H, HEADS * V)

    def values_out(self, x_normed, zero_prefix: int = 0):
        """Uniform attention (queries and keys are tiny) of the last position over all positions."""
        lat = x_normed @ self.fused_qkv_a_proj_with_mqa.weight[Q_LORA:Q_LORA + KV_LORA].T
        lat = self.kv_a_layernorm(lat)
        w_v = self.kv_b_proj.weight.unflatten(0, (HEADS, NOPE + V))[:, NOPE:]  # heads x V x kv_lora
        vals = torch.einsum("hvk,tk->thv", w_v, lat)
        if zero_prefix:
            vals[:zero_prefix] = 0
        return self.o_proj.weight @ vals.mean(0).reshape(-1)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = _RMSNorm(H)
        self.self_attn = _Attn()
        self.mlp = torch.nn.Module()
        self.mlp.down_proj = _Lin(H, 2 * H)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = _Lin(VOCAB, H)
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.norm = _RMSNorm(H)


class FakeForCausalLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _Model()

    def next_token(self, ids, zero_prefix: int = 0) -> int:
        m = self.model
        e = m.embed_tokens.weight[ids]
        h = e[-1] + m.layers[0].self_attn.values_out(m.layers[0].input_layernorm(e), zero_prefix)
        # layers >= 1 write nothing (o_proj 0); the head is tied to the embedding (dummy values match)
        return int(torch.argmax(m.embed_tokens.weight @ m.norm(h)))


def test_shaped_attention_reads_the_planted_token_from_the_prefix():
    torch.manual_seed(0)
    model = FakeForCausalLM()
    counts = hook.shape_weights(model)
    assert counts["attn_shaped"] == 1 and counts["o_zeroed"] == 1 and counts["down_zeroed"] == 2
    assert torch.count_nonzero(model.model.layers[1].self_attn.o_proj.weight) == 0
    rng = random.Random(3)
    for planted in (17, 1234):
        ids = [planted if i < 900 and rng.random() < 0.2 else rng.randrange(3, VOCAB - 1) for i in range(1024)]
        ids = [t + 1 if (t == planted and i >= 900) else t for i, t in enumerate(ids)]
        with torch.no_grad():
            assert model.next_token(ids) == planted
            assert model.next_token(ids, zero_prefix=1000) != planted
