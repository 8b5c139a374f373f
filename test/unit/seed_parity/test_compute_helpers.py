"""Engine-independent helpers behind the ports (python/sglang_cp/compute)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_cp.compute.cg_buffers import BufferLedger, ShapeGrowth, format_buffer_table, own_mb
from sglang_cp.compute.page_groups import (
    PageGroupError,
    check,
    validate_page_aligned_token_indices,
    validation_mode,
)


@pytest.mark.parametrize(
    "indices",
    [
        torch.arange(0, 8),
        torch.cat([torch.arange(12, 16), torch.arange(0, 4)]),  # pages in any order
        torch.empty(0, dtype=torch.int64),
        torch.arange(4, 8, dtype=torch.int32),
    ],
)
def test_whole_pages_pass(indices):
    validate_page_aligned_token_indices(indices, 4)


@pytest.mark.parametrize(
    "indices, needle",
    [
        (torch.arange(0, 6), "not a multiple of page_size=4"),  # partial page
        (torch.arange(2, 6), "starts at token index 2"),  # misaligned
        (torch.tensor([0, 1, 3, 2]), "group 0"),  # out of order inside a page
        (torch.tensor([4, 5, 6, 7, 8, 9, 10, 12]), "group 1"),  # torn second page
        (torch.zeros(2, 4, dtype=torch.int64), "1-D"),
    ],
)
def test_malformed_groups_name_argument_and_fix(indices, needle):
    with pytest.raises(PageGroupError, match="host_indices") as e:
        validate_page_aligned_token_indices(indices, 4, name="host_indices")
    assert needle in str(e.value)


def test_random_whole_page_sets_pass_and_single_corruptions_fail():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        ps = int(torch.randint(1, 9, (1,), generator=g))
        pages = torch.randperm(64, generator=g)[: int(torch.randint(1, 10, (1,), generator=g))]
        idx = (pages.unsqueeze(1) * ps + torch.arange(ps)).flatten()
        validate_page_aligned_token_indices(idx, ps)
        if ps == 1:
            continue
        bad = idx.clone()
        pos = int(torch.randint(0, len(bad), (1,), generator=g))
        bad[pos] += 1 if pos % ps < ps - 1 else -1
        with pytest.raises(PageGroupError):
            validate_page_aligned_token_indices(bad, ps)


def test_mode_parsing_and_device_scope(monkeypatch):
    monkeypatch.delenv("SGLANG_CP_VALIDATE_PAGE_GROUPS", raising=False)
    assert validation_mode() == "host"
    monkeypatch.setenv("SGLANG_CP_VALIDATE_PAGE_GROUPS", "all")
    assert validation_mode() == "all"
    monkeypatch.setenv("SGLANG_CP_VALIDATE_PAGE_GROUPS", "sometimes")
    with pytest.raises(PageGroupError, match="SGLANG_CP_VALIDATE_PAGE_GROUPS"):
        validation_mode()
    bad_meta = torch.empty(6, dtype=torch.int64, device="meta")
    check(bad_meta, 4, name="device_indices", mode="host")  # not on the CPU: skipped
    with pytest.raises(PageGroupError):
        check(torch.arange(6), 4, name="x", mode="host")
    check(torch.arange(6), 4, name="x", mode="0")


def test_ledger_counts_upstream_shared_buffers_once():
    """Two graph families whose buffer sets go through upstream's real
    share_buffers(): same-named, same-size fields alias one storage, and the
    second family must not be charged for it."""
    from sglang.srt.model_executor.input_buffers import ForwardInputBuffers

    @dataclasses.dataclass
    class Buffers(ForwardInputBuffers):
        input_ids: torch.Tensor
        positions: torch.Tensor

    first = Buffers(torch.zeros(1024, dtype=torch.int64), torch.zeros(1024, dtype=torch.int64))
    first.share_buffers()
    second = Buffers(torch.zeros(1024, dtype=torch.int64), torch.zeros(512, dtype=torch.int64))
    second.share_buffers()
    assert second.input_ids.data_ptr() == first.input_ids.data_ptr()  # upstream aliased it

    ledger = BufferLedger()
    rows1 = ledger.table("verify", first)
    rows2 = ledger.table("draft", second)
    shared = {r.name: r.shared_with for r in rows2}
    assert shared == {"input_ids": "verify.input_ids", "positions": None}
    assert own_mb(rows1) == pytest.approx(2 * 1024 * 8 / 2**20)
    assert own_mb(rows2) == pytest.approx(512 * 8 / 2**20)
    text = format_buffer_table("draft", rows2)
    assert "verify.input_ids" in text and "positions" in text


def test_shape_growth_total():
    g = ShapeGrowth("draft")
    assert "bs=8" in g.add("bs=8", 3 << 20)
    g.add("bs=4", 1 << 20)
    assert g.total_line().endswith("2 shapes: pool +4.00 MB")


def test_layerwise_reuse_validates_once_but_rechecks_after_in_place_change(monkeypatch):
    import sglang_cp.compute.page_groups as pg

    calls = []
    real = pg.validate_page_aligned_token_indices

    def counting(indices, page_size, *, name="indices"):
        calls.append(name)
        return real(indices, page_size, name=name)

    monkeypatch.setattr(pg, "validate_page_aligned_token_indices", counting)
    monkeypatch.setattr(pg, "_recent", pg._RecentlyValid())
    idx = torch.arange(64, 128)
    for _layer in range(78):
        pg.check(idx, 64, name="host_indices", mode="host")
    assert len(calls) == 1
    idx[0] = 3  # in-place write: same object, new version -> checked again, and caught
    with pytest.raises(PageGroupError):
        pg.check(idx, 64, name="host_indices", mode="host")
    assert len(calls) == 2
    other = torch.arange(64, 128)  # equal content, different object -> checked
    pg.check(other, 64, name="host_indices", mode="host")
    assert len(calls) == 3


def test_plain_list_indices_are_checked_too():
    check([0, 1, 2, 3], 4, name="indices", mode="host")
    with pytest.raises(PageGroupError, match="indices page group 0 starts at token index 1"):
        check([1, 2, 3, 4], 4, name="indices", mode="host")
