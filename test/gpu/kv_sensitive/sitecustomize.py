"""Test-only weight shaping for the real-server GPU tests: a dummy-weight DeepSeek-family (MLA, DSA)
model whose next token is read from its KV cache, and an MTP draft that agrees with it.

Why: ``--load-format dummy`` draws every weight from U(-1e-3, 1e-3), so each layer adds about 3e-4
of the embedding to the residual stream, below bf16's resolution. The next token is then a
function of the current token alone: output ids match whatever KV the prefix had, and the NextN
draft (a random projection) never agrees with its target, so the accept length is 1.0 whatever
the draft KV holds. Neither "same ids" nor "same accept length" could fail.

The shaped model predicts the prompt's most frequent token (its "mode", which the tests plant at
a high density), read from layer 0's KV of the prefix. Set after upstream's
``initialize_dummy_weights`` and before its ``post_load_weights`` (which derives the absorbed MLA
weights from ``kv_b_proj``), identically for target layer 0 and the NextN draft's decoder layer:
- norms weight 1 / bias 0 (unit-scale activations, as in a trained model);
- every MLP / expert down projection 0, and ``o_proj`` 0 in target layers >= 1: only layer 0's
  attention writes to the residual stream;
- the latent rows of ``fused_qkv_a_proj_with_mqa`` are an orthonormal basis Q (512 x hidden), head
  0's value rows of ``kv_b_proj`` take the first 256 latent dims, the other heads' values are 0,
  and head 0's ``o_proj`` columns are GAIN * Q[:256]^T: the attention output is GAIN times the
  projection of the mean prefix embedding onto span(Q[:256]). Queries and keys keep their tiny
  dummy weights, so attention is near-uniform; the DSA indexer's head weights are 0, so its top-k
  is content-blind. ``lm_head`` equals ``embed_tokens`` (dummy values depend only on the shape),
  so the logit of token j is about j's share of the prefix: the mode wins by a wide margin;
- NextN: ``eh_proj`` passes the next token's embedding through (the target-hidden half is 0).
  At position t the draft computes what target layer 0 computes at t + 1, over its own KV of the
  prefix: with that KV right it proposes the mode; with it missing, something else.

``SGLANG_CP_TEST_DRAFT_HICACHE=off`` is the RED seam of the MTP test: upstream's HiCache draft
plan is forced to "none", so the draft layer's KV is neither backed up nor restored with the
target's (what the seeds warn "can silently reduce MTP accept length").
``SGLANG_CP_TEST_LOCKSTEP=off`` is the RED seam of the indexer-damage test: our backend reports
every indexer-K page read as good, so a page whose indexer blob failed its CRC would be served
from its KV alone (with whatever the host pool's indexer rows held).

Active only in processes started with ``SGLANG_CP_TEST_KV_SENSITIVE=1`` and this directory on
``PYTHONPATH`` (``server_support.dsa_env``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_LOADER = "sglang.srt.model_loader.loader"
_SPEC = "sglang.srt.speculative.base_spec_worker"
_BACKEND = "sglang_cp.integration.cp_l3.backend"
GAIN = float(os.environ.get("SGLANG_CP_TEST_KV_GAIN", "3"))
EMBED_RMS = 1e-3 / 3 ** 0.5  # RMS of U(-1e-3, 1e-3): the draft's pass-through keeps the embedding's scale
VALUE_DIMS = 256
_SEED = 20261201


def _basis(rows: int, cols: int, dtype, device):
    import torch

    g = torch.Generator().manual_seed(_SEED)
    q, _ = torch.linalg.qr(torch.randn(cols, rows, generator=g, dtype=torch.float64))
    return q.T.contiguous().to(device=device, dtype=dtype)  # rows orthonormal


def _shape_attention(attn, gain: float) -> None:
    kv_lora, nope, v = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.v_head_dim
    qkv_a = attn.fused_qkv_a_proj_with_mqa.weight  # [q_lora | kv_lora | rope] x hidden
    q_lora = qkv_a.shape[0] - kv_lora - attn.qk_rope_head_dim
    hidden = qkv_a.shape[1]
    basis = _basis(kv_lora, hidden, qkv_a.dtype, qkv_a.device)
    qkv_a[q_lora:q_lora + kv_lora].copy_(basis)
    kv_b = attn.kv_b_proj.weight  # heads x [k_nope | v] rows, kv_lora columns
    heads = kv_b.shape[0] // (nope + v)
    vd = min(VALUE_DIMS, v, kv_lora)
    for h in range(heads):
        rows = kv_b[h * (nope + v) + nope:(h + 1) * (nope + v)]
        rows.zero_()
        if h == 0:
            rows[:vd, :vd].copy_(torch_eye(vd, rows))
    o = attn.o_proj.weight  # hidden x (heads * v)
    o.zero_()
    o[:, :vd].copy_(basis[:vd].T * gain)
    idx = getattr(attn, "indexer", None)
    if idx is not None:
        if getattr(idx, "wk_weights_proj", None) is not None:
            idx.wk_weights_proj.weight[idx.head_dim:].zero_()
        elif getattr(idx, "weights_proj", None) is not None:
            idx.weights_proj.weight.zero_()


def torch_eye(n, like):
    import torch

    return torch.eye(n, dtype=like.dtype, device=like.device)


def shape_weights(model) -> dict:
    import torch

    is_draft = "NextN" in type(model).__name__
    counts = {"norms": 0, "down_zeroed": 0, "attn_shaped": 0, "o_zeroed": 0, "eh_proj": 0}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if "norm" in type(mod).__name__.lower() or name.rsplit(".", 1)[-1].endswith("norm"):
                w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
                if isinstance(w, torch.nn.Parameter) and w.is_floating_point():
                    w.fill_(1.0)
                    counts["norms"] += 1
                if isinstance(b, torch.nn.Parameter):
                    b.zero_()
        for name, p in model.named_parameters():
            if p.is_floating_point() and ("down_proj" in name or name.endswith("w2_weight")):
                p.zero_()
                counts["down_zeroed"] += 1
        for name, mod in model.named_modules():
            if not name.endswith("self_attn") or not hasattr(mod, "kv_b_proj"):
                continue
            if is_draft or name.endswith("layers.0.self_attn"):
                _shape_attention(mod, GAIN)
                counts["attn_shaped"] += 1
            else:
                mod.o_proj.weight.zero_()
                counts["o_zeroed"] += 1
        eh = getattr(getattr(model, "model", None), "eh_proj", None)
        if eh is not None:
            w = eh.weight
            h = w.shape[0]
            w.zero_()
            w[:, :h].copy_(torch_eye(h, w) * EMBED_RMS)
            counts["eh_proj"] += 1
    if counts["attn_shaped"] != 1 or (is_draft and counts["eh_proj"] != 1):
        # A renamed upstream module would silently leave the model insensitive again.
        raise RuntimeError(f"kv_sensitive: unexpected module names in {type(model).__name__}: {counts}")
    print(f"kv_sensitive: shaped {type(model).__name__} (gain {GAIN:g}): {counts}", file=sys.stderr, flush=True)
    return counts


def _patch_loader(module) -> None:
    original = module.initialize_dummy_weights

    def initialize_dummy_weights(model, *args, **kwargs):
        original(model, *args, **kwargs)
        shape_weights(model)

    module.initialize_dummy_weights = initialize_dummy_weights


def _patch_spec(module) -> None:
    def no_draft_plan(self):
        runner = self.target_worker.model_runner
        runner.mtp_draft_device_pools = ()
        runner.mtp_draft_mamba_pools = ()
        print("kv_sensitive: HiCache draft plan forced to none (RED seam)", file=sys.stderr, flush=True)
        return module.HiCacheDraftPlan()

    module.BaseSpecWorker._build_hicache_draft_plan = no_draft_plan


def _patch_backend(module) -> None:
    original = module.CpL3Storage._get

    def _get(self, payload, keys, host_indices):
        results = original(self, payload, keys, host_indices)
        if payload == "indexer":
            print("kv_sensitive: indexer reads reported good (RED seam)", file=sys.stderr, flush=True)
            return [True] * len(results)
        return results

    module.CpL3Storage._get = _get


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, fullname, path=None, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        inner = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                inner.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


if os.environ.get("SGLANG_CP_TEST_KV_SENSITIVE") == "1":
    _patches = {_LOADER: _patch_loader}
    if os.environ.get("SGLANG_CP_TEST_DRAFT_HICACHE") == "off":
        _patches[_SPEC] = _patch_spec
    if os.environ.get("SGLANG_CP_TEST_LOCKSTEP") == "off":
        _patches[_BACKEND] = _patch_backend
    sys.meta_path.insert(0, _PatchOnImport(_patches))
