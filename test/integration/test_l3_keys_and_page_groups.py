"""Key identity and page-group validation (the boundary checks of the L3 backend)."""

import dataclasses

import pytest
import torch

from sglang_cp.integration.cp_l3.keys import KeyIdentity, KeyScheme
from sglang_cp.integration.cp_l3.page_groups import PageGroupError, validate_page_aligned

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
