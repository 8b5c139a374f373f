"""The L3 identity of a scheduler process, derived from real upstream ServerArgs, the real
published parallel context and upstream's own ``HiCacheController._generate_storage_config``
(with the plugin's hooks): one L3 rank per KV-owning process of a node, whatever the DP
topology; and keys that name the logical KV dtype (fp8 formats share uint8 host storage).
"""

import json
import textwrap

import pytest

from suite_helpers import py_job, run_all

CODE = textwrap.dedent(
    """
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import torch
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.runtime_context import get_parallel, publish, SpawnRanks
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.entrypoints.engine import _calculate_rank_ranges
    from sglang_cp.integration.cp_l3.identity import derive_identity, runtime_topology, node_rank_ranges

    cfg, what = sys.argv[1], sys.argv[2]

    def controller(dtype):
        kv = MLATokenToKVPool(size=256, page_size=64, dtype=dtype, kv_lora_rank=512, qk_rope_head_dim=64,
                              layer_num=2, device="cpu", enable_memory_saver=False)
        host = MLATokenToKVPoolHost(
            kv.get_device_pool_infos()[0].buffer_info, 1.0, 0, 64, "page_first", pin_memory=False, device="cpu",
            override_kv_cache_dim=kv.kv_cache_dim, device_capacity_tokens=256, start_layer=kv.start_layer,
            end_layer=kv.end_layer, target_layer_num=2, host_token_capacity=256)
        # Upstream's method on a controller holding exactly what it reads: the device and host pools.
        c = HiCacheController.__new__(HiCacheController)
        c.mem_pool_device, c.mem_pool_host, c.storage_host_pool = kv, host, host
        c.enable_storage_metrics, c.page_size, c.attn_cp_group = False, 64, None
        return c

    def server(argv):
        sa = prepare_server_args(["--model-path", "dummy", "--device", "cpu", "--enable-hierarchical-cache",
                                  "--enable-cp-l3", "--cp-l3-config", cfg] + argv)
        sa.resolve_once()
        return sa, json.loads(resolved_view(sa).hicache_storage_backend_extra_config)

    def spawn(sa, world_rank, dp_rank):
        # What run_scheduler_process does for this spawn: publish its ranks, then DP attention init.
        get_parallel().clear_stamp()
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, dp_rank=dp_rank, gpu_id=0))
        initialize_dp_attention(sa)

    if what == "topology":
        for case, argv, spawns in json.loads(sys.argv[3]):
            sa, extra = server(argv)
            for world_rank, dp_rank in spawns:
                spawn(sa, world_rank, dp_rank)
                sc = controller(torch.bfloat16)._generate_storage_config("m", dict(extra))
                ident = derive_identity(sc, runtime_topology())
                p = get_parallel()
                up = _calculate_rank_ranges(p.node_rank)
                ours = node_rank_ranges(p.tp_size, p.pp_size, p.nnodes, p.node_rank)
                print("ROW", json.dumps(dict(
                    case=case, old=sc.tp_rank + sc.tp_size * sc.pp_rank, local=ident.local_rank,
                    count=ident.local_count, label=ident.label(),
                    ranges_match=[list(up[0]), list(up[1])] == [list(r) for r in ours])))
    else:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang_cp.integration.cp_l3.backend import CpL3Storage
        sa, extra = server([])
        spawn(sa, 0, None)
        tokens = torch.arange(64, dtype=torch.int64)

        def backend(dtype, cold_start, sidecar=None, l3_config=cfg):
            c = controller(dtype)
            sc = c._generate_storage_config("m", dict(extra, cp_l3_cold_start=cold_start, cp_l3_config=l3_config))
            b = CpL3Storage(sc)
            b.register_mem_pool_host(c.mem_pool_host)
            if sidecar is not None:
                b.register_mem_host_pool_v2(controller(dtype).mem_pool_host, sidecar)
            try:
                b.on_host_pools_registered()
            except Exception as e:
                return b, type(e).__name__ + ": " + str(e)
            return b, c.mem_pool_host

    if what == "switch":  # io.gil_switch_interval_ms: set in this (the serving) process at open, undone at close
        switched = cfg + ".switch.toml"  # the same directories, with the setting
        with open(switched, "w") as f:
            f.write(open(cfg).read() + "\\n[io]\\ngil_switch_interval_ms = 0.5\\n")
        for path in (cfg, switched):  # unset first (CPython's own is left alone), then 0.5
            before = sys.getswitchinterval()
            b, _ = backend(torch.bfloat16, "clear", l3_config=path)
            opened = sys.getswitchinterval()
            b.close()
            print("ROW", json.dumps(dict(before=before, opened=opened, closed=sys.getswitchinterval())))
    if what == "hybrid":
        import os
        b, _ = backend(torch.bfloat16, "clear")
        # A second process-local opener of the same identity (as a second server would be).
        _, err = backend(torch.bfloat16, "clear")
        print("ROW", json.dumps(dict(collide=err, pid=os.getpid(), label=b.identity.label())))
        # A trailing-window pool that shows up after attach: a miss and a counter, no exception.
        try:
            res = b.batch_exists_v2(["page-0"], [PoolTransfer(name=PoolName.SWA, keys=["page-0"],
                                                              hit_policy=PoolHitPolicy.TRAILING_PAGES)])
            out = dict(hit=res.kv_hit_pages, counted=b.unsupported_queries)
        except Exception as e:
            out = dict(raised=type(e).__name__ + ": " + str(e))
        print("ROW", json.dumps(out))
        b.close()
        for pool in (PoolName.SWA, PoolName.MAMBA):
            b, err = backend(torch.bfloat16, "clear", sidecar=pool)
            print("ROW", json.dumps(dict(pool=pool.value, refused=err if isinstance(err, str) else None,
                                         opened=b.store is not None)))
            b.close()
    elif what == "fp8":  # a page written under one fp8 format, then a `load` restart under the other

        b, host = backend(torch.float8_e4m3fn, "clear")
        host.get_data_page(0, flat=True).view(torch.uint8).copy_(torch.randint(0, 256, (host.get_data_page(0, flat=True).numel(),), dtype=torch.uint8))
        assert b.batch_set_v1(["page-0"], tokens) == [True]
        print("ROW", json.dumps(dict(fmt="e4m3", host=str(host.dtype), write=True,
                                     dtypes=b.storage_config.extra_config["cp_l3_kv_dtypes"])))
        b.close()
        for dtype, name in ((torch.float8_e5m2, "e5m2"), (torch.float8_e4m3fn, "e4m3")):
            b, host = backend(dtype, "load")
            print("ROW", json.dumps(dict(fmt=name, host=str(host.dtype), hit=b.batch_exists(["page-0"]))))
            b.close()
    """
)


