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
        from sglang_cp.args import install_error_hook

        install_error_hook()
        _state["registered"] = True
        logger.info("sglang-cp plugin registered %d hooks", len(specs))
        return True
    except Exception as e:  # never raise into SGLang
        _state["disabled_reason"] = f"registration failed: {e!r}"
        logger.exception("sglang-cp plugin failed to register; SGLang runs without it")
        _register_failure_notice(f"{type(e).__name__}: {e}")
        return False


# Our flags, as a plain list: the notice must work even when sglang_cp.args is what failed to import
# (test/unit/test_flag_lists.py keeps it equal to args' flags).
FLAGS = ("--enable-cp-l3", "--cp-l3-config", "--cp-l3-cold-start", "--enable-cp-shared-physical-l2-hicache",
         "--cp-shared-l2-hugetlbfs-dir", "--cp-hicache-max-slab-gb", "--cp-hicache-placement-assert")


def _register_failure_notice(cause: str) -> None:
    """After a failed registration, SGLang's parser would answer our flags with only "unrecognized
    arguments: --enable-cp-l3". Add the flags back as an argument group whose every flag fails with the
    real cause instead. Changes nothing else: a command line without our flags parses as upstream's."""
    import argparse

    class _Unavailable(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string}: the sglang-cp plugin is installed but failed to register "
                         f"({cause}); SGLang runs without it. Run `sglang-cp doctor` to see what failed and "
                         "fix the installation, or drop the sglang-cp flags")

    def add_cli_args_around(original, parser):
        result = original(parser)
        if not any(f in a.option_strings for a in parser._actions for f in FLAGS):
            group = parser.add_argument_group("sglang-cp (failed to register: its flags are unavailable)")
            for flag in FLAGS:
                group.add_argument(flag, action=_Unavailable, nargs="?", help=argparse.SUPPRESS)
        return result

    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", add_cli_args_around,
                              HookType.AROUND)
    except Exception:  # never raise into SGLang; the log above already names the cause
        logger.exception("sglang-cp: could not install the notice for its unavailable flags")


def status() -> dict:
    return dict(_state)
