"""000#3 on CUDA: the page-group check on the path CP-sharded DSA HiCache takes.

Real CUDA ``DSATokenToKVPool`` + pinned ``MLATokenToKVPoolHost`` / ``DSAIndexerPoolHost``
in a ``HostPoolGroup`` (optionally behind ``PageInterleaveHostPool``), the real
``HybridCacheController.move_hybrid_indices`` with ``io_backend="kernel"`` moving the
host indices to the GPU, then the real sgl_kernel indexer copy
(``DSAIndexerPoolHost.load_to_device_per_layer``); and the MLA direct copy
(``transfer_kv_direct(page_size=64)``) with CPU indices.

Each mode runs in a fresh interpreter (``HookRegistry.apply_hooks`` patches the
process): ``off`` = pinned sglang alone (the control: the torn group reaches the
kernels without error), ``on`` = the sglang-cp plugin registered (the torn group
is refused before any copy, on every CP rank; well-formed pages copy the right
bytes). Skips without CUDA or without sglang. Runs in well under a minute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SEED_PARITY = os.path.join(REPO, "test", "unit", "seed_parity")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _chain(mode: str) -> dict:
    """Runs in the child. Returns {case: "ok" | "raised: ..." | "silent: ..."}."""
    sys.path.insert(0, SEED_PARITY)
    import _ported

    if mode == "on":
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sglang_cp import plugin

        assert plugin.register(), plugin.status()
        HookRegistry.apply_hooks()

    out = {}
    # Every stack stays referenced until the child exits: upstream's host pools register
    # their buffers with cudaHostRegister and only destroy() unregisters them, so a freed
    # pool's memory handed to the next pool fails with 712 (already registered; seen on
    # the H200, where the fourth stack of this chain reused the first one's memory).
    alive = []
    torn = _ported._torn_dsa_group()  # page 3, then page 1 backwards
    good = torch.cat([torch.arange(192, 256), torch.arange(128, 192)])  # pages 3, 2
    dev_slots = torch.arange(256, 384, device="cuda")  # device pages 4, 5

    with _ported._parallel():
        for shard_size in (1, 2):
            for rank in range(shard_size):
                case = f"kernel_io_torn[cp{shard_size}.rank{rank}]"
                _, _, indexer, group = _ported._dsa_stack(
                    shard_size=shard_size, shard_rank=rank, device="cuda"
                )
                alive.append(group)
                target = group.anchor_entry.device_pool
                ctrl = _ported._kernel_io_controller(group, shard_size > 1, device="cuda")
                try:
                    h, d, transfers = ctrl.move_hybrid_indices(_ported._indexer_op(torn, dev_slots))
                    for t in transfers:
                        if t.name.value == "indexer":
                            indexer.load_to_device_per_layer(
                                target, t.host_indices, t.device_indices, 0, "kernel"
                            )
                    torch.cuda.synchronize()
                    out[case] = f"silent: host on {h.device}, {len(transfers)} indexer transfer(s) copied"
                except Exception as e:  # ours is a ValueError (PageGroupError); report any other
                    out[case] = f"raised: {type(e).__name__}: {e}"

        # Well-formed pages: moved, copied by the real kernel, right bytes in the right pages.
        _, _, indexer, group = _ported._dsa_stack(device="cuda")
        alive.append(group)
        target = group.anchor_entry.device_pool
        for page in range(indexer.index_k_with_scale_buffer.shape[1]):
            indexer.index_k_with_scale_buffer[:, page].fill_(page)
        ctrl = _ported._kernel_io_controller(group, False, device="cuda")
        h, d, transfers = ctrl.move_hybrid_indices(_ported._indexer_op(good, dev_slots))
        assert h.is_cuda, h.device
        t = [t for t in transfers if t.name.value == "indexer"][0]
        indexer.load_to_device_per_layer(target, t.host_indices, t.device_indices, 0, "kernel")
        torch.cuda.synchronize()
        got = target.index_k_with_scale_buffer[0][4:6, :8].cpu().tolist()
        out["kernel_io_well_formed"] = "ok" if got == [[3] * 8, [2] * 8] else f"wrong bytes: {got}"

        # MLA direct copy with the real sgl_kernel transfer_kv_direct (CPU indices, page_size=64).
        target, kv, _, group = _ported._dsa_stack(layout="layer_first", device="cuda")
        alive.append(group)
        try:
            kv.load_to_device_per_layer(target, torn, torch.arange(256, 384), 0, "direct")
            torch.cuda.synchronize()
            out["mla_direct_torn"] = "silent: transfer_kv_direct ran on a torn group"
        except Exception as e:
            out["mla_direct_torn"] = f"raised: {type(e).__name__}: {e}"
        kv.kv_buffer[0].zero_()
        kv.kv_buffer[0][192:256].fill_(3.0)
        kv.kv_buffer[0][128:192].fill_(2.0)
        kv.load_to_device_per_layer(target, good, torch.arange(256, 384), 0, "direct")
        torch.cuda.synchronize()
        dev = target.kv_buffer[0]
        ok = bool((dev[256:320] == 3.0).all()) and bool((dev[320:384] == 2.0).all())
        out["mla_direct_well_formed"] = "ok" if ok else "wrong rows after transfer_kv_direct"
    return out


def _run(mode: str) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("SGLANG_CP_VALIDATE_PAGE_GROUPS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(REPO, "python"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), mode],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=240,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("CHAIN ")]
    assert lines, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    got = json.loads(lines[-1][len("CHAIN "):])
    assert "_error" not in got, f"the {mode!r} child failed:\n{got['_error']}\n{proc.stderr[-2000:]}"
    return got


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
    pytest.importorskip("sgl_kernel")
    return {mode: _run(mode) for mode in ("off", "on")}


def test_control_torn_group_reaches_the_cuda_kernels_without_the_plugin(results):
    off = results["off"]
    # rank 0 of 2 owns neither page, so it moves nothing: only the owner sees the rows.
    assert off["kernel_io_torn[cp1.rank0]"].startswith("silent"), off
    assert off["kernel_io_torn[cp2.rank1]"].startswith("silent"), off
    assert off["mla_direct_torn"].startswith("silent"), off
    assert off["kernel_io_well_formed"] == "ok" and off["mla_direct_well_formed"] == "ok", off


def test_plugin_refuses_torn_group_on_every_rank_before_any_copy(results):
    on = results["on"]
    for case in ("kernel_io_torn[cp1.rank0]", "kernel_io_torn[cp2.rank0]", "kernel_io_torn[cp2.rank1]"):
        assert on[case].startswith("raised: PageGroupError") and "host_indices" in on[case], (case, on[case])
    assert on["mla_direct_torn"].startswith("raised: PageGroupError"), on


def test_plugin_leaves_well_formed_pages_byte_exact(results):
    on = results["on"]
    assert on["kernel_io_well_formed"] == "ok", on
    assert on["mla_direct_well_formed"] == "ok", on


if __name__ == "__main__":
    # Report a failure of the child as data: each test then shows which step broke and how
    # (the traceback), instead of only the fixture's "rc=1".
    try:
        print("CHAIN " + json.dumps(_chain(sys.argv[1])))
    except BaseException:
        import traceback

        print("CHAIN " + json.dumps({"_error": traceback.format_exc()[-4000:]}))
        raise
