"""CpL3Storage refuses upstream's legacy page API (get/set/batch_get/batch_set) loudly, and a storage
config that would make upstream use it (no interface_v1) at construction: that path moves whole logical
pages through copies, so it read into a copy of a non-contiguous target and still reported a hit, and
set/batch_set crashed on their default values=None."""

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang_cp.integration.cp_l3.backend import CpL3Storage


def _storage_config(extra):
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="m", extra_config=extra)


def test_a_config_without_interface_v1_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"lacks 'interface_v1': 1.*--enable-cp-l3"):
        CpL3Storage(_storage_config({"cp_l3_config": str(tmp_path / "l3.toml")}))


@pytest.mark.parametrize("name,call", [
    ("get", lambda b: b.get("k", torch.zeros(8, 8, dtype=torch.uint8).t())),  # a non-contiguous target
    ("get", lambda b: b.get("k")),
    ("batch_get", lambda b: b.batch_get(["k"], [torch.zeros(64, dtype=torch.uint8)])),
    ("set", lambda b: b.set("k")),
    ("set", lambda b: b.set("k", torch.zeros(64, dtype=torch.uint8))),
    ("batch_set", lambda b: b.batch_set(["k"])),
])
def test_the_legacy_page_api_is_refused(tmp_path, name, call):
    b = CpL3Storage(_storage_config({"cp_l3_config": str(tmp_path / "l3.toml"), "interface_v1": 1}))
    with pytest.raises(NotImplementedError, match=rf"{name}\(\) is upstream's legacy page API.*batch_get_v1"):
        call(b)
