"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``sglang_cp``).

Upstream calls ``register()`` in every process it starts (launcher, engine, scheduler,
detokenizer, DP controller) before ``HookRegistry.apply_hooks()``. It must therefore be
idempotent and must never raise into SGLang: on any failure it logs and leaves SGLang
untouched (all-or-nothing: a half-registered plugin would be worse than none).

Off switches: ``SGLANG_CP_DISABLE=1`` (kill switch), and upstream's ``SGLANG_PLUGINS``
allow-list (upstream already skips us when it does not name us; we re-check so a direct
call of ``register()`` honours it too).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

PLUGIN_NAME = "sglang_cp"
_state = {"registered": False, "disabled_reason": None}


def _disabled_reason() -> str | None:
    if os.environ.get("SGLANG_CP_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "SGLANG_CP_DISABLE is set"
    allowed = os.environ.get("SGLANG_PLUGINS", "").strip()
    if allowed:
        names = {x.strip() for x in allowed.split(",") if x.strip()}
        if PLUGIN_NAME not in names:
            return f"SGLANG_PLUGINS={allowed!r} does not name {PLUGIN_NAME}"
    return None


def register() -> bool:
    """Register all sglang-cp hooks with upstream. Returns True when registered."""
    if _state["registered"]:
        return True
    reason = _disabled_reason()
    if reason:
        _state["disabled_reason"] = reason
        logger.info("sglang-cp plugin disabled: %s", reason)
        return False
    try:
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from sglang_cp.integration import all_hooks

        specs = all_hooks()  # import every hook module first: all or nothing
        for _module, spec in specs:
            if spec.kind == "resolution":
                register_resolution_hook(spec.target)(spec.fn)
            else:
                HookRegistry.register(spec.target, spec.fn, HookType[spec.kind.upper()])
        _state["registered"] = True
        logger.info("sglang-cp plugin registered %d hooks", len(specs))
        return True
    except Exception as e:  # never raise into SGLang
        _state["disabled_reason"] = f"registration failed: {e!r}"
        logger.exception("sglang-cp plugin failed to register; SGLang runs without it")
        return False


def status() -> dict:
    return dict(_state)
