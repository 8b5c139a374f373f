"""Hugepage-backed host tensors for HiCache pools: plan, preflight, map; never fall back.

``HugepageHostAllocator.allocate`` is what a host pool calls instead of an anonymous
mmap: the pool's bytes are planned into slabs, the free hugepages are checked for
all of them (taking earlier pools into account, since their pages are already
reserved), and only then are files created, truncated and mapped. Any failure is an
exception naming the fix; there is no path to ordinary 4 KiB memory.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_cp.l2.hugetlbfs import HugetlbfsMount
from sglang_cp.l2.slab_files import SlabFileName, layout_tag, reclaim_stale
from sglang_cp.l2.slab_mapping import SlabMapping
from sglang_cp.l2.slab_plan import GiB, SlabPlan, describe, plan_slabs, preflight

logger = logging.getLogger(__name__)

SLABS_ATTR = "_sglang_cp_l2_slabs"

_reclaimed_once: set[tuple[str, str]] = set()
_reclaim_lock = threading.Lock()


@dataclass(frozen=True)
class HugepageL2Config:
    hugetlbfs_dir: str
    max_slab_gb: float
    namespace: str  # separates servers on one node (their --port)
    rank: int
    prefault_threads: int = 8  # threads faulting slab pages in before registration

    @property
    def max_slab_bytes(self) -> int:
        return int(self.max_slab_gb * GiB)


def slabs_of(tensor: torch.Tensor) -> Optional[SlabMapping]:
    """The slab mapping behind a tensor this allocator returned, else None."""
    return getattr(tensor, SLABS_ATTR, None)


class HugepageHostAllocator:
    def __init__(self, config: HugepageL2Config, mount: Optional[HugetlbfsMount] = None):
        if config.max_slab_gb <= 0:
            raise ValueError(f"--cp-hicache-max-slab-gb must be positive, got {config.max_slab_gb}")
        self.config = config
        self.mount = mount if mount is not None else HugetlbfsMount.probe(config.hugetlbfs_dir)
        self.mappings: list[weakref.ref] = []
        self.reclaimed = self._reclaim_once()

    def _reclaim_once(self) -> list[str]:
        # Before the first preflight: a crashed run's files still hold their hugepages.
        key = (os.path.realpath(self.mount.path), self.config.namespace)
        with _reclaim_lock:
            if key in _reclaimed_once:
                return []
            out = reclaim_stale(self.mount.path, self.config.namespace, self.config.rank)
            _reclaimed_once.add(key)
            return out

    def plan(self, label: str, nbytes: int, unit_bytes: int) -> SlabPlan:
        return plan_slabs(label, nbytes, unit_bytes, self.mount.hugepage_size, self.config.max_slab_bytes)

    def allocate(self, dims: tuple, dtype: torch.dtype, *, label: str, layout: str, unit_bytes: int) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(dims) * itemsize
        plan = self.plan(label, nbytes, unit_bytes)
        preflight([plan], self.mount.capacity())
        tag = layout_tag(layout, tuple(dims), str(dtype), unit_bytes, plan.hugepage_size, plan.max_slab_bytes)
        paths = [
            os.path.join(
                self.mount.path,
                SlabFileName.for_this_process(
                    self.config.namespace, self.config.rank, label, tag, s.index, len(plan.slabs)
                ).format(),
            )
            for s in plan.slabs
        ]
        mapping = SlabMapping(plan, self.mount, paths).map(self.config.prefault_threads)
        array = (ctypes.c_uint8 * nbytes).from_address(mapping.base)
        # The mapping lives exactly as long as the last view of the tensor.
        weakref.finalize(array, mapping.close)
        tensor = torch.frombuffer(array, dtype=torch.uint8, count=nbytes).view(dtype).reshape(dims)
        setattr(tensor, SLABS_ATTR, mapping)
        self.mappings.append(weakref.ref(mapping))
        for line in describe([plan]):
            logger.info("sglang-cp L2 hugepage pool on %s: %s", self.mount.path, line)
        return tensor

    def live_mappings(self) -> list[SlabMapping]:
        return [m for m in (r() for r in self.mappings) if m is not None and not m.closed]

    def close(self) -> None:
        """Clean shutdown: unregister, unmap and unlink every slab this allocator made.

        Tensors still referencing the memory must not be used afterwards.
        """
        for m in self.live_mappings():
            m.close()
