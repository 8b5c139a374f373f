"""cachebench's raw-disk yardstick on real O_DIRECT files: the store's request shape (1 MiB writes,
coalesced-size reads, the ranks' requests in flight), a second read pass after the run, and no probe
file left behind."""

import os

import pytest

from sglang_cp.cachebench import rawdisk


def test_probe_shape_second_pass_and_cleanup(tmp_path):
    raw = rawdisk.measure(str(tmp_path), 9 << 20, threads=3, read_block=4 << 20, keep=True)
    assert raw["bytes"] == 8 << 20  # whole read requests only
    assert (raw["block_bytes"], raw["read_block_bytes"], raw["threads"]) == (1 << 20, 4 << 20, 3)
    assert os.path.exists(raw["path"]) and os.stat(raw["path"]).st_mode & 0o777 == 0o600
    first = raw["read_gbps"]
    done = rawdisk.reread(raw)
    assert len(done["read_gbps_passes"]) == 2 and done["read_gbps_passes"][0] == first
    assert done["read_gbps"] == max(done["read_gbps_passes"]) > 0 and "path" not in done
    assert os.listdir(tmp_path) == []
    plain = rawdisk.measure(str(tmp_path), 2 << 20)
    assert plain["bytes"] == 2 << 20 and "path" not in plain and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="read_block"):
        rawdisk.measure(str(tmp_path), 2 << 20, read_block=3 << 19)
