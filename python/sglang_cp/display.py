"""How our command-line tools show things to people (no sglang, no rich at import)."""

from __future__ import annotations

import os


def rel(path: str) -> str:
    """``path`` relative to the working directory when it lies under it: printed output names no
    machine's absolute paths."""
    try:
        r = os.path.relpath(path)
    except ValueError:
        return path
    return path if r.startswith("..") else r
