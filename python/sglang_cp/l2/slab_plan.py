"""Split one host pool into slabs, and check the hugepages they need before any mmap.

A slab is one hugetlbfs file, one mapping and one cudaHostRegister call. Slabs of a
pool are mapped back to back, so upstream still sees one contiguous tensor; what must
hold at every interior boundary:

* it is a multiple of the hugepage size (hugetlbfs maps whole pages at aligned
  addresses, so the next slab's mapping starts on a page boundary), and
* it is a multiple of the pool's *page unit* -- the largest block one transfer of one
  KV page touches (one layer's page for layer_first, all layers of a page for the
  page-major layouts) -- so no page is cut in two.

Hence full slabs are a multiple of ``lcm(unit, hugepage)`` no larger than the cap, and
only the last one may be shorter (its mapping rounded up to whole hugepages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from sglang_cp.l2.errors import InsufficientHugepagesError, SlabPlanError
from sglang_cp.l2.hugetlbfs import HugepageCapacity

GiB = 1 << 30


def fmt_gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def fmt_page(hugepage_size: int) -> str:
    return f"{hugepage_size >> 30} GiB" if hugepage_size >= GiB else f"{hugepage_size >> 20} MiB"


@dataclass(frozen=True)
class Slab:
    index: int
    offset: int  # first byte of the slab within the pool's contiguous range
    data_bytes: int  # bytes of the pool that live in this slab
    mapped_bytes: int  # size of the file and of its mapping: whole hugepages

    @property
    def end(self) -> int:
        return self.offset + self.data_bytes


@dataclass(frozen=True)
class SlabPlan:
    label: str
    nbytes: int
    unit_bytes: int
    hugepage_size: int
    max_slab_bytes: int
    slabs: tuple[Slab, ...]

    @property
    def mapped_bytes(self) -> int:
        return sum(s.mapped_bytes for s in self.slabs)

    @property
    def hugepages(self) -> int:
        return self.mapped_bytes // self.hugepage_size

    def boundaries(self) -> list[int]:
        """Interior slab boundaries, in bytes from the pool start."""
        return [s.offset for s in self.slabs[1:]]

    def slab_of(self, offset: int) -> int:
        if not 0 <= offset < self.nbytes:
            raise IndexError(f"byte offset {offset} outside pool {self.label!r} of {self.nbytes} bytes")
        lo, hi = 0, len(self.slabs) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.slabs[mid].offset <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo


def plan_slabs(label: str, nbytes: int, unit_bytes: int, hugepage_size: int, max_slab_bytes: int) -> SlabPlan:
    if nbytes <= 0:
        raise SlabPlanError(f"host pool {label!r}: size must be positive, got {nbytes} bytes")
    if unit_bytes <= 0 or nbytes % unit_bytes:
        raise SlabPlanError(
            f"host pool {label!r}: {nbytes} bytes is not a whole number of {unit_bytes}-byte "
            f"page units; the pool geometry handed to the allocator is wrong"
        )
    if max_slab_bytes < hugepage_size:
        raise SlabPlanError(
            f"--cp-hicache-max-slab-gb={max_slab_bytes / GiB:g} is below one hugepage "
            f"({fmt_page(hugepage_size)}); raise it"
        )
    grain = math.lcm(unit_bytes, hugepage_size)
    stride = (max_slab_bytes // grain) * grain
    if stride == 0 and nbytes > max_slab_bytes:
        need_gb = math.ceil(grain / GiB * 1000) / 1000
        smaller_pages = " or use 2 MiB hugepages," if hugepage_size > (2 << 20) else ""
        raise SlabPlanError(
            f"host pool {label!r} ({fmt_gb(nbytes)}) must be split, but its {unit_bytes}-byte "
            f"page unit and {fmt_page(hugepage_size)} hugepages only line up every "
            f"{grain} bytes ({grain / GiB:.3f} GiB), above --cp-hicache-max-slab-gb="
            f"{max_slab_bytes / GiB:g}; raise --cp-hicache-max-slab-gb to at least {need_gb:g},"
            f"{smaller_pages} or lower --hicache-size so the pool fits one slab"
        )
    stride = stride or nbytes
    slabs = []
    offset = 0
    while offset < nbytes:
        data = min(stride, nbytes - offset)
        mapped = -(-data // hugepage_size) * hugepage_size
        slabs.append(Slab(len(slabs), offset, data, mapped))
        offset += data
    return SlabPlan(label, nbytes, unit_bytes, hugepage_size, max_slab_bytes, tuple(slabs))


def preflight(plans: Sequence[SlabPlan], capacity: HugepageCapacity) -> None:
    """Raise before any ftruncate/mmap if the slabs, taken in order, do not all fit.

    Slabs are checked one by one against what the earlier ones leave, so the error can
    say which slab is the first that would fail at mmap.
    """
    hp = capacity.hugepage_size
    need_total = sum(p.hugepages for p in plans)
    free = capacity.free_pages
    for plan in plans:
        if plan.hugepage_size != hp:
            raise SlabPlanError(
                f"host pool {plan.label!r} was planned for {fmt_page(plan.hugepage_size)} pages "
                f"but {capacity.mount} has {fmt_page(hp)} pages"
            )
        for slab in plan.slabs:
            need = slab.mapped_bytes // hp
            if need > free:
                short = need_total - capacity.free_pages
                raise InsufficientHugepagesError(
                    f"insufficient hugepages in {capacity.mount} for HiCache host pool "
                    f"{plan.label!r}: need {fmt_gb(need_total * hp)} ({need_total} x {fmt_page(hp)} "
                    f"hugepages) but only {fmt_gb(capacity.free_bytes)} ({capacity.free_pages} "
                    f"hugepages) are free (counted by {capacity.source}); slab {slab.index + 1}/"
                    f"{len(plan.slabs)} is the first that does not fit. Fix: raise vm.nr_hugepages "
                    f"by at least {short} (e.g. `echo {(capacity.total_pages or 0) + short} > "
                    f"/proc/sys/vm/nr_hugepages`"
                    f"{', and the size= limit of the mount' if capacity.source == 'statvfs' else ''}), "
                    f"or lower --hicache-size / --hicache-ratio"
                )
            free -= need


def summarize_slabs(plan: SlabPlan) -> str:
    groups: list[list[int]] = []
    for s in plan.slabs:
        if groups and groups[-1][0] == s.data_bytes:
            groups[-1][1] += 1
        else:
            groups.append([s.data_bytes, 1])
    return " + ".join(f"{n} x {fmt_gb(b)}" for b, n in groups)


def describe(plans: Iterable[SlabPlan]) -> list[str]:
    out = []
    for p in plans:
        out.append(
            f"{p.label}: {fmt_gb(p.nbytes)} in {len(p.slabs)} slab(s) [{summarize_slabs(p)}], "
            f"{p.hugepages} x {fmt_page(p.hugepage_size)} hugepages, {len(p.slabs)} cudaHostRegister call(s)"
        )
    return out
