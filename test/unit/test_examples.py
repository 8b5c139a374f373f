"""The example L3 configs parse and validate (paths re-rooted to a real temp disk)."""

import os

import pytest

from sglang_cp.l3 import load_l3_config

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


@pytest.mark.parametrize("name,disks", [("l3.single-nvme.toml", 1), ("l3.multi-nvme.toml", 4)])
def test_example_configs_validate(disk_tmp, name, disks):
    text = open(os.path.join(EXAMPLES, name)).read()
    for d in ("nvme0", "nvme1", "nvme2", "nvme3"):
        root = disk_tmp / d
        (root / "sglang-cp" / "index").mkdir(parents=True, exist_ok=True)
        text = text.replace(f"/{d}/", f"{root}/")
    text = text.replace('plp_policy = "require"', 'plp_policy = "ignore"')  # this VM's disk has no PLP
    path = disk_tmp / name
    path.write_text(text)
    cfg = load_l3_config(str(path))
    assert len(cfg.disks) == disks
    if disks == 4:
        assert [cfg.disks[cfg.disk_index_for_rank(r)].name for r in range(8)] == \
            ["nvme0", "nvme0", "nvme1", "nvme1", "nvme2", "nvme2", "nvme3", "nvme3"]
