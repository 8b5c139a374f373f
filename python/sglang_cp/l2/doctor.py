"""Rows for ``sglang-cp doctor``: the mount, its hugepages, and the slabs a size would make."""

from __future__ import annotations

from typing import Optional

from sglang_cp.l2.errors import HugepageL2Error
from sglang_cp.l2.hugetlbfs import HugetlbfsMount
from sglang_cp.l2.slab_files import scan
from sglang_cp.l2.slab_plan import GiB, fmt_gb, fmt_page, plan_slabs, preflight, summarize_slabs

AREA = "l2 hugepages"


def doctor_report(
    hugetlbfs_dir: Optional[str],
    hicache_size_gb: Optional[float],
    max_slab_gb: float = 480.0,
    *,
    unit_bytes: Optional[int] = None,
    mount: Optional[HugetlbfsMount] = None,
) -> list[tuple[str, str, str, str]]:
    """(area, item, status, detail) rows; status is OK / INFO / WARN / FAIL.

    ``unit_bytes`` is the pool's page unit; without it the plan assumes the unit
    divides the hugepage size (true of every page-aligned pool with 2 MiB pages whose
    page bytes are a power of two), so the slab count is what the cap alone gives.
    """
    rows: list[tuple[str, str, str, str]] = []
    if not hugetlbfs_dir and mount is None:
        return [(AREA, "mount", "INFO", "no --cp-shared-l2-hugetlbfs-dir given")]
    try:
        mount = mount or HugetlbfsMount.probe(hugetlbfs_dir)
    except HugepageL2Error as e:
        return [(AREA, "mount", "FAIL", str(e))]
    rows.append((AREA, "mount", "OK", f"{mount.path} is hugetlbfs" if mount.is_hugetlbfs else f"{mount.path} (test seam)"))
    rows.append((AREA, "hugepage size", "OK", fmt_page(mount.hugepage_size)))
    try:
        cap = mount.capacity()
    except HugepageL2Error as e:
        rows.append((AREA, "free hugepages", "FAIL", str(e)))
        return rows
    rows.append((
        AREA, "hugepages total/free", "OK" if cap.free_pages else "WARN",
        f"{cap.total_pages}/{cap.free_pages} ({fmt_gb(cap.free_bytes)} free; counted by {cap.source})",
    ))
    owned = scan(mount.path)
    if owned:
        stale = [f for _, f in owned if not f.owner_alive()]
        rows.append((
            AREA, "slab files", "WARN" if stale else "INFO",
            f"{len(owned)} sglang-cp slab file(s), {len(stale)} stale (owner gone; reclaimed at next start)",
        ))
    if hicache_size_gb is None:
        return rows
    nbytes = int(hicache_size_gb * 1e9)
    unit = unit_bytes or 1
    nbytes -= nbytes % unit
    try:
        plan = plan_slabs("kv", nbytes, unit, mount.hugepage_size, int(max_slab_gb * GiB))
    except HugepageL2Error as e:
        rows.append((AREA, "slab plan", "FAIL", str(e)))
        return rows
    rows.append((
        AREA, f"--hicache-size {hicache_size_gb:g}", "OK",
        f"{len(plan.slabs)} slab(s) <= {max_slab_gb:g} GiB [{summarize_slabs(plan)}] = {len(plan.slabs)} cudaHostRegister "
        f"call(s), {plan.hugepages} hugepages",
    ))
    try:
        preflight([plan], cap)
        rows.append((AREA, "capacity", "OK", f"{plan.hugepages} of {cap.free_pages} free hugepages needed"))
    except HugepageL2Error as e:
        rows.append((AREA, "capacity", "FAIL", str(e)))
    return rows
