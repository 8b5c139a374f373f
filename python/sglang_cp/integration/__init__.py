"""Everything that touches sglang internals lives here: one module per upstream hook point.

Modules are discovered, not listed: every module in this package that defines
``HOOKS`` (a tuple of :class:`~sglang_cp.integration.hookspec.HookSpec`) contributes
its hooks. Modules without ``HOOKS`` are shared helpers of the hook modules.
"""

from __future__ import annotations

import importlib
import pkgutil

from sglang_cp.integration.hookspec import HookSpec


def hook_modules() -> list[str]:
    return sorted(
        f"{__name__}.{m.name}"
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name != "hookspec"
    )


def all_hooks() -> list[tuple[str, HookSpec]]:
    """(module name, spec) for every hook of every integration module."""
    out: list[tuple[str, HookSpec]] = []
    for name in hook_modules():
        mod = importlib.import_module(name)
        for spec in getattr(mod, "HOOKS", ()):
            out.append((name, spec))
    return out