def _rows_job(l3cfg, *args):
    return py_job(f"import sys; sys.argv = ['x'] + {json.dumps([l3cfg, *args])}\n" + CODE, {"HF_HUB_OFFLINE": "1"})


def _rows(p):
    rows = [json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
    assert rows, p.stdout[-3000:] + p.stderr[-5000:]
    return rows


@pytest.fixture(scope="module")
def scenario_runs(tmp_path_factory):
    """The scenario processes of this module, each on its own L3 directory, started together."""
    from sglang_cp.cli import write_demo_config

    def cfg():
        return write_demo_config(str(tmp_path_factory.mktemp("disk") / "l3"), capacity_gb=0.05)
    return run_all({
        "topology": _rows_job(cfg(), "topology", json.dumps([[c, a, s] for c, a, s, _ in CASES])),
        "fp8": _rows_job(cfg(), "fp8"),
        "hybrid": _rows_job(cfg(), "hybrid"),
        "switch": _rows_job(cfg(), "switch"),
    }, timeout=300)


@pytest.fixture
def l3cfg(disk_tmp):
    from sglang_cp.cli import write_demo_config

    return write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)


CASES = [
    # --tp 8 --dp 8 --enable-dp-attention: the storage config carries attention-TP values (all
    # tp_rank 0 of size 1); the old rank formula made all eight processes L3 rank 0.
    ("dp-attention", ["--tp", "8", "--dp", "8", "--enable-dp-attention"], [[i, i] for i in range(8)], 8),
    # --dp 2 replicas of --tp 4: separate worlds, TP ranks from 0 in each.
    ("replicas", ["--tp", "4", "--dp", "2"], [[t, d] for d in range(2) for t in range(4)], 8),
    # Two nodes: node 1 runs TP 4..7; its L3 ranks are 0..3 of 4 (its own disks, its own split).
    ("two-nodes", ["--tp", "8", "--dp", "8", "--enable-dp-attention", "--nnodes", "2", "--node-rank", "1",
                   "--dist-init-addr", "127.0.0.1:5000"], [[i, i] for i in range(4, 8)], 4),
]


