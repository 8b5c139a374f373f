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
    "sglang_cp.integration.compute.dsa_indexer_page_groups",
    "sglang_cp.integration.compute.host_page_buffer_meta",
    "sglang_cp.integration.compute.cuda_graph_buffer_log",
    "sglang_cp.integration.compute.move_page_groups",
    "sglang_cp.integration.compute.mla_direct_copy_page_groups",
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


# ---- 000#3 on the path CP-sharded DSA takes: kernel I/O through the hybrid controller ----
#
# Real DSATokenToKVPool (CPU) -> real MLATokenToKVPoolHost + DSAIndexerPoolHost in a real
# HostPoolGroup, optionally behind a real PageInterleaveHostPool (CP sharding), and the
# real HybridCacheController.move_hybrid_indices with io_backend="kernel". The meta device
# stands in for CUDA: move_indices moves the host indices there exactly as it would to the
# GPU, after which a host-mode check can no longer see them without a device sync.

DSA_PS = 64  # DSA requires 64-token physical pages


def _dsa_stack(layout="layer_first", shard_size=1, shard_rank=0, device="cpu"):
    import torch

    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    target = DSATokenToKVPool(
        size=DSA_PS * 16, page_size=DSA_PS, kv_lora_rank=512, dtype=torch.bfloat16,
        qk_rope_head_dim=64, layer_num=2, device=device, index_head_dim=128,
        enable_memory_saver=False, kv_cache_dim=576,
    )
    pin = device != "cpu"  # a CUDA device pool copies from pinned host buffers
    kv = MLATokenToKVPoolHost(
        target._mla_buffer_info(), 2.0, 0, DSA_PS, layout, pin_memory=pin, device="cpu",
        device_capacity_tokens=target.size, start_layer=0, end_layer=1, target_layer_num=2,
        host_token_capacity=DSA_PS * 32,
    )
    indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(target), kv, pin_memory=pin, device="cpu")
    anchor = kv
    if shard_size > 1:
        from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
        from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

        spec = PageShardSpec(shard_rank=shard_rank, shard_size=shard_size, page_size=DSA_PS,
                             max_prefix_tokens=0, chunk_tokens=0)
        anchor = PageInterleaveHostPool(kv, PageInterleavePlacement(spec))
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, anchor, target, lambda l: l, is_primary_index_anchor=True),
        PoolEntry(PoolName.INDEXER, indexer, target, lambda l: l),
    ])
    return target, kv, indexer, group


def _kernel_io_controller(group, sharded, device="meta"):
    import torch

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    ctrl = object.__new__(HybridCacheController)  # move_hybrid_indices reads only these
    ctrl.mem_pool_host = group
    ctrl.io_backend = "kernel"
    ctrl.device = torch.device(device)  # "meta" stands in for CUDA on a CPU machine
    ctrl.is_kv_sharded = sharded
    return ctrl


def _indexer_op(host, device):
    from sglang.srt.managers.cache_controller import CacheOperation
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return CacheOperation(host, device, node_id=0, pool_transfers=[
        PoolTransfer(PoolName.INDEXER, host_indices=host, device_indices=device,
                     indices_from_pool=PoolName.KV),
    ])


def _torn_dsa_group():
    """Two logical pages' worth of slots: page 3 in order, then page 1 written
    backwards (127..64). The count is right, so upstream derives pages [3, 1] and
    copies page 1 in forward order: every row of it lands in the mirrored slot.
    Under CP sharding over 2 ranks both pages belong to rank 1: rank 0 sees no
    rows at all, so only a check on the logical indices is rank-uniform."""
    import torch

    return torch.cat([torch.arange(192, 256), torch.arange(127, 63, -1)])


def _parallel():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(tp_size=1, moe_tp_size=1, attn_tp_size=1, attn_cp_size=1,
                                   attn_dcp_size=1)


def _kernel_io_rejects_torn_group(shard_size):
    import torch

    silent = []
    with _parallel():
        for rank in range(shard_size):
            _, _, indexer, group = _dsa_stack(shard_size=shard_size, shard_rank=rank)
            ctrl = _kernel_io_controller(group, sharded=shard_size > 1)
            try:
                h, d, transfers = ctrl.move_hybrid_indices(
                    _indexer_op(_torn_dsa_group(), torch.arange(256, 384))
                )
            except ValueError as e:
                assert "host_indices" in str(e) and f"page_size={DSA_PS}" in str(e), str(e)
                continue
            # What the indexer transfer then does with the moved indices (the first
            # step of its per-layer load): page ids derived without error.
            idx = [t for t in transfers if t.name.value == "indexer"]
            pages = (
                indexer._get_indexer_page_indices(idx[0].host_indices, idx[0].device_indices)[0]
                if idx else torch.empty(0)
            )
            silent.append(f"rank {rank}: host on {h.device}, {pages.numel()} indexer page id(s)")
    if silent:
        raise AssertionError(
            "a torn host page group passed move_hybrid_indices under kernel I/O without error: "
            + "; ".join(silent)
        )


def scenario_kernel_io_dsa_rejects_torn_host_group_before_move():
    _kernel_io_rejects_torn_group(shard_size=1)


def scenario_kernel_io_cp_sharded_dsa_rejects_torn_host_group_on_every_rank():
    _kernel_io_rejects_torn_group(shard_size=2)


