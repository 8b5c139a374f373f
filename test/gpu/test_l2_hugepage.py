"""Hugepage L2 slabs on a real GPU: registration per slab, byte-exact H2D/D2H across
slab boundaries, UVA kernel reads across registrations, loud shortage, no 4 KiB pages.

Needs CUDA, root (to reserve hugepages and mount hugetlbfs) and torch only.
"""

import gc
import os
import subprocess

import numpy as np
import pytest
import torch

from sglang_cp.l2.allocator import HugepageHostAllocator, HugepageL2Config, slabs_of
from sglang_cp.l2.errors import InsufficientHugepagesError
from sglang_cp.l2.page_copy import copy_pages, plan_copies
from sglang_cp.l2.registration import register_mapping, unregister_mapping

# vm.nr_hugepages is host-wide: under pytest-xdist every test that changes it shares one worker.
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("hugepages")]
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

GiB, MiB = 1 << 30, 1 << 20
NR = "/proc/sys/vm/nr_hugepages"
SYSFS = "/sys/kernel/mm/hugepages/hugepages-2048kB"
ROW = 576 * 2  # MLA bf16 bytes per token per layer
PAGE = 64
UNIT = PAGE * ROW  # layer_first page unit (72 KiB): slabs line up every 18 MiB
PAGES_NEEDED = 2600  # ~5.1 GiB


def hp_available():
    with open(f"{SYSFS}/free_hugepages") as f, open(f"{SYSFS}/resv_hugepages") as g:
        return int(f.read()) - int(g.read())


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root to reserve hugepages")
    with open(NR) as f:
        before = int(f.read())
    with open(NR, "w") as f:
        f.write(str(before + max(0, PAGES_NEEDED - hp_available())))
    if hp_available() < PAGES_NEEDED:
        pytest.skip(f"kernel granted only {hp_available()} free 2 MiB hugepages")
    target = tmp_path_factory.mktemp("huge")
    if subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(target)]).returncode:
        pytest.skip("cannot mount hugetlbfs")
    yield str(target)
    subprocess.run(["umount", str(target)], check=False)
    with open(NR, "w") as f:
        f.write(str(before))


@pytest.fixture
def pool(mount):
    """A 3 GiB-class layer_first MLA host pool in 1 GiB-capped slabs, registered."""
    alloc = HugepageHostAllocator(HugepageL2Config(mount, 1.0, "gpu", 0))
    layers, tokens = 4, 64 * 10_000  # 4 x 737 MB = 2.95 GB
    t = alloc.allocate((layers, tokens, 1, 576), torch.bfloat16, label="kv-mla", layout="layer_first", unit_bytes=UNIT)
    m = slabs_of(t)
    register_mapping(m)
    yield t, m
    unregister_mapping(m)
    alloc.close()
    del t, m
    gc.collect()


def test_one_registration_per_slab_each_under_the_cap(pool):
    t, m = pool
    assert len(m.plan.slabs) == 3
    assert m.registered == m.slab_ranges()
    assert all(size <= 1 * GiB for _, size in m.registered)
    for s in m.plan.slabs:
        view = t.view(-1).view(torch.uint8)[s.offset:s.end]
        assert view.is_pinned(), f"slab {s.index} not seen as pinned by CUDA"
    # smaps: the whole range is 2 MiB pages -- nothing fell back to 4 KiB.
    with open("/proc/self/smaps") as f:
        lines = f.read().split("\n")
    seen = []
    for i, line in enumerate(lines):
        head = line.split(" ")[0]
        if "-" in head and len(line.split()) >= 5:
            lo = int(head.split("-")[0], 16)
            if m.base <= lo < m.base + m.plan.mapped_bytes:
                seen.append(next(x for x in lines[i:i + 30] if x.startswith("KernelPageSize")).split()[1])
    assert seen == ["2048"] * 3


def test_h2d_d2h_byte_exact_across_slab_boundaries(pool):
    t, m = pool
    flat = t.view(-1).view(torch.uint8)
    page_bytes = UNIT
    n_host_pages = flat.numel() // page_bytes
    g = torch.Generator().manual_seed(0)
    for s in m.plan.slabs:  # fill in chunks: random bytes everywhere
        for off in range(s.offset, s.end, 256 * MiB):
            n = min(256 * MiB, s.end - off)
            flat[off:off + n].random_(0, 256, generator=g)
    boundaries = m.plan.boundaries()
    # Merged runs that cross each boundary, plus scattered single pages.
    run = []
    for b in boundaries:
        p = b // page_bytes
        run += list(range(p - 8, p + 8))
    rng = np.random.default_rng(1)
    scattered = rng.choice(n_host_pages, 300, replace=False).tolist()
    host_pages = np.array(run + [p for p in scattered if p not in run])
    dev_pages = np.arange(host_pages.size)
    copies = plan_copies(host_pages, dev_pages, page_bytes, boundaries)
    assert not any(h < b < h + n for h, _, n in copies for b in boundaries)
    merged = [c for c in copies if c[2] > page_bytes]
    assert merged, "consecutive pages must merge into multi-page copies"
    dev = torch.empty(host_pages.size * page_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        copy_pages(flat, dev, copies, to_device=True)
    stream.synchronize()
    expect = torch.cat([flat[p * page_bytes:(p + 1) * page_bytes] for p in host_pages.tolist()])
    assert torch.equal(dev.cpu(), expect)
    # D2H: new device bytes into the same host pages, then back-check on the host.
    dev.copy_(torch.randint(0, 256, dev.shape, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        copy_pages(flat, dev, copies, to_device=False)
    stream.synchronize()
    got = torch.cat([flat[p * page_bytes:(p + 1) * page_bytes] for p in host_pages.tolist()])
    assert torch.equal(got, dev.cpu())


class _UVA:
    """A CUDA view of registered host memory (UVA: the host address is the device address)."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def test_uva_gather_kernel_reads_across_registrations(pool):
    # The sglang "kernel" io backend gathers host pages from a GPU kernel through UVA;
    # one kernel touching pages of several registrations must read every byte right.
    t, m = pool
    flat = t.view(-1).view(torch.uint8)
    b = m.plan.boundaries()[0]
    lo, hi = b - 4 * UNIT, b + 4 * UNIT
    flat[lo:hi] = torch.randint(0, 256, (hi - lo,), dtype=torch.uint8)
    dev_view = torch.as_tensor(_UVA(m.base + lo, hi - lo), device="cuda")
    assert dev_view.is_cuda and dev_view.data_ptr() == m.base + lo
    idx = torch.randperm(hi - lo, device="cuda")
    got = dev_view[idx].cpu()  # one gather kernel over both registrations
    assert torch.equal(got, flat[lo:hi][idx.cpu()])


def test_insufficient_hugepages_fail_loud_with_the_fix(mount):
    alloc = HugepageHostAllocator(HugepageL2Config(mount, 1.0, "short", 0))
    free = hp_available()
    too_many_tokens = (free + 10) * 2 * MiB // (ROW * 2) // PAGE * PAGE
    before = os.listdir(mount)
    with pytest.raises(InsufficientHugepagesError) as e:
        alloc.allocate((2, too_many_tokens, 1, 576), torch.bfloat16, label="kv-mla", layout="layer_first",
                       unit_bytes=UNIT)
    msg = str(e.value)
    assert "insufficient hugepages" in msg and f"({free} hugepages) are free" in msg
    assert "vm.nr_hugepages" in msg and "--hicache-size / --hicache-ratio" in msg
    assert os.listdir(mount) == before, "nothing was created: no ftruncate, no mmap, no fallback"
    assert hp_available() == free
