"""Memcpy-based page transfers between a host pool and a device buffer, split at slabs.

Consecutive pages (host and device both consecutive) merge into one copy, as a
restore of a long prefix would; each merged run is then cut at slab boundaries, so
every cudaMemcpyAsync stays inside one registration. This is the transfer path the
benchmark and the GPU tests exercise on real hardware.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sglang_cp.l2.transfer_split import split_byte_range


def page_runs(host_pages: np.ndarray, device_pages: np.ndarray) -> list[tuple[int, int, int]]:
    """(host_start, device_start, n_pages) for maximal runs consecutive on both sides."""
    host_pages = np.asarray(host_pages, dtype=np.int64)
    device_pages = np.asarray(device_pages, dtype=np.int64)
    if host_pages.shape != device_pages.shape:
        raise ValueError(f"{host_pages.shape[0]} host pages vs {device_pages.shape[0]} device pages")
    if host_pages.size == 0:
        return []
    brk = np.nonzero((np.diff(host_pages) != 1) | (np.diff(device_pages) != 1))[0] + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [host_pages.size]))
    return [(int(host_pages[s]), int(device_pages[s]), int(e - s)) for s, e in zip(starts, ends)]


def plan_copies(host_pages, device_pages, page_bytes: int, boundaries: Sequence[int]) -> list[tuple[int, int, int]]:
    """(host_byte, device_byte, nbytes) per cudaMemcpyAsync, none straddling a boundary."""
    copies = []
    for h, d, n in page_runs(host_pages, device_pages):
        for off, ln in split_byte_range(h * page_bytes, n * page_bytes, boundaries):
            copies.append((off, d * page_bytes + (off - h * page_bytes), ln))
    return copies


def copy_pages(host: torch.Tensor, device: torch.Tensor, copies, *, to_device: bool) -> int:
    """Issue the planned copies on the current stream (async). Returns bytes moved."""
    if host.dtype != torch.uint8 or device.dtype != torch.uint8 or host.dim() != 1 or device.dim() != 1:
        raise TypeError("copy_pages takes flat uint8 host and device views")
    moved = 0
    for h, d, n in copies:
        hv, dv = host.narrow(0, h, n), device.narrow(0, d, n)
        if to_device:
            dv.copy_(hv, non_blocking=True)
        else:
            hv.copy_(dv, non_blocking=True)
        moved += n
    return moved
