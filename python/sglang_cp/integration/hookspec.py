"""The one shape every upstream hook of sglang-cp takes.

Each module in ``sglang_cp.integration`` owns one upstream hook point and exposes
``HOOKS: tuple[HookSpec, ...]``. ``sglang_cp.plugin.register()`` registers them with
upstream's ``HookRegistry`` (or, for ``kind="resolution"``, with
``arg_groups.resolution_hooks.register_resolution_hook``). Hooks are registered in every
SGLang process before flags are known, so each hook function must check its flag at
call time and fall through to the original when the flag is off (behaviour-neutral).

``test/integration/test_hook_targets.py`` resolves every ``target`` against the pinned
sglang: that test is the guard against upstream drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

KINDS = ("before", "after", "around", "replace", "resolution")


@dataclass(frozen=True)
class HookSpec:
    target: str  # dotted upstream path, or a resolution step name for kind="resolution"
    kind: str  # one of KINDS
    fn: Callable
    seed: str  # the seed item this hook serves
    why: str  # why this upstream symbol, in one line

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"HookSpec.kind must be one of {KINDS}, got {self.kind!r}")
