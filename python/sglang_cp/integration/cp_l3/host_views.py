"""Bytes of host-pool pages without a GIL release per page.

Why: a torch op that goes through the dispatcher (``view``, ``flatten``, ``empty``) releases the GIL, and
a thread that released it gets it back from a thread running Python -- a server's scheduler loop -- only
at CPython's switch interval (5 ms). Turning upstream's page tensor into bytes took two such ops per
page: with a busy Python thread beside it, a 64-page restore spent 1.1 s there
(``docs_internal/figures.md``, "A busy scheduler thread").

Here upstream's ``get_data_page`` still locates every page (once per row, below), so each layout and
index mapping stays upstream's; the page's bytes are then a numpy slice of one uint8 view of the pool
buffer that holds it, made once per buffer. A page that is not contiguous, or that lies in no contiguous CPU tensor of its
pool, gets ``None`` and the caller takes the per-page path as before.

Why the slice is the page: the cached buffer is a live tensor (this object holds it), so no other
tensor's memory can overlap its range; a page whose bytes lie inside that range is those bytes. A pool
that reallocates its buffer puts its pages outside the old range, and the buffer is looked up again.

``row()`` also keeps each row's slice once upstream located it: the page tensor ``get_data_page`` returns
releases the GIL when it is freed (a torch tensor's deallocation does), so a row costs that once, not at
every backup and restore. The slices stay valid while the pool still holds the buffer under the attribute
it was found under (checked at every call; otherwise they are dropped and the rows located again). At
most one slice per page of the pool is kept.
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
    attr: str  # the pool's attribute that holds it


class HostPageBytes:
    """Per payload, the host-pool buffer its pages were last found in (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[str, HostBuffer] = {}
        # payload -> (the buffer its rows lie in, row -> the row's bytes in it)
        self._rows: dict[str, tuple[HostBuffer, dict[int, Any]]] = {}
        # payloads whose pages are not contiguous (a layout's property, e.g. layer_first): row() answers
        # None at once, and the caller's own get_data_page is the only one per page
        self._strided: set[str] = set()

    def row(self, payload: str, pool, row: int):
        """The bytes of the page at ``row`` (upstream's ``get_data_page(row, flat=False)``) as a writable
        uint8 numpy view of its own memory, or None where that page is not contiguous (the caller
        copies). Upstream locates each row once; later calls are a lookup (see the module docstring)."""
        if payload in self._strided:
            return None
        kept = self._rows.get(payload)
        if kept is not None:
            buf, rows = kept
            if vars(pool).get(buf.attr) is buf.tensor:
                out = rows.get(row)
                if out is not None:
                    return out
            else:  # the pool let go of that buffer: every row is located again
                del self._rows[payload]
        page = pool.get_data_page(row, flat=False)
        if not page.is_contiguous():
            self._strided.add(payload)
            return None
        out = self.of(payload, pool, page)
        if out is None:
            # In no buffer of the pool: the caller's per-page path. Not the page tensor's own bytes: a pool
            # whose get_data_page builds a copy would take a restore's reads into that copy, not the pool.
            return None
        buf = self._buffers[payload]
        kept = self._rows.get(payload)
        if kept is None or kept[0] is not buf:
            kept = self._rows[payload] = (buf, {})
        kept[1][row] = out
        return out

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


def as_bytes_view(t: torch.Tensor):
    """A writable uint8 numpy view of a CPU tensor: no copy where it is contiguous (a flat copy otherwise)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(-1).view(torch.uint8).numpy()


def _find_buffer(pool, start: int, n: int) -> Optional[HostBuffer]:
    for name, value in vars(pool).items():
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_contiguous():
            base, size = value.data_ptr(), value.numel() * value.element_size()
            if base <= start and start + n <= base + size:
                try:
                    flat = as_bytes_view(value)
                except (RuntimeError, TypeError):  # a tensor numpy cannot view as bytes: the per-page path
                    return None
                return HostBuffer(value, base, size, flat, name)
    return None
