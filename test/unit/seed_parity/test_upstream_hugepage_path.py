"""Upstream's own hugepage path, with our L2 flag off (issue 14, item 5).

1. ``SGLANG_HUGEPAGE_SIZE`` (upstream's switch): the real ``alloc_mmap`` falls back
   to 4 KiB pages when the hugetlb mmap fails or the value is misspelt, and only
   logs. ``SGLANG_CP_HUGEPAGE_STRICT=1`` (integration/l2/hugepage_strict.py)
   makes it one startup error naming the variable and the fix; default off =
   upstream. The hugetlb failure is real: the 1 GiB pool of the test machine is
   checked to be empty first (the premise), so the kernel itself refuses the mmap.
2. One ``cudaHostRegister`` per layer_first pool (our L2 flag off): upstream's real
   ``_cuda_host_register`` makes a single call for the whole buffer and raises
   loudly when it fails (no silent unpinned fallback), so the plugin leaves it.
   The CUDA runtime is a recorder here (no GPU); the GPU run of the hook path is
   test/gpu/test_l2_hugepage.py.

Each hooks-on case runs in a fresh interpreter (HookRegistry patches the process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

CHILD = r"""
import json, os, sys, logging
logging.disable(logging.CRITICAL)
if sys.argv[1] == "on":
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang_cp.integration.l2 import hugepage_strict as mod
    for spec in mod.HOOKS:
        HookRegistry.register(spec.target, spec.fn, HookType[spec.kind.upper()])
    HookRegistry.apply_hooks()
import torch
from sglang.srt.mem_cache.storage.mmap.mmap_allocator import alloc_mmap
try:
    t = alloc_mmap((1024,), torch.uint8)
    out = {"result": "tensor", "numel": t.numel()}
except Exception as e:
    out = {"result": type(e).__name__, "message": str(e)}
print("HUGEPAGE " + json.dumps(out))
"""


def _run(hooks: str, size: str, strict: bool) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", SGLANG_HUGEPAGE_SIZE=size)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "python"), env.get("PYTHONPATH", "")])
    env.pop("SGLANG_CP_HUGEPAGE_STRICT", None)
    env.pop("SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS", None)
    if strict:
        env["SGLANG_CP_HUGEPAGE_STRICT"] = "1"
    p = subprocess.run([sys.executable, "-c", CHILD, hooks], capture_output=True, text=True,
                       env=env, timeout=300)
    lines = [l for l in p.stdout.splitlines() if l.startswith("HUGEPAGE ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def _free_1g():
    try:
        with open("/sys/kernel/mm/hugepages/hugepages-1048576kB/free_hugepages") as f:
            return int(f.read())
    except OSError:
        return 0


@pytest.fixture(scope="module")
def no_1g_pages():
    if _free_1g() != 0:
        pytest.skip("this machine has free 1 GiB hugepages: the hugetlb mmap would succeed")


def test_upstream_falls_back_to_4k_without_the_strict_gate(no_1g_pages):
    # Control (hooks off, and hooks on with the gate off): upstream serves 4 KiB pages.
    assert _run("off", "1GB", strict=True) == {"result": "tensor", "numel": 1024}
    assert _run("on", "1GB", strict=False) == {"result": "tensor", "numel": 1024}


def test_strict_gate_refuses_the_silent_fallback_when_the_hugetlb_mmap_fails(no_1g_pages):
    got = _run("on", "1GB", strict=True)
    assert got["result"] == "HugepageStrictError", got
    assert got["message"].startswith("SGLANG_HUGEPAGE_SIZE=1GB: the hugetlb mmap")
    assert "1 pages of 1GB needed, 0 free" in got["message"] and "nr_hugepages" in got["message"]


def test_strict_gate_refuses_a_misspelt_size():
    assert _run("off", "2M", strict=True)["result"] == "tensor"  # upstream: warn + 4 KiB
    got = _run("on", "2M", strict=True)
    assert got["result"] == "HugepageStrictError" and "'2M' is not '2MB' or '1GB'" in got["message"], got


class _Cudart:
    def __init__(self, rc):
        self.rc, self.calls = rc, []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(size)
        return self.rc

    def cudaHostUnregister(self, ptr):
        return 0

    def cudaGetErrorString(self, rc):
        return "out of memory"


@pytest.mark.parametrize("rc", [0, 2])
def test_layer_first_pool_gets_one_registration_and_a_failure_is_loud(monkeypatch, rc):
    """Flag off, upstream's _cuda_host_register on a whole host buffer (what a
    layer_first pool passes: no registration granularity)."""
    import torch

    from sglang.srt.mem_cache.pool_host import common

    cudart = _Cudart(rc)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffer = torch.zeros(3, 1024, dtype=torch.uint8)
    if rc == 0:
        common._cuda_host_register(buffer)
        assert getattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR) == [(buffer.data_ptr(), 3072)]
    else:
        with pytest.raises(RuntimeError, match="cudaHostRegister failed .* host buffer is not pinned"):
            common._cuda_host_register(buffer)
    assert cudart.calls == [3072]  # one call for the whole pool
