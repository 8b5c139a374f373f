"""000#3 on device tensors: SGLANG_CP_VALIDATE_PAGE_GROUPS=all checks CUDA
index tensors too (one host sync per transfer, bring-up only); the default
``host`` mode leaves device tensors alone."""

from __future__ import annotations

import pytest
import torch

from sglang_cp.compute.page_groups import PageGroupError, check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_all_mode_validates_cuda_indices_and_host_mode_skips_them():
    good = torch.arange(64, 128, device="cuda")
    bad = torch.arange(3, 67, device="cuda")
    check(good, 64, name="device_indices", mode="all")
    with pytest.raises(PageGroupError, match="device_indices page group 0 starts at token index 3"):
        check(bad, 64, name="device_indices", mode="all")
    check(bad, 64, name="device_indices", mode="host")
