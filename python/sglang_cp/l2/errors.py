"""Errors of the hugepage L2 tier. Each names the setting at fault and the fix."""

from __future__ import annotations


class HugepageL2Error(RuntimeError):
    """Base class: the hugepage host pool cannot be built as configured."""


class NotHugetlbfsError(HugepageL2Error):
    """The configured directory is missing or is not a hugetlbfs mount."""


class InsufficientHugepagesError(HugepageL2Error):
    """Preflight found fewer free hugepages than the slabs need."""


class SlabPlanError(HugepageL2Error):
    """No slab size satisfies the cap, the hugepage size and the pool's page unit."""


class SlabOwnershipError(HugepageL2Error):
    """A live process already owns slab files this rank would create."""


class RegistrationError(HugepageL2Error):
    """cudaHostRegister / cudaHostUnregister of a slab failed."""