def scenario_kernel_io_well_formed_groups_unchanged():
    import torch

    with _parallel():
        for shard_size, rank, rows in ((1, 0, 128), (2, 0, 64), (2, 1, 64)):
            _, _, indexer, group = _dsa_stack(shard_size=shard_size, shard_rank=rank)
            ctrl = _kernel_io_controller(group, sharded=shard_size > 1)
            host = torch.cat([torch.arange(192, 256), torch.arange(128, 192)])  # pages 3, 2
            h, d, transfers = ctrl.move_hybrid_indices(_indexer_op(host, torch.arange(0, 128)))
            assert h.device.type == "meta" and h.numel() == rows, (shard_size, rank, h)
            assert [t.host_indices.numel() for t in transfers] == [rows], transfers


def _direct_copy_recorder(monkey_module):
    calls = []

    def transfer_kv_direct(**kwargs):
        calls.append({k: v.tolist() for k, v in kwargs.items() if k.endswith("indices")})

    monkey_module.transfer_kv_direct = transfer_kv_direct  # sgl_kernel's copy is absent on CPU
    return calls


def scenario_mla_direct_copy_rejects_torn_group():
    import torch

    from sglang.srt.mem_cache.pool_host import mla

    had = hasattr(mla, "transfer_kv_direct")
    saved = getattr(mla, "transfer_kv_direct", None)
    try:
        with _parallel():
            target, kv, _, _ = _dsa_stack(layout="layer_first")
            calls = _direct_copy_recorder(mla)
            host = _torn_dsa_group()
            device = torch.arange(256, 384)
            try:
                kv.load_to_device_per_layer(target, host, device, 0, "direct")
            except ValueError as e:
                assert "host_indices" in str(e) and not calls, (str(e), len(calls))
            else:
                raise AssertionError(
                    f"a torn host group reached transfer_kv_direct(page_size={kv.page_size}) "
                    f"{len(calls)} time(s) on the direct-I/O load"
                )
            calls.clear()
            try:
                kv.backup_from_device_all_layer(target, host, device, "direct")
            except ValueError as e:
                assert "host_indices" in str(e) and not calls, (str(e), len(calls))
            else:
                raise AssertionError(
                    f"a torn host group reached transfer_kv_direct {len(calls)} time(s) on the "
                    "direct-I/O backup"
                )
    finally:
        if had:
            mla.transfer_kv_direct = saved
        elif hasattr(mla, "transfer_kv_direct"):
            del mla.transfer_kv_direct


def scenario_mla_direct_copy_well_formed_groups_unchanged():
    import torch

    from sglang.srt.mem_cache.pool_host import mla

    had = hasattr(mla, "transfer_kv_direct")
    saved = getattr(mla, "transfer_kv_direct", None)
    try:
        with _parallel():
            target, kv, _, _ = _dsa_stack(layout="layer_first")
            calls = _direct_copy_recorder(mla)
            host = torch.cat([torch.arange(192, 256), torch.arange(64, 128)])
            kv.load_to_device_per_layer(target, host, torch.arange(0, 128), 0, "direct")
            kv.backup_from_device_all_layer(target, host, torch.arange(0, 128), "direct")
            assert len(calls) == 2 and calls[0]["src_indices"] == host.tolist(), calls[:1]
    finally:
        if had:
            mla.transfer_kv_direct = saved
        elif hasattr(mla, "transfer_kv_direct"):
            del mla.transfer_kv_direct


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


def _profile_dump_two_families(workdir):
    """Run upstream's real _post_process_after_profile for the decode family and
    then the EAGLE draft family, as --enable-profile-cuda-graph does at startup.
    Only torch's CUDA memory-snapshot writer is replaced (it needs a CUDA
    allocator): it writes a pickle naming the family that dumped it."""
    import pickle
    import types

    import torch

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
        DecodeCudaGraphRunner,
    )
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import (
        EAGLEDraftCudaGraphRunner,
    )

    current = {}
    saved = (torch.cuda.memory._dump_snapshot, torch.cuda.memory._record_memory_history)

    def dump(path):
        with open(path, "wb") as f:
            pickle.dump({"family": current["family"]}, f)

    torch.cuda.memory._dump_snapshot = dump
    torch.cuda.memory._record_memory_history = lambda *a, **k: None
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        for cls in (DecodeCudaGraphRunner, EAGLEDraftCudaGraphRunner):
            runner = _runner(cls)
            runner.model_runner = types.SimpleNamespace(is_draft_worker=False)  # read for the trace name
            current["family"] = cls.__name__
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                torch.ones(4).sum()
            cls._post_process_after_profile(runner, prof)
        found = {}
        for name in sorted(os.listdir(workdir)):
            with open(os.path.join(workdir, name), "rb") as f:
                found[name] = pickle.load(f)["family"]
        return found
    finally:
        os.chdir(cwd)
        torch.cuda.memory._dump_snapshot, torch.cuda.memory._record_memory_history = saved


def scenario_cuda_graph_profile_pickle_per_family():
    import tempfile

    os.environ["SGLANG_CP_LOG_CG_BUFFERS"] = "1"
    try:
        with tempfile.TemporaryDirectory() as d:
            found = _profile_dump_two_families(d)
    finally:
        del os.environ["SGLANG_CP_LOG_CG_BUFFERS"]
    assert found == {
        "cuda_graph_mem_DecodeCudaGraphRunner.pickle": "DecodeCudaGraphRunner",
        "cuda_graph_mem_EAGLEDraftCudaGraphRunner.pickle": "EAGLEDraftCudaGraphRunner",
    }, f"memory snapshots on disk after two families: {found}"


def scenario_cuda_graph_profile_pickle_gate_off_is_upstream():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        found = _profile_dump_two_families(d)
    # Upstream's file name, last family wins (the behaviour a user of the plain flag sees).
    assert found == {"cuda_graph_runner_memory_usage.pickle": "EAGLEDraftCudaGraphRunner"}, found


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
