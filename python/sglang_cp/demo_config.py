"""The embedded default L3 config: one local directory as the "disk".

Written by ``sglang-cp demo`` and ``sglang-cp cachebench`` (and the tests). Lives apart from
``cli.py`` so that cachebench, which the CLI imports, need not import the CLI back.
"""

from __future__ import annotations

import os

DEMO_CONFIG = """\
# sglang-cp L3 config written by `sglang-cp demo`: one local directory as the "disk".
[index]
dir = "{root}/index"
map_size_gb = 0.25

[gc]
high_watermark = 0.90
low_watermark = 0.85

[durability]
plp_policy = "warn"

[[disks]]
name = "local0"
path = "{root}/disk0"
capacity_gb = {capacity_gb}
"""


def write_demo_config(root: str, capacity_gb: float = 1.0) -> str:
    """The embedded default L3 config under ``root`` (slabs are preallocated to capacity_gb)."""
    root = os.path.abspath(root)
    for sub in ("index", "disk0"):
        os.makedirs(os.path.join(root, sub), mode=0o700, exist_ok=True)
    path = os.path.join(root, "l3.toml")
    with open(path, "w") as f:
        f.write(DEMO_CONFIG.format(root=root, capacity_gb=capacity_gb))
    return path
