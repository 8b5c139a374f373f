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


def test_upstream_page_placement_answers_python_ints_as_it_answers_tensors():
    """The sharded restore applies upstream's PageInterleavePlacement to Python ints (backend._pages: a
    tensor op per call would release the GIL); that holds while its arithmetic is what it is today."""
    import torch
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec

    for shard_size, page_size in [(2, 64), (4, 64), (8, 32), (3, 16)]:
        for rank in range(shard_size):
            placement = PageInterleavePlacement(PageShardSpec(
                shard_rank=rank, shard_size=shard_size, page_size=page_size, max_prefix_tokens=0, chunk_tokens=0))
            locs = torch.arange(0, 40 * shard_size * page_size, page_size // 2, dtype=torch.int64)
            owners, local = placement.owner_of(locs).tolist(), placement.local_index(locs).tolist()
            assert [placement.owner_of(x) for x in locs.tolist()] == owners
            assert [placement.local_index(x) for x in locs.tolist()] == local
