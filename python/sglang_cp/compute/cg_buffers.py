"""Attribute CUDA-graph memory to the static buffers and shapes that hold it.

Captured graphs keep their static input/output tensors alive for the life of
the process, and every captured shape can grow the shared graph memory pool.
When decode runs three graph families (target verify, draft, draft-extend) the
question "where did the GPU memory go" needs a per-buffer table per family, with
buffers that are aliased onto an earlier family's storage (upstream's
process-wide ``share_input_buffer`` pool) counted once, plus the pool growth of
each captured shape. This module computes those numbers; it imports no sglang.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator

import torch

MB = 1 << 20


def iter_named_tensors(obj, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of a buffer set: dataclass fields, dict items or plain attributes,
    recursively (buffer sets nest dataclasses of tensors)."""
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield prefix or "<tensor>", obj
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = ((f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj))
    elif isinstance(obj, dict):
        items = obj.items()
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return
    for name, value in items:
        full = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, torch.Tensor):
            yield full, value
        elif dataclasses.is_dataclass(value) or isinstance(value, dict):
            yield from iter_named_tensors(value, full)


@dataclass(frozen=True)
class BufferRow:
    name: str
    shape: tuple
    dtype: str
    mb: float
    shared_with: str | None  # "<family>.<buffer>" that first owned this storage


@dataclass
class BufferLedger:
    """Process-wide: which family first registered each storage."""

    owners: dict[int, str] = field(default_factory=dict)

    def table(self, family: str, buffers) -> list[BufferRow]:
        rows = []
        for name, t in iter_named_tensors(buffers):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            first = self.owners.get(key)
            shared = first if first is not None and not first.startswith(f"{family}.") else None
            if first is None and storage.nbytes() > 0:
                self.owners[key] = f"{family}.{name}"
            rows.append(
                BufferRow(
                    name=name,
                    shape=tuple(t.shape),
                    dtype=str(t.dtype).replace("torch.", ""),
                    mb=t.numel() * t.element_size() / MB,
                    shared_with=shared,
                )
            )
        return rows


def own_mb(rows: list[BufferRow]) -> float:
    """Memory this family adds: buffers aliased onto an earlier family are free."""
    return sum(r.mb for r in rows if r.shared_with is None)


def format_buffer_table(family: str, rows: list[BufferRow]) -> str:
    width = max([len(r.name) for r in rows] + [6])
    lines = [f"[cg-buffers] {family}: {len(rows)} static buffers, {own_mb(rows):.2f} MB own"]
    lines.append(f"  {'buffer':<{width}}  {'shape':<22} {'dtype':<9} {'MB':>9}  shared")
    for r in sorted(rows, key=lambda r: -r.mb):
        lines.append(
            f"  {r.name:<{width}}  {str(r.shape):<22} {r.dtype:<9} {r.mb:>9.3f}  "
            f"{r.shared_with or '-'}"
        )
    return "\n".join(lines)


@dataclass
class ShapeGrowth:
    """Graph-pool growth per captured shape of one family."""

    family: str
    deltas: list[tuple[str, int]] = field(default_factory=list)

    def add(self, shape: str, delta_bytes: int) -> str:
        self.deltas.append((shape, delta_bytes))
        return f"[cg-buffers] {self.family} shape {shape}: pool +{delta_bytes / MB:.2f} MB"

    def total_line(self) -> str:
        total = sum(d for _, d in self.deltas)
        return (
            f"[cg-buffers] {self.family} TOTAL over {len(self.deltas)} shapes: "
            f"pool +{total / MB:.2f} MB"
        )
