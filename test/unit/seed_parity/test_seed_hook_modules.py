"""The seed hook modules themselves: every candidate target resolves in the
pinned sglang, every module names its targets and seed item, and the
env-gated CUDA-graph module registers nothing unless its gate is set."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from _ported import SEED_HOOK_MODULES


def _specs(mod):
    return getattr(mod, "CANDIDATE_HOOKS", mod.HOOKS)


@pytest.mark.parametrize("name", SEED_HOOK_MODULES)
def test_candidate_targets_resolve_and_are_documented(name):
    mod = importlib.import_module(name)
    assert _specs(mod)
    doc = mod.__doc__ or ""
    for spec in _specs(mod):
        owner, attr = spec.target.rsplit(".", 1)
        obj = pkgutil.resolve_name(owner)
        assert callable(getattr(obj, attr)), spec.target
        assert attr in doc and spec.seed and spec.why
        assert spec.seed.split()[0] in ("000#3", "002#17"), spec.seed


def test_every_seed_module_in_the_package_is_covered_by_red_green():
    import sglang_cp.integration as integ

    on_disk = {n for n in integ.hook_modules() if n.startswith("sglang_cp.integration.compute.")}
    assert on_disk == set(SEED_HOOK_MODULES)


def test_cuda_graph_hooks_register_only_when_the_env_gate_is_set(monkeypatch):
    import sglang_cp.integration.compute.cuda_graph_buffer_log as mod

    monkeypatch.delenv("SGLANG_CP_LOG_CG_BUFFERS", raising=False)
    assert importlib.reload(mod).HOOKS == ()
    monkeypatch.setenv("SGLANG_CP_LOG_CG_BUFFERS", "1")
    assert importlib.reload(mod).HOOKS == mod.CANDIDATE_HOOKS
    monkeypatch.delenv("SGLANG_CP_LOG_CG_BUFFERS")
    importlib.reload(mod)
