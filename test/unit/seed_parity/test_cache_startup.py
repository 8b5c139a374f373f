"""CP-HiCache seed items outside the tiers, already upstream in 0.5.23.

- 000#2 draft/MTP KV persisted alongside target KV in HiCache (packed MTP layers)
- 000#3 (startup part) unsupported CP-HiCache backend/layout combinations refused
- 002#24 HiCacheController.tp_rank crash: no upstream reader of that attribute
"""

from __future__ import annotations

import ast
import json
import os
import pathlib

import pytest
import torch

SGLANG_SRT = pathlib.Path(__import__("sglang").__file__).parent / "srt"

# A tiny DeepSeek-V3.2-class (DSA) config: enough for upstream's ModelConfig.
DSA_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 64,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "index_topk": 64,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "rope_theta": 10000,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def dsa_model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsa_model")
    (d / "config.json").write_text(json.dumps(DSA_CONFIG))
    return str(d)


def _shard_args(model_dir, *extra):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(
        [
            "--model-path", model_dir,
            "--enable-kv-cache-sharding",
            "--disaggregation-mode", "prefill",
            "--enable-hierarchical-cache",
            "--attention-backend", "dsa",
            *extra,
        ]
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        ((), None),
        (("--hicache-storage-backend", "file"), "not --hicache-storage-backend"),
        (("--hicache-io-backend", "direct"), "requires kernel I/O"),
        (("--hicache-mem-layout", "page_first_direct"), "requires kernel I/O"),
        (("--hicache-mem-layout", "page_first_kv_split"), "requires kernel I/O"),
    ],
)
def test_cp_sharded_hicache_combinations_checked_at_startup(
    dsa_model_dir, monkeypatch, extra, message
):
    from sglang.srt.arg_groups.kv_shard_hook import handle_kv_cache_sharding

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = _shard_args(dsa_model_dir, *extra)
    if message is None:
        # A supported combination passes every HiCache check; on this CPU box
        # the later attention-backend check (needs CUDA interleave CP) stops it.
        with pytest.raises(ValueError) as e:
            handle_kv_cache_sharding(args, gpu_mem=80.0)
        assert "hicache" not in str(e.value).lower(), str(e.value)
        assert "DSA KV sharding requires CUDA" in str(e.value)
    else:
        with pytest.raises(ValueError, match=message):
            handle_kv_cache_sharding(args, gpu_mem=80.0)


def _mla_info(buffers, layers, device_layer_num, ps, width):
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo

    return MLABufferInfo(
        buffers=tuple(buffers),
        data_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64),
        layer_indices=tuple(layers),
        device_layer_num=device_layer_num,
        page_size=ps,
        kv_lora_rank=width - 8,
        qk_rope_head_dim=8,
        kv_cache_dim=width,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_host_pool_packs_draft_kv_with_target_kv(layout):
    """One host page carries the target layers AND the MTP draft layer, so the
    draft KV of a cached prefix survives L1 eviction together with the target
    KV (and travels to storage in the same page)."""
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    ps, tokens, width = 4, 32, 16
    target = [torch.zeros(tokens, 1, width, dtype=torch.bfloat16) for _ in range(2)]
    draft = [torch.zeros(tokens, 1, width, dtype=torch.bfloat16)]
    host = MLATokenToKVPoolHost(
        _mla_info(target, [0, 1], 2, ps, width),
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=ps,
        layout=layout,
        pin_memory=False,
        device="cpu",
        override_kv_cache_dim=width,
        draft_buffer_infos=(_mla_info(draft, [0], 1, ps, width),),
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=2,
        target_layer_num=2,
        host_token_capacity=2 * tokens,
    )
    assert host.layer_num == 3
    # controller layer 2 (first layer after the target's device layers) is the draft
    assert host._host_layer_by_controller[2] == 2
    assert host.get_size_per_token() == 3 * width * 2

    slots = host.alloc(2 * ps)
    src, dst = int(slots[0]), int(slots[ps])
    layer_axis = 1 if layout == "page_first" else 0
    draft_rows = host.kv_buffer.select(layer_axis, 2)
    draft_rows[src : src + ps] = 7.0  # marks only the draft layer of page src
    page = host.get_data_page(src, flat=True)
    host.set_from_flat_data_page(dst, page)
    restored = host.kv_buffer.select(layer_axis, 2)[dst : dst + ps]
    assert bool((restored == 7.0).all())
    assert bool((host.kv_buffer.select(layer_axis, 0)[dst : dst + ps] == 0).all())


def _attribute_reads(tree, owner, attr):
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == attr
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == owner
        ):
            yield node.lineno


def test_no_upstream_code_reads_cache_controller_tp_rank():
    """The seed crash was a CP metrics path reading cache_controller.tp_rank,
    an attribute only set inside the storage-config branch. In 0.5.23 nothing
    reads it (metrics take ranks from get_parallel()), so the crash has no
    upstream path; our own CP-L3 metrics (#5) must not read it either."""
    hits = []
    for path in SGLANG_SRT.rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "cache_controller" not in text or "tp_rank" not in text:
            continue  # cannot contain the read; parsing all 2k files costs ~15 s
        tree = ast.parse(text)
        for line in _attribute_reads(tree, "cache_controller", "tp_rank"):
            hits.append(f"{path.relative_to(SGLANG_SRT)}:{line}")
    assert hits == []
    from sglang.srt.managers.cache_controller import HiCacheController

    src = ast.parse(pathlib.Path(__import__("inspect").getfile(HiCacheController)).read_text())
    init_sets = [
        n.attr
        for n in ast.walk(src)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr == "tp_rank"
    ]
    assert init_sets == []  # the attribute is not there to read


def test_our_package_never_reads_cache_controller_tp_rank():
    root = pathlib.Path(__import__("sglang_cp").__file__).parent
    hits = [
        f"{p.relative_to(root)}:{line}"
        for p in root.rglob("*.py")
        for line in _attribute_reads(ast.parse(p.read_text()), "cache_controller", "tp_rank")
    ]
    assert hits == []
