"""doctor_report rows, and the slab file-name header."""

import os

import pytest

from sglang_cp.l2 import doctor_report
from sglang_cp.l2.hugetlbfs import HugetlbfsMount
from sglang_cp.l2.slab_files import SlabFileName, layout_tag, process_start_time

MiB = 1 << 20


def rows_by_item(rows):
    return {item: (status, detail) for _, item, status, detail in rows}


def test_doctor_names_a_non_hugetlbfs_dir_and_no_dir(tmp_path):
    (status, detail), = rows_by_item(doctor_report(str(tmp_path), 10, 480)).values()
    assert status == "FAIL" and "not a hugetlbfs mount" in detail
    assert doctor_report(None, 10, 480)[0][2] == "INFO"


def test_doctor_on_real_hugetlbfs_reports_pages_slabs_and_fit(hugetlbfs_dir):
    r = rows_by_item(doctor_report(hugetlbfs_dir, 0.05, 0.02, unit_bytes=64 * 1152))
    assert r["mount"][0] == "OK" and r["hugepage size"] == ("OK", "2 MiB")
    assert "counted by sysfs" in r["hugepages total/free"][1]
    plan = r["--hicache-size 0.05"][1]
    assert plan.startswith("3 slab(s) <= 0.02 GiB [2 x 18.87 MB + 1 x ") and "3 cudaHostRegister call(s)" in plan
    assert r["capacity"][0] == "OK"
    big = rows_by_item(doctor_report(hugetlbfs_dir, 1000, 480))
    assert big["capacity"][0] == "FAIL" and "vm.nr_hugepages" in big["capacity"][1]


def test_doctor_through_the_seam_plans_the_default_cap(tmp_path):
    m = HugetlbfsMount.for_testing_on(str(tmp_path), 2 * MiB)
    r = rows_by_item(doctor_report(None, 1500, 480, mount=m))
    assert r["--hicache-size 1500"][1].startswith("3 slab(s) <= 480 GiB")


def test_name_roundtrip_and_pid_reuse_is_not_liveness():
    me = SlabFileName.for_this_process("p30000", 7, "kv-mla", layout_tag("layer_first", (2, 3)), 1, 4)
    name = me.format()
    assert SlabFileName.parse(name) == me and me.owner_alive()
    assert name.startswith("sglcp-l2.v1.p30000.r7.kv-mla.layer_first-") and ".1of4." in name
    reused = SlabFileName(**{**me.__dict__, "start_time": process_start_time(os.getpid()) + 1})
    assert not reused.owner_alive(), "same pid, other start time: a different process"
    assert SlabFileName.parse("sglcp-l2.v1.bad name.slab") is None
    assert SlabFileName.parse("unrelated-file") is None
    with pytest.raises(ValueError, match="label"):
        SlabFileName("ns", 0, "kv.mla", "x", 0, 1, 1, 1).format()
    assert layout_tag("page_first", (1, 2)) != layout_tag("page_first", (1, 3))
