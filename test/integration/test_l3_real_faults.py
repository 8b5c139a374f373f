"""Real faults, not injected: ENOSPC from a small loop-mounted ext4 image, a read-only mount."""

import contextlib
import os
import shutil
import subprocess

import numpy as np
import pytest

from sglang_cp.l3 import L3ConfigError, L3StartupError, L3Store, parse_l3_config

P = 16384


def _can_mount():
    return os.geteuid() == 0 and shutil.which("mkfs.ext4") and shutil.which("mount")


pytestmark = pytest.mark.skipif(not _can_mount(), reason="needs root, mkfs.ext4 and loop mounts")


@contextlib.contextmanager
def small_ext4(tmp_path, name, mib):
    img, mnt = tmp_path / f"{name}.img", tmp_path / name
    mnt.mkdir()
    subprocess.run(["truncate", "-s", f"{mib}M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True)
    if subprocess.run(["mount", "-o", "loop", str(img), str(mnt)]).returncode != 0:
        pytest.skip("loop mount not permitted here")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def cfg(index_dir, disk_dir, capacity_gb, **index):
    return parse_l3_config({"index": dict({"dir": index_dir, "map_size_gb": 0.0001}, **index),
                            "durability": {"plp_policy": "ignore"},
                            "disks": [{"name": "small", "path": disk_dir, "capacity_gb": capacity_gb}]})


def test_real_enospc_at_startup_names_the_fix(tmp_path):
    (tmp_path / "idx").mkdir()
    with small_ext4(tmp_path, "disk", 16) as d:
        c = cfg(str(tmp_path / "idx"), d, 0.05)  # 50 MB asked, ~13 MB exist
        with pytest.raises(L3StartupError, match=r"disks\[0\].capacity_gb: not enough free space .* lower capacity_gb"):
            L3Store(c, rank=0, ranks_per_node=1, payloads={"kv": P})
        s = L3Store(cfg(str(tmp_path / "idx"), d, 0.008), rank=0, ranks_per_node=1, payloads={"kv": P})
        s.close()


def test_real_enospc_under_the_index_fails_soft(tmp_path):
    (tmp_path / "d0").mkdir()
    with small_ext4(tmp_path, "idx", 2) as ix:
        # The map may grow to 64 MB but the filesystem under it holds ~1 MB: LMDB hits a real ENOSPC.
        s = L3Store(cfg(ix, str(tmp_path / "d0"), 0.2, max_map_size_gb=0.064), rank=0, ranks_per_node=1,
                    payloads={"kv": P})
        try:
            results, batches = [], []
            for b in range(400):
                ks = [b"e%d-%d" % (b, i) for i in range(64)]
                ok = s.write_pages("kv", ks, [bytes([b % 251]) * P] * 64)
                results += ok
                batches.append((ks, ok))
                if not all(ok):
                    break
            st = s.stats()
            assert not all(results), "the index filesystem never filled up"
            assert st["counters"]["index_errors"] + st["counters"]["mapfull"] >= 1
            assert st["occupancy"]["kv"]["used"] == sum(results), "failed pages gave their slots back"
            good = [(k, b) for b, (ks, ok) in enumerate(batches) for k, r in zip(ks, ok) if r]
            o = [np.zeros(P, np.uint8) for _ in good]
            assert s.read_pages("kv", [k for k, _ in good], o) == [True] * len(good)
            assert all(bytes(x) == bytes([b % 251]) * P for x, (_, b) in zip(o, good))
        finally:
            s.close()


def test_read_only_mount(tmp_path):
    (tmp_path / "idx").mkdir()
    d = tmp_path / "d0"
    d.mkdir()
    c = cfg(str(tmp_path / "idx"), str(d), 0.01)  # valid while writable
    subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(d)], check=True)
        with pytest.raises(L3ConfigError, match=r"disks\[0\].path: .* not writable"):
            cfg(str(tmp_path / "idx"), str(d), 0.01)
        with pytest.raises(L3StartupError, match=r"disks\[0\].path: cannot create .* must be writable"):
            L3Store(c, rank=0, ranks_per_node=1, payloads={"kv": P})
    finally:
        subprocess.run(["umount", str(d)], check=True)
