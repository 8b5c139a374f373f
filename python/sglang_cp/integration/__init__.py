"""Everything that touches sglang internals lives here, a package per concern:

- ``server_args/``  our flags on upstream's parser and ``ServerArgs`` (``cli``), their
                    validation in upstream's resolution steps (``resolution``).
- ``cp_l3/``        the L3 tier as upstream's HiCache storage backend: the backend class
                    (``backend``), its keys and rank identity (``keys``, ``identity``), the
                    storage config (``config``), backup operations (``backup``), the restore
                    path and its plan (``prefetch``, ``plan``), backend selection under KV
                    sharding (``backend_select``).
- ``l2/``           hugepage-backed host pools (``host_pool``) and upstream's own hugepage
                    allocator made strict (``hugepage_strict``).
- ``compute/``      checks ported from the seeds, each named after what it checks.

Hook modules are discovered, not listed: every module of this package tree that defines
``HOOKS`` (a tuple of :class:`~sglang_cp.integration.hookspec.HookSpec`) contributes its
hooks. Modules without ``HOOKS`` are shared helpers of the hook modules.
"""

from __future__ import annotations

import importlib
import pkgutil

from sglang_cp.integration.hookspec import HookSpec


def hook_modules() -> list[str]:
    """Every module of the package tree (helpers included), sorted by dotted name."""
    return sorted(
        m.name
        for m in pkgutil.walk_packages(__path__, prefix=f"{__name__}.")
        if not m.ispkg and not m.name.rsplit(".", 1)[1].startswith("_") and m.name != f"{__name__}.hookspec"
    )


def all_hooks() -> list[tuple[str, HookSpec]]:
    """(module name, spec) for every hook of every integration module."""
    out: list[tuple[str, HookSpec]] = []
    for name in hook_modules():
        mod = importlib.import_module(name)
        for spec in getattr(mod, "HOOKS", ()):
            out.append((name, spec))
    return out
