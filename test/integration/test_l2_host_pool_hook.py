"""The host-pool hook installs our allocator into REAL upstream host pools (CPU).

A fresh interpreter loads the plugin the way SGLang does (register + apply_hooks),
parses real flags with ``prepare_server_args``, publishes them, builds a real
``DSATokenToKVPool`` on CPU and, from it, real ``MLATokenToKVPoolHost`` (target KV, one
packed draft layer) and ``DSAIndexerPoolHost`` (indexer sidecar) in layer_first and
page_first layouts -- all inside ``host_memory_budget_scope(0)``, where upstream's
psutil check refuses every byte. The same build with the flag off is the control.
"""

import json
import os
import subprocess
import sys
import types

import pytest

from sglang_cp.integration.l2 import host_pool as hook
from sglang_cp.l2.transfer_split import SlabSplitter
from suite_helpers import run_job

NR = "/proc/sys/vm/nr_hugepages"
PAGES = 40

SCRIPT = r"""
import gc, json, os, sys, torch
from sglang_cp import plugin
assert plugin.register()
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
from sglang.srt.server_args import prepare_server_args
from sglang.srt import runtime_context as rc
mount, flag = sys.argv[1], sys.argv[2] == "on"
argv = ["--model-path", "dummy", "--enable-hierarchical-cache"]
if flag:
    argv += ["--enable-cp-shared-physical-l2-hicache", "--cp-shared-l2-hugetlbfs-dir", mount,
             "--cp-hicache-max-slab-gb", "0.02"]
sa = prepare_server_args(argv)
sa.resolve_once()
rc.publish(sa, role="scheduler")
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.common import get_allocator_from_storage
from sglang_cp.l2.allocator import slabs_of

LAYERS = 7  # + 1 draft = 8 host layers: page units line up with 2 MiB pages every 18 MiB
target = DSATokenToKVPool(size=64 * 8, page_size=64, kv_lora_rank=512, dtype=torch.bfloat16,
                          qk_rope_head_dim=64, layer_num=LAYERS, device="cpu", index_head_dim=128,
                          enable_memory_saver=False, kv_cache_dim=576)
draft = DSATokenToKVPool(size=64 * 8, page_size=64, kv_lora_rank=512, dtype=torch.bfloat16,
                         qk_rope_head_dim=64, layer_num=1, device="cpu", index_head_dim=128,
                         enable_memory_saver=False, kv_cache_dim=576)
out = {}
for layout, tokens in (("layer_first", 64 * 70), ("page_first", 64 * 70)):
    r = out[layout] = {}
    try:
        with host_memory_budget_scope(0):
            kv = MLATokenToKVPoolHost(
                target._mla_buffer_info(), 2.0, 0, 64, layout, pin_memory=False, device="cpu",
                draft_buffer_infos=(draft._mla_buffer_info(),),
                device_capacity_tokens=target.size, start_layer=0, end_layer=LAYERS - 1,
                target_layer_num=LAYERS, host_token_capacity=tokens)
            idx = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(target), kv, pin_memory=False, device="cpu")
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
        continue
    m, mi = slabs_of(kv.kv_buffer), slabs_of(idx.index_k_with_scale_buffer)
    r["ours"] = m is not None and mi is not None
    r["files"] = sorted(os.listdir(mount)) if flag else []
    if not r["ours"]:
        continue
    r["slabs"] = [len(m.plan.slabs), len(mi.plan.slabs)]
    r["layer_num"] = kv.layer_num
    # Our state lives on our allocator, never on upstream's pool objects.
    r["cp_attrs_on_pools"] = [k for pool in (kv, idx) for k in vars(pool) if "sglang_cp" in k or "cp_l2" in k]
    sp = kv.allocator.slab_splitter
    r["cuts"] = sp.cuts
    # Splitter vs the real upstream views: every group's rows of every layer in one slab.
    g = torch.Generator().manual_seed(3)
    pages = torch.randperm(kv.page_num, generator=g)[: kv.page_num // 2]
    host = (pages[:, None] * 64 + torch.arange(64)).reshape(-1)
    bad = 0
    groups = list(sp.split(host, torch.arange(host.numel())))
    for h, _ in groups:
        for layer in range(kv.layer_num):
            ref = kv.data_refs[layer]
            addrs = [ref[t].data_ptr() - m.base for t in (int(h.min()), int(h.max()))]
            addrs += [ref[t].data_ptr() - m.base + ref[t].nbytes - 1 for t in h.tolist()[::16]]
            bad += len({m.plan.slab_of(a) for a in addrs}) != 1
    r["groups"], r["bad_groups"] = len(groups), bad
    # Upstream's own page accessors read and write through the slabs.
    last = kv.page_num - 1
    page = torch.arange(kv.get_dummy_flat_data_page().numel(), dtype=torch.int16).view(kv.dtype)
    kv.set_from_flat_data_page(last * 64, page)
    # Compare bit patterns: an arange viewed as bf16 holds NaNs.
    r["page_roundtrip"] = bool(torch.equal(kv.get_data_page(last * 64).reshape(-1).view(torch.int16),
                                           page.reshape(-1).view(torch.int16)))
    off = kv.data_refs[0][last * 64].data_ptr() - m.base
    s = m.plan.slabs[m.plan.slab_of(off)]
    fd = os.open(m.paths[s.index], os.O_RDONLY)
    r["file_has_page"] = os.pread(fd, 64, off - s.offset) == kv.data_refs[0][last * 64].view(torch.uint8).numpy().tobytes()[:64]
    os.close(fd)
    kv.destroy(); idx.destroy()
    del kv, idx, m, mi, sp, ref, groups
    gc.collect()
    r["files_after_destroy"] = sorted(os.listdir(mount))
try:
    get_allocator_from_storage("mooncake")
    out["mooncake"] = "accepted"
except Exception as e:
    out["mooncake"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def hugetlbfs_mount(tmp_path_factory):
    if os.geteuid() != 0 or not os.path.exists(NR):
        pytest.skip("needs root to reserve hugepages and mount hugetlbfs")
    with open(NR) as f:
        before = int(f.read())
    with open(NR, "w") as f:
        f.write(str(before + PAGES))
    target = tmp_path_factory.mktemp("hugetlbfs")
    proc = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(target)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        with open(NR, "w") as f:
            f.write(str(before))
        pytest.skip(f"cannot mount hugetlbfs: {proc.stderr.strip()}")
    yield str(target)
    subprocess.run(["umount", str(target)], check=False)
    with open(NR, "w") as f:
        f.write(str(before))


def run_script(mount, flag):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("SGLANG_CP_DISABLE", None)
    env.pop("SGLANG_PLUGINS", None)
    proc = run_job([sys.executable, "-c", SCRIPT, mount, flag], text=True, timeout=400, env=env)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(line[len("RESULT "):])


def test_flag_on_gives_every_pool_hugetlbfs_slabs(hugetlbfs_mount):
    out = run_script(hugetlbfs_mount, "on")
    for layout in ("layer_first", "page_first"):
        r = out[layout]
        assert "error" not in r, r.get("error")
        assert r["ours"], "MLA target+draft KV and DSA indexer pools must come from hugetlbfs"
        assert r["layer_num"] == 8  # 7 target layers + 1 packed draft layer
        assert r["slabs"][0] >= 2, "the 20 MiB cap must split the KV pool"
        assert any(".kv-mla." in f for f in r["files"]) and any(".indexer-dsa." in f for f in r["files"])
        assert all(f".{layout}-" in f for f in r["files"])
        assert r["cuts"] and r["groups"] > 1 and r["bad_groups"] == 0
        assert r["cp_attrs_on_pools"] == [], "our state is on our allocator, not on upstream's pools"
        assert r["page_roundtrip"] and r["file_has_page"]
        assert r["files_after_destroy"] == [], "clean shutdown removes the slab files"
    assert "drop one of the two" in out["mooncake"]


def test_flag_off_is_upstream_and_its_psutil_check_is_real(hugetlbfs_mount):
    out = run_script(hugetlbfs_mount, "off")
    for layout in ("layer_first", "page_first"):
        assert "Not enough host memory" in out[layout]["error"]
    assert os.listdir(hugetlbfs_mount) == []


# ---------------------------------------------------------------- the transfer-split wrappers
class _Pool:
    pass


def test_transfer_hooks_split_memcpy_backends_and_leave_kernel_alone():
    import torch

    pool = _Pool()
    pool.allocator = types.SimpleNamespace(slab_splitter=SlabSplitter([128]))
    calls = []

    def original(self, device_pool, h, d, *rest, **kw):
        calls.append((h.tolist(), d.tolist(), rest, kw))

    host = torch.tensor([192, 193, 0, 1, 64, 65])
    dev = torch.tensor([10, 11, 12, 13, 14, 15])
    hook.load_per_layer_around(original, pool, None, host, dev, 5, "direct", is_draft=True)
    assert calls == [([0, 1, 64, 65], [12, 13, 14, 15], (5, "direct"), {"is_draft": True}),
                     ([192, 193], [10, 11], (5, "direct"), {"is_draft": True})]
    calls.clear()
    hook.backup_all_layer_around(original, pool, None, host, dev, "direct")
    assert [c[0] for c in calls] == [[0, 1, 64, 65], [192, 193]]
    calls.clear()
    hook.backup_all_layer_around(original, pool, None, host, dev, "kernel")
    assert [c[0] for c in calls] == [host.tolist()]
    calls.clear()
    hook.load_per_layer_around(original, _Pool(), None, host, dev, 0, "direct")
    assert len(calls) == 1


def test_buffer_outside_a_known_pool_is_refused_not_allocated(tmp_path):
    # Pools whose geometry the hook does not know (MHA, mamba, NPU kv_split) must fail
    # loud with the flag on, not get slabs cut at unknown page boundaries.
    import torch

    from sglang_cp.l2.allocator import HugepageHostAllocator, HugepageL2Config
    from sglang_cp.l2.errors import SlabPlanError
    from sglang_cp.l2.hugetlbfs import HugetlbfsMount

    core = HugepageHostAllocator(HugepageL2Config(str(tmp_path), 1, "t", 0),
                                 mount=HugetlbfsMount.for_testing_on(str(tmp_path), 2 << 20))
    allocator = hook._allocator_class()(core)
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator

    assert isinstance(allocator, HostTensorAllocator) and hook.is_ours(allocator)
    with pytest.raises(SlabPlanError, match="outside a known pool"):
        allocator.allocate((2, 4, 8), torch.bfloat16, "cpu")
    assert os.listdir(tmp_path) == []
