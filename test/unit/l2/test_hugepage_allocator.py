"""The allocator end to end: real files, real mmap, real hugetlbfs where we can mount one."""

import gc
import os

import pytest
import torch

from sglang_cp.l2.allocator import HugepageHostAllocator, HugepageL2Config, slabs_of
from sglang_cp.l2.errors import InsufficientHugepagesError, NotHugetlbfsError, SlabOwnershipError
from sglang_cp.l2.hugetlbfs import HUGETLBFS_MAGIC, HugetlbfsMount, statfs_type
from sglang_cp.l2.slab_files import SlabFileName, scan
from slab_owner import slab_owner as _child

MiB = 1 << 20
HP = 2 * MiB
ROW = 576  # bf16 elements per MLA token per layer
UNIT = 64 * ROW * 2  # one layer_first page: 72 KiB; with 2 MiB pages slabs line up every 18 MiB
SYSFS = "/sys/kernel/mm/hugepages/hugepages-2048kB"


def hp_available():
    with open(f"{SYSFS}/free_hugepages") as f, open(f"{SYSFS}/resv_hugepages") as g:
        return int(f.read()) - int(g.read())


def mla_layer_first(alloc, layers=3, tokens=64 * 192, label="kv-mla"):
    return alloc.allocate((layers, tokens, 1, ROW), torch.bfloat16, label=label, layout="layer_first", unit_bytes=UNIT)


def fill_and_check_files(t, mapping):
    """Bytes written through the tensor land in the slab file that owns them."""
    flat = t.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
    for slab, path in zip(mapping.plan.slabs, mapping.paths):
        for off in (slab.offset, slab.end - 4096):
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.pread(fd, 4096, off - slab.offset)
            finally:
                os.close(fd)
            assert got == flat[off:off + 4096].numpy().tobytes()


# ---------------------------------------------------------------- production refuses non-hugetlbfs
def test_probe_refuses_ordinary_directory_and_missing_path(tmp_path):
    with pytest.raises(NotHugetlbfsError) as e:
        HugetlbfsMount.probe(str(tmp_path))
    assert "is not a hugetlbfs mount" in str(e.value) and "never falls back" in str(e.value)
    assert "mount -t hugetlbfs" in str(e.value)
    with pytest.raises(NotHugetlbfsError, match="does not exist"):
        HugetlbfsMount.probe(str(tmp_path / "nope"))
    with pytest.raises(NotHugetlbfsError):
        HugepageHostAllocator(HugepageL2Config(str(tmp_path), 1, "t", 0))
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- seam: same code on an ordinary dir
def test_seam_allocation_is_contiguous_over_several_slab_files(tmp_path):
    mount = HugetlbfsMount.for_testing_on(str(tmp_path), HP)
    alloc = HugepageHostAllocator(HugepageL2Config(str(tmp_path), 20 / 1024, "seam", 3), mount=mount)
    t = mla_layer_first(alloc)
    m = slabs_of(t)
    assert len(m.plan.slabs) == 3 and m.base % HP == 0
    assert t.data_ptr() == m.base and t.is_contiguous()
    names = [SlabFileName.parse(os.path.basename(p)) for p in m.paths]
    assert [(n.rank, n.label, n.slab, n.n_slabs, n.pid) for n in names] == [
        (3, "kv-mla", i, 3, os.getpid()) for i in range(3)
    ]
    assert names[0].layout.startswith("layer_first-")
    fill_and_check_files(t, m)
    del t, m
    gc.collect()
    assert scan(str(tmp_path)) == [], "slab files are removed when the pool dies"


# ---------------------------------------------------------------- real hugetlbfs
def test_real_mount_is_probed_and_counted(hugetlbfs_dir, hugetlbfs_limited):
    assert statfs_type(hugetlbfs_dir) == HUGETLBFS_MAGIC
    m = HugetlbfsMount.probe(hugetlbfs_dir)
    assert m.hugepage_size == HP and m.is_hugetlbfs
    cap = m.capacity()
    assert cap.source == "sysfs" and cap.free_pages == hp_available()
    lim = HugetlbfsMount.probe(hugetlbfs_limited).capacity()
    assert lim.source == "statvfs" and lim.free_pages == 8 and lim.total_pages == 8


