"""Slab planning and the hugepage preflight (real statvfs, hugepage size supplied)."""

import math
import os

import pytest

from sglang_cp.l2.errors import InsufficientHugepagesError, SlabPlanError
from sglang_cp.l2.hugetlbfs import HugetlbfsMount
from sglang_cp.l2.slab_plan import GiB, plan_slabs, preflight, summarize_slabs

MiB = 1 << 20
HP2M, HP1G = 2 * MiB, GiB
PAGE = 64
LAYERS = 78
MLA_BF16 = (512 + 64) * 2  # bytes per token per layer
MLA_FP8 = 656
DSA = 132


def units(row, layout, layers=LAYERS):
    return PAGE * row * (1 if layout == "layer_first" else layers)


def check_invariants(plan):
    assert sum(s.data_bytes for s in plan.slabs) == plan.nbytes
    offset = 0
    for s in plan.slabs:
        assert s.offset == offset
        offset += s.data_bytes
        assert s.mapped_bytes % plan.hugepage_size == 0
        assert s.data_bytes <= s.mapped_bytes < s.data_bytes + plan.hugepage_size
        assert s.mapped_bytes <= plan.max_slab_bytes or len(plan.slabs) == 1
    for b in plan.boundaries():
        assert b % plan.unit_bytes == 0, "a boundary cuts a KV page"
        assert b % plan.hugepage_size == 0, "a boundary is not hugepage aligned"


@pytest.mark.parametrize("row", [MLA_BF16, MLA_FP8, DSA])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("hp", [HP2M, HP1G])
def test_glm5_shapes_split_under_default_cap(row, layout, hp):
    unit = units(row, layout)
    nbytes = 1_500_000_000_000  # a 1.5 TB host pool per rank (the seed's hicache_size=1600 case)
    nbytes -= nbytes % unit
    cap = 480 * GiB
    grain = math.lcm(unit, hp)
    if grain > cap:
        with pytest.raises(SlabPlanError) as e:
            plan_slabs("kv", nbytes, unit, hp, cap)
        msg = str(e.value)
        assert "--cp-hicache-max-slab-gb" in msg and str(grain) in msg
        assert "2 MiB hugepages" in msg  # only offered when the pages are larger
        return
    plan = plan_slabs("kv", nbytes, unit, hp, cap)
    check_invariants(plan)
    assert all(s.mapped_bytes <= cap for s in plan.slabs)
    stride = cap // grain * grain
    assert plan.slabs[0].data_bytes == min(stride, nbytes)
    assert len(plan.slabs) == -(-nbytes // stride)


def test_fp8_page_first_with_1g_pages_cannot_meet_the_cap():
    # 64 x 78 x 656 B = 3,274,752 B = 2^11 * 1599: with 1 GiB pages slabs line up every 1599 GiB.
    unit = units(MLA_FP8, "page_first")
    with pytest.raises(SlabPlanError, match=r"1599\.000 GiB"):
        plan_slabs("kv", unit * 1_000_000, unit, HP1G, 480 * GiB)


def test_small_cap_gives_many_slabs_and_pool_that_fits_is_one_slab():
    unit = units(MLA_BF16, "layer_first")  # 73,728 B: lcm with 2 MiB is 18 MiB
    plan = plan_slabs("kv", unit * 1000, unit, HP2M, 40 * MiB)
    check_invariants(plan)
    assert plan.slabs[0].data_bytes == 36 * MiB
    assert len(plan.slabs) == -(-unit * 1000 // (36 * MiB))
    assert summarize_slabs(plan).startswith(f"{len(plan.slabs) - 1} x ")
    one = plan_slabs("kv", unit * 100, unit, HP2M, 480 * GiB)
    assert len(one.slabs) == 1 and one.slabs[0].mapped_bytes == -(-unit * 100 // HP2M) * HP2M


def test_slab_of_maps_every_byte_to_the_slab_that_holds_it():
    unit = units(DSA, "layer_first")  # 8448 B
    plan = plan_slabs("indexer", unit * 20000, unit, HP2M, 70 * MiB)  # lcm(8448, 2 MiB) = 66 MiB
    for off in (0, plan.slabs[1].offset - 1, plan.slabs[1].offset, plan.nbytes - 1):
        i = plan.slab_of(off)
        assert plan.slabs[i].offset <= off < plan.slabs[i].end
    with pytest.raises(IndexError):
        plan.slab_of(plan.nbytes)


@pytest.mark.parametrize("bad", [dict(nbytes=0), dict(nbytes=1000, unit_bytes=300), dict(max_slab_bytes=MiB)])
def test_bad_geometry_is_refused(bad):
    kw = dict(label="kv", nbytes=3000, unit_bytes=300, hugepage_size=HP2M, max_slab_bytes=GiB)
    kw.update(bad)
    with pytest.raises(SlabPlanError):
        plan_slabs(**kw)


# ---------------------------------------------------------------- preflight
@pytest.fixture
def seam_mount(tmp_path):
    return HugetlbfsMount.for_testing_on(str(tmp_path), HP2M)


def test_capacity_is_statvfs_free_bytes_in_supplied_hugepages(tmp_path):
    for hp in (HP2M, HP1G):
        cap = HugetlbfsMount.for_testing_on(str(tmp_path), hp).capacity()
        st = os.statvfs(tmp_path)
        expect = st.f_bavail * st.f_frsize // hp
        assert abs(cap.free_pages - expect) <= max(1, (256 * MiB) // hp)  # others write to this disk
        assert cap.total_pages == st.f_blocks * st.f_frsize // hp
        assert cap.hugepage_size == hp


def test_preflight_sequential_across_pools_names_the_shortage(seam_mount):
    cap = seam_mount.capacity()
    assert cap.free_pages > 100
    kv = plan_slabs("kv-mla", (cap.free_pages - 10) * HP2M, HP2M, HP2M, 8 * GiB)
    preflight([kv], cap)  # fits alone
    indexer = plan_slabs("indexer-dsa", 20 * HP2M, HP2M, HP2M, 8 * GiB)
    preflight([indexer], cap)  # fits alone
    with pytest.raises(InsufficientHugepagesError) as e:
        preflight([kv, indexer], cap)  # not after kv took its share
    msg = str(e.value)
    need = kv.hugepages + indexer.hugepages
    assert "'indexer-dsa'" in msg and "slab 1/1 is the first that does not fit" in msg
    assert f"({need} x 2 MiB hugepages)" in msg
    assert f"{need * HP2M / 1e9:.2f} GB" in msg
    assert f"({cap.free_pages} hugepages) are free" in msg
    assert f"raise vm.nr_hugepages by at least {need - cap.free_pages}" in msg
    assert "--hicache-size / --hicache-ratio" in msg


def test_preflight_refuses_mismatched_page_size(seam_mount):
    plan = plan_slabs("kv", HP1G, HP1G, HP1G, 8 * GiB)
    with pytest.raises(SlabPlanError, match="1 GiB pages"):
        preflight([plan], seam_mount.capacity())
