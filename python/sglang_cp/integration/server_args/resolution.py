"""Hook point: resolution step ``handle_hicache_ratio_default`` (``arg_groups/pipeline.py``).

``ServerArgs.resolve_once()`` runs upstream's validation pipeline in the launcher and in
``Engine(...)``; records built without the CLI (``Engine``/``ServerArgs(...)`` plus
attributes set by hand) never pass ``from_cli_args``. We re-run our validation inside
the pipeline at a HiCache step that runs before the dummy-model short circuit, so every
launch path checks our flags before any model loads. Validation is pure, so running it
twice (CLI, then here) is harmless. With ``--enable-cp-l3`` valid, this is also where our
store is declared the storage backend (``l3_backend_select.select_backend``), early
enough that every later HiCache step sees it.

Seed item served: startup validation of the CP HiCache / L3 flag combinations
("validate supported CP HiCache backend/layout combinations at server startup").
"""

from __future__ import annotations

from sglang_cp import args as cp_args
from sglang_cp.integration.hookspec import HookSpec


def validate_then_previous(server_args, previous):
    if cp_args.any_enabled(server_args) or getattr(server_args, "cp_l3_config", None):
        cp_args.validate(server_args)
        # Valid --enable-cp-l3: make our store the HiCache storage backend for every
        # later step (upstream's handle_hicache, the KV-sharding check, the controller).
        from sglang_cp.integration.cp_l3.backend_select import select_backend

        select_backend(server_args)
    return previous(server_args)


HOOKS = (
    HookSpec(
        target="handle_hicache_ratio_default",
        kind="resolution",
        fn=validate_then_previous,
        seed="validate supported CP HiCache backend/layout combinations at server startup",
        why="a model-independent HiCache step of resolve_once() that runs for every launch path",
    ),
)
