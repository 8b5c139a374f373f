"""Hugepage L2: hugetlbfs-backed HiCache host slabs (engine-independent; never imports sglang).

Modules: ``hugetlbfs`` (mount + free hugepages), ``slab_plan`` (slabs + preflight),
``slab_files`` (names, ownership, stale reclaim), ``slab_mapping`` (contiguous
MAP_FIXED mapping), ``registration`` (one cudaHostRegister per slab),
``transfer_split`` / ``page_copy`` (no copy straddles a slab), ``allocator`` (the
whole allocation), ``doctor`` (rows for ``sglang-cp doctor``).
"""

from sglang_cp.l2.doctor import doctor_report
from sglang_cp.l2.errors import (
    HugepageL2Error,
    InsufficientHugepagesError,
    NotHugetlbfsError,
    RegistrationError,
    SlabOwnershipError,
    SlabPlanError,
)

__all__ = [
    "doctor_report",
    "HugepageL2Error",
    "InsufficientHugepagesError",
    "NotHugetlbfsError",
    "RegistrationError",
    "SlabOwnershipError",
    "SlabPlanError",
]
