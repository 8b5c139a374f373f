"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``sglang_cp``).

Upstream calls ``register()`` in every process it starts (launcher, engine, scheduler,
detokenizer, DP controller) before ``HookRegistry.apply_hooks()``. It must therefore be
idempotent and must never raise into SGLang: on any failure it logs and leaves SGLang
untouched (all-or-nothing: a half-registered plugin would be worse than none).

Off switches: ``SGLANG_CP_DISABLE=1`` (kill switch), and upstream's ``SGLANG_PLUGINS``
allow-list (upstream already skips us when it does not name us; we re-check so a direct
call of ``register()`` honours it too).

Version pin: the hooks patch internals of one SGLang release (``SGLANG_PIN``, the same pin as
pyproject's ``sglang==`` dependency). On any other version the plugin registers nothing, logs
why, and answers our flags with that reason: SGLang runs as without the plugin.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

PLUGIN_NAME = "sglang_cp"
SGLANG_PIN = "0.5.23"  # pyproject.toml's `sglang==` (test_plugin checks they agree)
_state = {"registered": False, "disabled_reason": None}


def installed_sglang_version() -> str | None:
    """The version of the sglang that imports here: its own ``__version__`` (the code that runs, also
    where sglang was copied in without package metadata), else the installed distribution's."""
    try:
        from sglang.version import __version__ as v

        if v and not str(v).startswith("0.0.0"):  # sglang's own fallback when it cannot tell
            return str(v)
    except Exception:
        pass
    try:
        import importlib.metadata as md

        return md.version("sglang")
    except Exception:
        return None


def sglang_pin_problem() -> str | None:
    """None when the pinned sglang is installed; otherwise one line naming the pin and the fix."""
    have = installed_sglang_version()
    fix = f'install it with pip install "sglang=={SGLANG_PIN}"'
    if have is None:
        return f"sglang is not installed; sglang-cp needs sglang=={SGLANG_PIN}: {fix}"
    if have.split("+", 1)[0] != SGLANG_PIN:  # a local label (+cu129) is the same release
        return (f"sglang {have} is installed, but sglang-cp is pinned to sglang=={SGLANG_PIN} (its hooks patch "
                f"that release's internals): {fix}, or use the sglang-cp release made for sglang {have}")
    return None


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
    pin = sglang_pin_problem()
    if pin:
        _state["disabled_reason"] = pin
        logger.error("sglang-cp plugin not loaded, SGLang runs without it: %s", pin)
        _register_failure_notice(pin, refused=True)
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


def _register_failure_notice(cause: str, refused: bool = False) -> None:
    """After a failed (or refused) registration, SGLang's parser would answer our flags with only
    "unrecognized arguments: --enable-cp-l3". Add the flags back as an argument group whose every flag
    fails with the real cause instead, in one line (argparse's error would print SGLang's whole usage
    first). Changes nothing else: a command line without our flags parses as upstream's."""
    import argparse

    what = "not loaded" if refused else "failed to register"

    class _Unavailable(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.exit(2, f"{parser.prog}: error: {option_string}: the sglang-cp plugin is installed but "
                        f"{what} ({cause}); SGLang runs without it. Run `sglang-cp doctor` to see what failed "
                        "and fix the installation, or drop the sglang-cp flags\n")

    def add_cli_args_around(original, parser):
        result = original(parser)
        if not any(f in a.option_strings for a in parser._actions for f in FLAGS):
            group = parser.add_argument_group(f"sglang-cp ({what}: its flags are unavailable)")
            from sglang_cp.args import keep_upstream_abbreviations

            keep_upstream_abbreviations(parser, [group.add_argument(flag, action=_Unavailable, nargs="?",
                                                                    help=argparse.SUPPRESS) for flag in FLAGS])
        return result

    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", add_cli_args_around,
                              HookType.AROUND)
    except Exception:  # never raise into SGLang; the log above already names the cause
        logger.exception("sglang-cp: could not install the notice for its unavailable flags")


def status() -> dict:
    return dict(_state)
