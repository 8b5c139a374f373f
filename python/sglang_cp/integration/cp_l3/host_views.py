"""Bytes of host-pool pages without a GIL release per page.

Why: a torch op that goes through the dispatcher (``view``, ``flatten``, ``empty``) releases the GIL, and
a thread that released it gets it back from a thread running Python -- a server's scheduler loop -- only
at CPython's switch interval (5 ms). Turning upstream's page tensor into bytes took two such ops per
page: with a busy Python thread beside it, a 64-page restore spent 1.1 s there
(``docs_internal/figures.md``, "A busy scheduler thread").

Here upstream's ``get_data_page`` still locates every page, so each layout and index mapping stays
upstream's; the page's bytes are then a numpy slice of one uint8 view of the pool buffer that holds it,
made once per buffer. A page that is not contiguous, or that lies in no contiguous CPU tensor of its
pool, gets ``None`` and the caller takes the per-page path as before.

Why the slice is the page: the cached buffer is a live tensor (this object holds it), so no other
tensor's memory can overlap its range; a page whose bytes lie inside that range is those bytes. A pool
that reallocates its buffer puts its pages outside the old range, and the buffer is looked up again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class HostBuffer:
    """One contiguous CPU tensor of a host pool, and a uint8 numpy view of all of it."""

    tensor: torch.Tensor  # held: its memory cannot be freed and reused while we slice it
    start: int  # address of its first byte
    nbytes: int
    flat: Any  # numpy uint8 view of the same memory


class HostPageBytes:
    """Per payload, the host-pool buffer its pages were last found in (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[str, HostBuffer] = {}

    def of(self, payload: str, pool, page: torch.Tensor):
        """A writable uint8 numpy view of ``page`` (a contiguous tensor from ``pool.get_data_page(...,
        flat=False)``), or None where no contiguous CPU tensor of ``pool`` holds it."""
        start = page.data_ptr()
        n = page.numel() * page.element_size()
        buf = self._buffers.get(payload)
        if buf is None or not (buf.start <= start and start + n <= buf.start + buf.nbytes):
            buf = _find_buffer(pool, start, n)
            if buf is None:
                return None
            self._buffers[payload] = buf
        offset = start - buf.start
        return buf.flat[offset: offset + n]

    def page(self, payload: str, pool, page: torch.Tensor):
        """The bytes of a contiguous page: its slice of the pool buffer, else a view of the page itself."""
        out = self.of(payload, pool, page)
        return out if out is not None else as_bytes_view(page)


def as_bytes_view(t: torch.Tensor):
    """A writable uint8 numpy view of a CPU tensor: no copy where it is contiguous (a flat copy otherwise)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(-1).view(torch.uint8).numpy()


def _find_buffer(pool, start: int, n: int) -> Optional[HostBuffer]:
    for value in vars(pool).values():
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_contiguous():
            base, size = value.data_ptr(), value.numel() * value.element_size()
            if base <= start and start + n <= base + size:
                try:
                    flat = as_bytes_view(value)
                except (RuntimeError, TypeError):  # a tensor numpy cannot view as bytes: the per-page path
                    return None
                return HostBuffer(value, base, size, flat)
    return None
