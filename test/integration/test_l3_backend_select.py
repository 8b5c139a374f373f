"""--enable-cp-l3 selects our store, and lifts upstream's sharding refusal for ours only.

Upstream's ``handle_kv_cache_sharding`` step refuses any storage backend before it needs
a model config, so the refusal itself can run with the dummy model: we run the real
resolution step (with the plugin's wrappers) after ``resolve_once``'s dummy short circuit.
"""

import textwrap

import pytest

from suite_helpers import run_py

CODE = textwrap.dedent(
    """
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.arg_groups.resolution_hooks import run_hook
    from sglang.srt.arg_groups.kv_shard_hook import handle_kv_cache_sharding
    from sglang.srt.arg_groups.overrides import resolving_view
    argv = ["--model-path", "dummy", "--device", "cpu", "--enable-hierarchical-cache",
            "--enable-kv-cache-sharding", "--disaggregation-mode", "prefill"] + json.loads(sys.argv[1])
    sa = prepare_server_args(argv)
    sa.resolve_once()
    try:
        run_hook(handle_kv_cache_sharding, sa)
        print("STEP passed")
    except Exception as e:
        print("STEP", type(e).__name__, str(e).replace("\\n", " ")[:300])
    cfg = resolving_view(sa)
    print("BACKEND", cfg.hicache_storage_backend, cfg.hicache_storage_backend_extra_config)
    from sglang.srt.environ import envs
    print("TREE", envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.get())
    """
)
REFUSAL = "not --hicache-storage-backend yet"


def run_step(extra, env=None, want="BACKEND"):
    import json

    p = run_py(f"import sys; sys.argv=['x', {json.dumps(json.dumps(extra))}]\n" + CODE,
               env_extra={"HF_HUB_OFFLINE": "1", **(env or {})})
    lines = {ln.split(" ", 1)[0]: ln for ln in p.stdout.splitlines() if ln.startswith(("STEP", "BACKEND", "TREE"))}
    assert "STEP" in lines, p.stdout + p.stderr
    return lines["STEP"], lines[want]


def test_upstream_still_refuses_other_backends_under_sharding():
    step, backend = run_step(["--hicache-storage-backend", "file"])
    assert REFUSAL in step
    assert backend.startswith("BACKEND file")


def test_our_backend_is_selected_and_passes_the_sharding_refusal(disk_tmp):
    from sglang_cp.cli import write_demo_config

    cfg = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    step, backend = run_step(["--enable-cp-l3", "--cp-l3-config", cfg])
    # Past the refusal, upstream's next check needs the model's config (dummy has none):
    # the point is that the storage refusal did not fire.
    assert REFUSAL not in step
    assert backend.startswith("BACKEND dynamic") and '"backend_name": "sglang_cp_l3"' in backend
    assert '"interface_v1": 1' in backend and cfg in backend


def test_kv_sharding_runs_the_python_tree_core_which_our_tree_core_hooks_hook(disk_tmp, monkeypatch):
    """Our restore path hooks upstream's Python ``UnifiedTreeCore`` (``prefetch_anchor_info``,
    ``insert_host``), not the Rust core upstream uses by default where its extension loads: the hooks only
    act under KV sharding, and upstream's sharding step selects the Python core there and refuses another.
    If upstream ever lets a sharded server run the Rust core, this fails and the hooks must follow it."""
    from sglang.srt.environ import envs

    from sglang_cp.cli import write_demo_config

    assert envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.default == "rust"  # unsharded servers: no phase to keep
    cfg = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    ours = ["--enable-cp-l3", "--cp-l3-config", cfg]
    monkeypatch.delenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", raising=False)
    _step, tree = run_step(ours, want="TREE")
    assert tree == "TREE python"
    step, _tree = run_step(ours, env={"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "rust"}, want="TREE")
    assert "requires the Python UnifiedTreeCore" in step


def test_upstreams_prefetch_settings_pass_through_into_our_config(disk_tmp):
    """--hicache-storage-backend-extra-config with --enable-cp-l3 carries upstream's prefetch settings (its
    controller pops them before any backend sees the rest); they were silently dropped before."""
    from sglang_cp.cli import write_demo_config

    cfg = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    tuning = disk_tmp / "tuning.toml"
    tuning.write_text("prefetch_threshold = 64\nprefetch_timeout_per_ki_token = 0.5\n")
    _step, backend = run_step(["--enable-cp-l3", "--cp-l3-config", cfg, "--hicache-storage-backend-extra-config",
                               '{"prefetch_threshold": 64, "prefetch_timeout_base": 2}'])
    assert '"backend_name": "sglang_cp_l3"' in backend and '"prefetch_threshold": 64' in backend
    assert '"prefetch_timeout_base": 2' in backend
    _step, backend = run_step(["--enable-cp-l3", "--cp-l3-config", cfg,
                               "--hicache-storage-backend-extra-config", f"@{tuning}"])
    assert '"prefetch_threshold": 64' in backend and '"prefetch_timeout_per_ki_token": 0.5' in backend
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    declared = backend.split(" ", 2)[2]
    parsed = HybridCacheController.parse_storage_backend_extra_config(declared)
    assert parsed[1:4] == (64, 1, 0.5)  # upstream's own parser: threshold, timeout base, per KiB token
    assert parsed[0]["backend_name"] == "sglang_cp_l3"
