"""The embedded default L3 config as written to disk: private, loadable, and the ack it is asked for."""

from __future__ import annotations

import os
import stat

import pytest

from sglang_cp.demo_config import write_demo_config
from sglang_cp.l3.config import load_l3_config
from sglang_cp.l3.errors import L3StartupError


def test_written_private_and_loadable(tmp_path):
    os.umask(0o022)  # a usual umask: without our own modes the file would be 0644
    path = write_demo_config(str(tmp_path / "l3"), capacity_gb=0.05)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for sub in ("", "index", "disk0"):
        assert stat.S_IMODE(os.stat(tmp_path / "l3" / sub).st_mode) == 0o700, sub
    cfg = load_l3_config(path)
    assert cfg.backup_ack == "durable"


@pytest.mark.parametrize("ack", ["written", "operation"])
def test_backup_ack_is_set(tmp_path, ack):
    cfg = load_l3_config(write_demo_config(str(tmp_path / "l3"), capacity_gb=0.05, backup_ack=ack))
    assert cfg.backup_ack == ack


def test_config_path_that_is_a_link_is_refused(tmp_path):
    root = tmp_path / "l3"
    root.mkdir(mode=0o700)
    (tmp_path / "elsewhere.toml").write_text("x")
    os.symlink(tmp_path / "elsewhere.toml", root / "l3.toml")
    with pytest.raises(L3StartupError, match="symbolic link"):
        write_demo_config(str(root), capacity_gb=0.05)
    assert (tmp_path / "elsewhere.toml").read_text() == "x"


def test_the_header_says_what_wrote_it(tmp_path):
    demo = open(write_demo_config(str(tmp_path / "a"), capacity_gb=0.05)).readline()
    assert demo.startswith("# sglang-cp L3 config written by `sglang-cp demo`")
    bench = open(write_demo_config(str(tmp_path / "b"), capacity_gb=0.05, writer="`sglang-cp cachebench`")).readline()
    assert bench.startswith("# sglang-cp L3 config written by `sglang-cp cachebench`")