def test_real_hugepage_slabs_roundtrip_and_cleanup(hugetlbfs_dir):
    before = hp_available()
    alloc = HugepageHostAllocator(HugepageL2Config(hugetlbfs_dir, 20 / 1024, "real", 0))
    t = mla_layer_first(alloc)
    m = slabs_of(t)
    assert len(m.plan.slabs) == 3
    assert hp_available() == before - m.plan.hugepages
    # Every slab really is hugepage-backed: no 4 KiB fallback anywhere in the range.
    with open("/proc/self/smaps") as f:
        smaps = f.read().split("\n")
    sizes = {}
    for i, line in enumerate(smaps):
        if "-" in line.split(" ")[0] and len(line.split()) >= 5:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if m.base <= lo < m.base + m.plan.mapped_bytes:
                kps = next(l for l in smaps[i:i + 30] if l.startswith("KernelPageSize"))
                sizes[lo] = kps.split()[1]
    assert len(sizes) == 3 and set(sizes.values()) == {"2048"}
    fill_and_check_files(t, m)
    alloc.close()
    assert os.listdir(hugetlbfs_dir) == []
    assert hp_available() == before


def test_insufficient_hugepages_fails_before_any_file(hugetlbfs_limited):
    alloc = HugepageHostAllocator(HugepageL2Config(hugetlbfs_limited, 480, "short", 0))
    with pytest.raises(InsufficientHugepagesError) as e:
        mla_layer_first(alloc, layers=4, tokens=64 * 64)  # 18 MiB = 9 pages > 8
    msg = str(e.value)
    assert "need 18.87 MB (9 x 2 MiB hugepages)" in msg and "16.78 MB (8 hugepages) are free" in msg
    assert "vm.nr_hugepages" in msg and "--hicache-size" in msg and "size= limit" in msg
    assert os.listdir(hugetlbfs_limited) == []




def test_stale_files_of_a_crashed_run_are_reclaimed(hugetlbfs_dir):
    before = hp_available()
    p = _child(hugetlbfs_dir, "crashy", "crash")
    assert p.stdout.readline().strip() == "ready"
    p.wait(timeout=60)
    left = scan(hugetlbfs_dir)
    assert len(left) == 1 and not left[0][1].owner_alive()
    assert hp_available() == before - 3, "a dead run's file still holds its hugepages"
    alloc = HugepageHostAllocator(HugepageL2Config(hugetlbfs_dir, 480, "crashy", 1))
    assert alloc.reclaimed == [left[0][0]]
    assert scan(hugetlbfs_dir) == [] and hp_available() == before


def test_live_owner_of_our_rank_is_refused_other_namespaces_untouched(hugetlbfs_dir):
    p = _child(hugetlbfs_dir, "busy", "live")
    try:
        assert p.stdout.readline().strip() == "ready"
        with pytest.raises(SlabOwnershipError, match="another server with the same namespace"):
            HugepageHostAllocator(HugepageL2Config(hugetlbfs_dir, 480, "busy", 0))
        other = HugepageHostAllocator(HugepageL2Config(hugetlbfs_dir, 480, "other", 0))
        assert other.reclaimed == [] and len(scan(hugetlbfs_dir)) == 1
    finally:
        p.kill()
        p.wait(timeout=60)


def _sysfs(name):
    with open(f"{SYSFS}/{name}") as f:
        return int(f.read())


@pytest.mark.parametrize("threads", [1, 4])
def test_every_page_is_faulted_in_before_registration(hugetlbfs_dir, threads):
    # cudaHostRegister pins what exists: the allocator must hand back populated pages,
    # whether MAP_POPULATE (1 thread) or parallel MADV_POPULATE_WRITE did it.
    free, resv = _sysfs("free_hugepages"), _sysfs("resv_hugepages")
    alloc = HugepageHostAllocator(HugepageL2Config(hugetlbfs_dir, 20 / 1024, f"pf{threads}", 0,
                                                   prefault_threads=threads))
    t = mla_layer_first(alloc)
    n = slabs_of(t).plan.hugepages
    assert _sysfs("free_hugepages") == free - n, "pages were only reserved, not faulted in"
    assert _sysfs("resv_hugepages") == resv
    alloc.close()
    assert _sysfs("free_hugepages") == free
