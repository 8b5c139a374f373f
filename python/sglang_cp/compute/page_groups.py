"""Validate that token indices form whole, aligned, contiguous pages.

Native transfer code (and the page-id derivations in front of it) reads only the
first index of each ``page_size`` group and assumes the rest follow. A partial,
misaligned or non-contiguous group therefore does not fail there: it silently
moves a different page. Checking at the boundary turns that into a loud error
that names the argument.
"""

from __future__ import annotations

import torch


class PageGroupError(ValueError):
    """Token indices that are not whole, aligned, contiguous pages."""


def validate_page_aligned_token_indices(
    indices: torch.Tensor, page_size: int, *, name: str = "indices"
) -> None:
    """Raise PageGroupError unless ``indices`` is a concatenation of whole pages.

    Whole page ``p`` means exactly ``[p*page_size, ..., p*page_size + page_size - 1]``
    in order. Pages may appear in any order relative to each other. An empty
    tensor is valid. Cost: one pass over the indices on their own device; callers
    on a hot path decide whether a device tensor is worth the host sync.
    """
    if page_size <= 0:
        raise PageGroupError(f"page_size must be positive, got {page_size}")
    if indices.dim() != 1:
        raise PageGroupError(
            f"{name} must be a 1-D token index tensor, got shape {tuple(indices.shape)}"
        )
    n = indices.numel()
    if n == 0:
        return
    if n % page_size:
        raise PageGroupError(
            f"{name} holds {n} token indices, not a multiple of page_size={page_size}: "
            "a partial page would be transferred as a whole one. Pass whole pages "
            "(round the length down to a page boundary at the caller)."
        )
    if page_size == 1:
        return
    groups = indices.reshape(-1, page_size).to(torch.int64)
    starts = groups[:, 0]
    misaligned = torch.nonzero(starts % page_size).flatten()
    if misaligned.numel():
        g = int(misaligned[0])
        raise PageGroupError(
            f"{name} page group {g} starts at token index {int(starts[g])}, which is "
            f"not a multiple of page_size={page_size}: only the first index of a group "
            "is used, so another page would be moved. Allocate and pass page-aligned slots."
        )
    expected = starts.unsqueeze(1) + torch.arange(
        page_size, dtype=torch.int64, device=groups.device
    )
    broken = torch.nonzero((groups != expected).any(dim=1)).flatten()
    if broken.numel():
        g = int(broken[0])
        raise PageGroupError(
            f"{name} page group {g} ({groups[g].tolist()[:8]}...) is not "
            f"{page_size} consecutive slots of one page: the tail would be read "
            "from the wrong slots. Pass each page's slots contiguously and in order."
        )


ENV_MODE = "SGLANG_CP_VALIDATE_PAGE_GROUPS"
_MODES = ("0", "host", "all")


def validation_mode() -> str:
    """``host`` (default): check tensors already on the CPU (free of device syncs);
    ``all``: also check device tensors (one host sync per transfer, for bring-up);
    ``0``: off. Read at every call so a process can flip it without re-registering."""
    import os

    raw = os.environ.get(ENV_MODE, "host").strip().lower()
    mode = {"1": "host", "on": "host", "off": "0", "false": "0", "": "host"}.get(raw, raw)
    if mode not in _MODES:
        raise PageGroupError(
            f"{ENV_MODE}={raw!r} is not one of {_MODES} (0=off, host=check CPU "
            "tensors only, all=also device tensors)"
        )
    return mode


class _RecentlyValid:
    """The last few index tensors that passed, held by weak reference.

    Layer-wise transfers hand the SAME index tensor to the page-id derivation
    once per layer (78 times for GLM-5); validating it once per transfer is
    enough. A tensor is skipped only while it is the very same live object at
    the same in-place version (``_version`` bumps on every in-place write), so a
    reused or modified tensor is always checked again. Transfer threads share it
    without a lock: a racing append/trim can only drop an entry, which costs one
    extra check, never a skipped one.
    """

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self.entries: list[tuple] = []

    def seen(self, t: torch.Tensor, page_size: int) -> bool:
        for ref, version, ps in self.entries:
            if ref() is t and version == t._version and ps == page_size:
                return True
        return False

    def add(self, t: torch.Tensor, page_size: int) -> None:
        import weakref

        self.entries.append((weakref.ref(t), t._version, page_size))
        del self.entries[: -self.capacity]


_recent = _RecentlyValid()


def check(indices, page_size: int, *, name: str, mode: str) -> None:
    """Validate ``indices`` if ``mode`` covers the device it lives on."""
    if mode == "0" or indices is None:
        return
    if not isinstance(indices, torch.Tensor):
        indices = torch.as_tensor(indices)  # some backends pass plain lists
    if mode == "host" and indices.device.type != "cpu":
        return
    if _recent.seen(indices, page_size):
        return
    validate_page_aligned_token_indices(indices, page_size, name=name)
    _recent.add(indices, page_size)
