"""Key identity and page-group validation (the boundary checks of the L3 backend)."""

import dataclasses

import pytest
import torch

from sglang_cp.integration.cp_l3.keys import KeyIdentity, KeyScheme
from sglang_cp.integration.cp_l3.page_groups import PageGroupError, validate_page_aligned
from suite_helpers import gil_releases_seen

BASE = KeyIdentity(model="glm-5", dtype="torch.float8_e4m3fn", page_size=64, layout="page_first",
                   rank_replicated=True, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, cp_size=4,
                   cp_strategy="interleave", sharded=True, page_bytes=(("kv", 3274752),),
                   logical_dtypes=(("kv", "torch.float8_e4m3fn"),))


@pytest.mark.parametrize("field,value", [
    ("model", "deepseek-v3.2"), ("dtype", "torch.bfloat16"), ("page_size", 32), ("layout", "layer_first"),
    ("rank_replicated", False), ("tp_rank", 1), ("tp_size", 2), ("pp_rank", 1), ("pp_size", 2),
    ("cp_size", 2), ("cp_strategy", "zigzag"), ("sharded", False), ("page_bytes", (("kv", 4096),)),
    ("logical_dtypes", (("kv", "torch.float8_e5m2"),)),
])
def test_every_identity_field_changes_the_keyspace(field, value):
    other = dataclasses.replace(BASE, **{field: value})
    assert KeyScheme(other).key("ab" * 32, 0) != KeyScheme(BASE).key("ab" * 32, 0)


def test_owner_rank_is_part_of_the_key_and_bounded():
    ks = KeyScheme(BASE)
    assert len({ks.key("cd" * 32, r) for r in range(4)}) == 4
    assert ks.key("cd" * 32, 2) == KeyScheme(BASE).key("cd" * 32, 2)  # deterministic
    with pytest.raises(ValueError, match="outside cp size 4"):
        ks.key("cd" * 32, 4)


def test_batch_keys_equal_single_keys_and_check_the_owner():
    ks = KeyScheme(BASE)
    hashes = ["cd" * 32, "ab" * 32, ""]
    for r in range(4):
        assert ks.keys(hashes, r) == [ks.key(h, r) for h in hashes]
        assert [ks.prefix(r) + s for s in ks.suffixes(hashes)] == ks.keys(hashes, r)  # the hit query's split
    with pytest.raises(ValueError, match="outside cp size 4"):
        ks.keys(hashes, 4)


def test_page_groups_accept_whole_aligned_pages():
    idx = torch.cat([torch.arange(128, 192), torch.arange(0, 64)])
    assert validate_page_aligned(idx, 64, 2) == [128, 0]


@pytest.mark.parametrize("idx,n,msg", [
    (torch.arange(0, 100), 2, "partial page"),
    (torch.arange(1, 129), 2, "not a multiple of page_size=64"),
    (torch.cat([torch.arange(0, 63), torch.tensor([99])]), 1, "not 64 consecutive slots"),
    (None, 1, "missing"),
])
def test_page_groups_reject_malformed_groups(idx, n, msg):
    with pytest.raises(PageGroupError, match=msg):
        validate_page_aligned(idx, 64, n)


@pytest.mark.parametrize("dtype,contiguous", [(torch.int64, True), (torch.int64, False), (torch.int32, True)])
def test_page_groups_give_one_answer_on_every_path(dtype, contiguous):
    """Upstream's int64 host indices take the native check; any other tensor the torch one: same starts,
    same refusals (the native check hands a bad group to the torch one, which names it)."""
    rng = torch.Generator().manual_seed(7)
    pages = torch.randperm(64, generator=rng)[:48]
    idx = (pages[:, None] * 64 + torch.arange(64)).reshape(-1).to(dtype)
    if not contiguous:
        idx = torch.stack([idx, idx], dim=1)[:, 0]
        assert not idx.is_contiguous()
    assert validate_page_aligned(idx, 64, 48) == (pages * 64).tolist()
    for where, value, msg in [(5 * 64, 7, "not a multiple"), (5 * 64 + 10, 0, "consecutive"),
                              (47 * 64 + 63, 0, "consecutive")]:
        bad = idx.clone()
        bad[where] = value
        with pytest.raises(PageGroupError, match=msg):
            validate_page_aligned(bad, 64, 48)


def test_native_page_starts_match_the_definition():
    from sglang_cp.l3 import native

    rng = torch.Generator().manual_seed(11)
    for page_size in (1, 2, 64):
        pages = torch.randperm(300, generator=rng)[:100]
        idx = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1).contiguous()
        assert native.page_starts(idx.data_ptr(), 100, page_size) == (pages * page_size).tolist()
        if page_size > 1:
            idx[page_size * 99 + 1] += 1  # the last group's second index
            assert native.page_starts(idx.data_ptr(), 100, page_size) is None
    assert native.page_starts(idx.data_ptr(), 0, 64) == []


def test_page_groups_of_a_prefetch_keep_the_gil():
    """Checking a 2,048-page prefetch's host indices does not release the GIL: beside a server's busy
    scheduler thread each release costs up to CPython's 5 ms switch interval (60-100 ms per prefetch
    when the check was torch ops)."""
    idx = (torch.randperm(4096)[:2048, None] * 64 + torch.arange(64)).reshape(-1).contiguous()
    starts, ran = gil_releases_seen(validate_page_aligned, idx, 64, 2048)
    assert len(starts) == 2048
    assert ran == 0, f"the check released the GIL: another thread ran {ran} loop turns meanwhile"
