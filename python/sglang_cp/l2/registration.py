"""One cudaHostRegister per slab, and its undo.

A single registration over ~1 TiB fails on current drivers, and a cudaMemcpy*Async
whose host range straddles two registrations fails with cudaErrorInvalidValue (seed
item "split host cache into page-aligned slabs"). So registrations are exactly the
slabs: never merged, never chunked further.
"""

from __future__ import annotations

import logging

from sglang_cp.l2.errors import RegistrationError
from sglang_cp.l2.slab_plan import fmt_gb

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_DEFAULT = 0


def _cudart():
    import torch

    if not torch.cuda.is_available():
        raise RegistrationError("cudaHostRegister of L2 slabs needs CUDA, which this process does not have")
    return torch.cuda.cudart()


def register_mapping(mapping) -> list[tuple[int, int]]:
    """Register every slab of ``mapping``; all or nothing. Returns the registered ranges."""
    if mapping.registered:
        raise RegistrationError(f"L2 slabs of {mapping.plan.label!r} are already registered")
    cudart = _cudart()
    done = []
    for i, (ptr, size) in enumerate(mapping.slab_ranges()):
        rc = int(cudart.cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_DEFAULT))
        if rc != 0:
            for p, _ in reversed(done):
                cudart.cudaHostUnregister(p)
            raise RegistrationError(
                f"cudaHostRegister of HiCache host pool {mapping.plan.label!r} slab "
                f"{i + 1}/{len(mapping.plan.slabs)} ({fmt_gb(size)} at {ptr:#x}) failed: rc={rc} "
                f"({cudart.cudaGetErrorString(rc)}); lower --cp-hicache-max-slab-gb so each "
                f"slab fits one registration"
            )
        done.append((ptr, size))
    mapping.registered = done
    return list(done)


def unregister_mapping(mapping) -> None:
    if not mapping.registered:
        return
    cudart = _cudart()
    failed = []
    for ptr, size in reversed(mapping.registered):
        rc = int(cudart.cudaHostUnregister(ptr))
        if rc != 0:
            failed.append((ptr, size))
            logger.warning("cudaHostUnregister of L2 slab %#x (%d bytes) failed: rc=%d", ptr, size, rc)
    mapping.registered = failed[::-1]