def test_every_kv_owner_of_a_node_is_its_own_l3_rank(scenario_runs):
    rows = _rows(scenario_runs["topology"])
    for case, _argv, spawns, expect_count in CASES:
        mine = [r for r in rows if r["case"] == case]
        assert len(mine) == len(spawns), (case, rows)
        assert sorted(r["local"] for r in mine) == list(range(expect_count)), (case, mine)
        assert {r["count"] for r in mine} == {expect_count}  # the per-disk capacity split: this node's ranks
        assert all(r["ranges_match"] for r in mine)  # our node split is upstream's _calculate_rank_ranges
        if case != "two-nodes":
            # The formula this replaces: several processes shared one L3 rank.
            assert len({r["old"] for r in mine}) < len(mine), (case, mine)


def test_fp8_formats_never_share_a_page(scenario_runs):
    rows = _rows(scenario_runs["fp8"])
    write, e5m2, e4m3 = rows
    assert write["write"] and write["host"] == "torch.uint8"
    assert write["dtypes"] == {"kv": "torch.float8_e4m3fn"}
    # Same host storage dtype (uint8) and page size; only the logical dtype differs.
    assert e5m2["host"] == e4m3["host"] == "torch.uint8"
    assert e5m2["hit"] == 0, "a page written as fp8_e4m3fn was a hit under fp8_e5m2"
    assert e4m3["hit"] == 1  # control: the same format reloads it


def test_the_serving_process_takes_the_configured_switch_interval_while_the_store_is_open(scenario_runs):
    """io.gil_switch_interval_ms = 0.5: the scheduler process runs at 0.5 ms from the store's open to its close;
    unset, CPython's own interval is left alone."""
    off, on = _rows(scenario_runs["switch"])
    assert on == {"before": 0.005, "opened": 0.0005, "closed": 0.005}, on
    assert off == {"before": 0.005, "opened": 0.005, "closed": 0.005}, off


def test_second_owner_and_hybrid_pools_are_refused_at_attach(scenario_runs):
    collide, trailing, swa, mamba = _rows(scenario_runs["hybrid"])
    # The same identity opened twice: the second attach fails, naming the identity and the holder.
    err = collide["collide"]
    assert err.startswith("L3OwnershipError: disks[0].path: L3 rank 0 is already owned by pid "
                          f"{collide['pid']} ({collide['label']})"), err
    assert "namespace" in err
    # Upstream asked with a trailing-window policy: one miss and a counter, not an exception.
    assert trailing == {"hit": 0, "counted": 1}, trailing
    for row in (swa, mamba):
        assert not row["opened"] and row["refused"].startswith("L3StartupError: --enable-cp-l3: this model has "
                                                               f"hybrid pools ({row['pool']})"), row


HOLD = textwrap.dedent(
    """
    import sys
    from sglang_cp.l3 import L3Store, load_l3_config
    s = L3Store(load_l3_config(sys.argv[1]), rank=0, ranks_per_node=1, payloads={"kv": 16384},
                owner="server A rank 0")
    print("ready", flush=True)
    sys.stdin.read()
    s.close()
    """
)


def test_check_args_refuses_a_config_a_live_server_owns_and_accepts_its_own_namespace(l3cfg):
    import os
    import subprocess
    import sys

    from test_doctor_cli import run

    holder = subprocess.Popen([sys.executable, "-c", HOLD, l3cfg], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        argv = ["check-args", "--", "--model-path", "dummy", "--enable-hierarchical-cache", "--enable-cp-l3",
                "--cp-l3-config"]
        bad = run(*argv, l3cfg)
        assert bad.returncode == 2, bad.stdout + bad.stderr
        out = " ".join(bad.stdout.split())
        assert f"L3 rank 0 of this config (no namespace) is owned by live pid {holder.pid} (server A rank 0)" in out
        # A second server on the same directories with its own namespace: accepted.
        other = os.path.join(os.path.dirname(l3cfg), "l3-b.toml")
        with open(other, "w") as f:
            f.write('namespace = "server-b"\n' + open(l3cfg).read())
        ok = run(*argv, other)
        assert ok.returncode == 0 and "accepted" in ok.stdout, ok.stdout + ok.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
