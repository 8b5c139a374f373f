"""Fixed-size slot allocator: O(1) alloc/free, loud on double free or out-of-range slots.

Owned by exactly one thread (the store's write thread), so it takes no lock.
"""

from __future__ import annotations

from typing import Iterable

from .errors import L3InvariantError


class SlotAllocator:
    def __init__(self, num_slots: int, name: str = ""):
        if num_slots < 1:
            raise ValueError(f"SlotAllocator {name!r}: num_slots must be >= 1, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        self._used = bytearray(num_slots)
        # Stack popped from the end: low slots first, which keeps a lightly used slab compact.
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    def occupancy(self) -> float:
        return self.used / self.num_slots

    def alloc(self) -> int | None:
        """A free slot, or None when full (the caller decides: GC or fail soft)."""
        if not self._free:
            return None
        s = self._free.pop()
        if self._used[s]:
            raise L3InvariantError(f"slot allocator {self.name!r}: free list handed out slot {s} which is in use")
        self._used[s] = 1
        return s

    def free_slot(self, slot: int) -> None:
        self._check(slot)
        if not self._used[slot]:
            raise L3InvariantError(f"slot allocator {self.name!r}: double free of slot {slot}")
        self._used[slot] = 0
        self._free.append(slot)

    def is_used(self, slot: int) -> bool:
        self._check(slot)
        return bool(self._used[slot])

    def rebuild_from_allocated(self, allocated: Iterable[int]) -> None:
        """Reset to exactly `allocated` in use (recovery); duplicates are an invariant violation."""
        used = bytearray(self.num_slots)
        for s in allocated:
            self._check(s)
            if used[s]:
                raise L3InvariantError(f"slot allocator {self.name!r}: slot {s} claimed twice during rebuild")
            used[s] = 1
        self._used = used
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if not used[s]]

    def reset(self) -> None:
        self.rebuild_from_allocated(())

    def _check(self, slot: int) -> None:
        if not (isinstance(slot, int) and 0 <= slot < self.num_slots):
            raise L3InvariantError(f"slot allocator {self.name!r}: slot {slot!r} out of range [0, {self.num_slots})")
