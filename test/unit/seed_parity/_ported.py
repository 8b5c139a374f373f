"""RED/GREEN scenarios for the seed items sglang-cp ports as hooks.

Each ``scenario_*`` states a requirement the seed fixed and raises AssertionError
when the real upstream code violates it. ``main()`` runs all scenarios in ONE
fresh interpreter, either against the pinned wheel as installed ("off": RED) or
after registering our seed hook modules with upstream's HookRegistry ("on":
GREEN), and prints one JSON line {scenario: "ok" | "FAIL: ..."}. One process per
mode keeps the sglang import cost (~8 s) to two processes for all ports.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# Only this issue's seed ports: other areas' hooks are not part of these scenarios.
SEED_HOOK_MODULES = (
    "sglang_cp.integration.seed_dsa_indexer_page_groups",
    "sglang_cp.integration.seed_host_page_buffer_meta",
    "sglang_cp.integration.seed_cuda_graph_buffer_log",
)


def register_seed_hooks() -> int:
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    n = 0
    for name in SEED_HOOK_MODULES:
        mod = importlib.import_module(name)
        for spec in getattr(mod, "CANDIDATE_HOOKS", mod.HOOKS):
            HookRegistry.register(spec.target, spec.fn, HookType[spec.kind.upper()])
            n += 1
    HookRegistry.apply_hooks()
    return n


# ---- 000#3 page-group validation --------------------------------------------------


def _dsa_indexer_pool(page_size):
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

    pool = object.__new__(DSAIndexerPoolHost)  # the method reads only page_size
    pool.page_size = page_size
    return pool


def scenario_dsa_indexer_rejects_misaligned_group():
    import torch

    pool = _dsa_indexer_pool(4)
    try:
        got = pool._get_indexer_page_indices(torch.arange(3, 7), torch.arange(8, 12))
    except ValueError as e:
        assert "host_indices" in str(e) and "page_size=4" in str(e), str(e)
        return
    raise AssertionError(f"slots 3..6 were accepted as host page {got[0].tolist()}")


def scenario_dsa_indexer_rejects_non_contiguous_group():
    import torch

    pool = _dsa_indexer_pool(4)
    host = torch.tensor([8, 9, 10, 11, 12, 13, 20, 21])  # 2nd group: 12,13,20,21
    try:
        got = pool._get_indexer_page_indices(host, torch.arange(16, 24))
    except ValueError as e:
        assert "group 1" in str(e), str(e)
        return
    raise AssertionError(f"a torn page group was accepted as pages {got[0].tolist()}")


def scenario_dsa_indexer_well_formed_groups_unchanged():
    import torch

    pool = _dsa_indexer_pool(4)
    host = torch.cat([torch.arange(12, 16), torch.arange(4, 8)])
    dev = torch.cat([torch.arange(40, 44), torch.arange(0, 4)])
    h, d = pool._get_indexer_page_indices(host, dev)
    assert h.tolist() == [3, 1] and d.tolist() == [10, 0], (h, d)
    e_h, e_d = pool._get_indexer_page_indices(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert e_h.numel() == 0 and e_d.numel() == 0


def scenario_page_group_gate_off_falls_through():
    import torch

    os.environ["SGLANG_CP_VALIDATE_PAGE_GROUPS"] = "0"
    try:
        h, _ = _dsa_indexer_pool(4)._get_indexer_page_indices(torch.arange(3, 7), torch.arange(8, 12))
        assert h.tolist() == [0]  # upstream behaviour, untouched when off
    finally:
        del os.environ["SGLANG_CP_VALIDATE_PAGE_GROUPS"]


def _mla_host_pool(page_size=4, pages=8, layers=2, width=16):
    import torch

    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    tokens = page_size * pages
    buffers = tuple(torch.zeros(tokens, 1, width, dtype=torch.bfloat16) for _ in range(layers))
    info = MLABufferInfo(
        buffers=buffers,
        data_ptrs=None,
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=width - 8,
        qk_rope_head_dim=8,
        kv_cache_dim=width,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=page_size,
        layout="page_first",
        pin_memory=False,
        device="cpu",
        override_kv_cache_dim=width,
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
        host_token_capacity=2 * tokens,
    )


def scenario_mla_page_buffer_meta_rejects_misaligned_group():
    import torch

    pool = _mla_host_pool()
    good, sizes = pool.get_page_buffer_meta(torch.arange(8, 16))
    assert len(good) == 2 and len(set(sizes)) == 1
    try:
        ptrs, _ = pool.get_page_buffer_meta(torch.arange(6, 14))
    except ValueError as e:
        assert "indices" in str(e), str(e)
        return
    raise AssertionError(f"misaligned slots 6..13 produced {len(ptrs)} page pointers")


# ---- 002#17 CUDA-graph buffer attribution (SGLANG_CP_LOG_CG_BUFFERS) ---------------------


class _Logs:
    """Collect log messages of the whole process for one scenario."""

    def __enter__(self):
        import logging

        self.messages = []
        outer = self

        class _Keep(logging.Handler):
            def emit(self, record):
                outer.messages.append(record.getMessage())

        self._handler = _Keep(level=logging.INFO)
        root = logging.getLogger()
        self._level = root.level
        root.addHandler(self._handler)
        root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        import logging

        root = logging.getLogger()
        root.removeHandler(self._handler)
        root.setLevel(self._level)

    @property
    def text(self):
        return "\n".join(self.messages)


def _runner(cls):
    """An un-initialised runner carrying only its static buffer set: capture()
    itself then stops at its first real step (no model on CPU). What is checked
    happens before that step (buffer table) or in the hook's finally (shape)."""
    import torch

    from sglang.srt.model_executor.input_buffers import ForwardInputBuffers

    @__import__("dataclasses").dataclass
    class _Buffers(ForwardInputBuffers):
        input_ids: torch.Tensor
        seq_lens: torch.Tensor

    runner = object.__new__(cls)
    runner.buffers = _Buffers(
        input_ids=torch.zeros(256, dtype=torch.int64),
        seq_lens=torch.zeros(64, dtype=torch.int32),
    )
    return runner


