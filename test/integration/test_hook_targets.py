"""Guard against upstream drift: every hook target of every integration module resolves
in the pinned sglang, and every hook module says what it hooks and why."""

import importlib

from sglang_cp.doctor import unresolved_hook_targets
from sglang_cp.integration import all_hooks, hook_modules


def test_every_hook_target_resolves_in_pinned_sglang():
    assert all_hooks(), "no hooks discovered"
    assert unresolved_hook_targets() == []


def test_every_hook_module_documents_its_target_and_seed():
    for name in hook_modules():
        mod = importlib.import_module(name)
        hooks = getattr(mod, "HOOKS", ())
        if not hooks:
            continue
        doc = mod.__doc__ or ""
        for spec in hooks:
            assert spec.seed and spec.why, f"{name}: {spec.target} lacks seed/why"
            leaf = spec.target.rsplit(".", 1)[-1]
            assert leaf in doc, f"{name}: docstring does not name its target {spec.target}"
