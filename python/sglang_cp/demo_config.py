"""The embedded default L3 config: one local directory as the "disk".

Written by ``sglang-cp demo`` and ``sglang-cp cachebench`` (and the tests). Lives apart from
``cli.py`` so that cachebench, which the CLI imports, need not import the CLI back.
"""

from __future__ import annotations

import os

DEMO_CONFIG = """\
# sglang-cp L3 config written by {writer}: one local directory as the "disk".
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


def write_demo_config(root: str, capacity_gb: float = 1.0, backup_ack: str | None = None,
                      writer: str = "`sglang-cp demo`") -> str:
    """The embedded default L3 config under ``root`` (slabs are preallocated to capacity_gb), written
    0600 like every file of ours; ``backup_ack`` sets ``durability.backup_ack`` (default: the
    config's own default, "durable"); ``writer`` is what its header says wrote it."""
    from sglang_cp.l3.format.files import open_private, private_dirs

    root = os.path.abspath(root)
    for sub in ("index", "disk0"):
        private_dirs(os.path.join(root, sub), "demo directory")
    text = DEMO_CONFIG.format(root=root, capacity_gb=capacity_gb, writer=writer)
    if backup_ack is not None:
        text = text.replace("[durability]\n", f'[durability]\nbackup_ack = "{backup_ack}"\n', 1)
    path = os.path.join(root, "l3.toml")
    with os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "demo config"), "w") as f:
        f.write(text)
    return path