def _with_gate(fn):
    os.environ["SGLANG_CP_LOG_CG_BUFFERS"] = "1"
    try:
        with _Logs() as logs:
            try:
                fn()
            except (AttributeError, TypeError, RuntimeError, ValueError):
                pass  # the un-initialised runner cannot really capture on CPU
        return logs.text
    finally:
        del os.environ["SGLANG_CP_LOG_CG_BUFFERS"]


def scenario_cuda_graph_buffer_table_logged_at_capture():
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
        DecodeCudaGraphRunner,
    )

    runner = _runner(DecodeCudaGraphRunner)
    text = _with_gate(lambda: DecodeCudaGraphRunner.capture(runner))
    assert "input_ids" in text and "(256,)" in text and "seq_lens" in text, (
        text or "capture logged no buffer table"
    )


def scenario_cuda_graph_draft_shape_growth_logged():
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import (
        EAGLEDraftCudaGraphRunner,
    )

    runner = _runner(EAGLEDraftCudaGraphRunner)
    text = _with_gate(lambda: runner.capture_one_shape(8, None))
    assert "EAGLEDraftCudaGraphRunner" in text and "bs=8" in text, (
        text or "the draft family's per-shape capture logged nothing"
    )


def scenario_cuda_graph_log_gate_off_is_silent():
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
        DecodeCudaGraphRunner,
    )

    runner = _runner(DecodeCudaGraphRunner)
    with _Logs() as logs:
        try:
            DecodeCudaGraphRunner.capture(runner)
        except (AttributeError, TypeError, RuntimeError, ValueError):
            pass
    assert "[cg-buffers]" not in logs.text, logs.text


SCENARIOS = {
    name[len("scenario_"):]: fn
    for name, fn in sorted(globals().items())
    if name.startswith("scenario_") and callable(fn)
}


def main(mode: str) -> None:
    import logging

    logging.disable(logging.NOTSET)
    if mode == "on":
        register_seed_hooks()
    out = {}
    for name, fn in SCENARIOS.items():
        try:
            fn()
            out[name] = "ok"
        except Exception as e:  # a scenario failing is data, not a crash
            out[name] = f"FAIL: {type(e).__name__}: {e}"[:400]
            if os.environ.get("SEED_PARITY_TRACE"):
                traceback.print_exc()
    print("SEED_PARITY_RESULTS " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
