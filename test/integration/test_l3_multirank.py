"""Several rank processes of one node share the LMDB index and write only their own slab files."""

import os
import subprocess
import sys
import textwrap

import numpy as np

from sglang_cp.l3 import L3Store, parse_l3_config

RANK = textwrap.dedent("""
    import hashlib, sys
    import numpy as np
    from sglang_cp.l3 import L3Store, parse_l3_config
    root, rank, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = parse_l3_config({"index": {"dir": root + "/idx", "map_size_gb": 0.0001, "max_map_size_gb": 0.1},
                           "durability": {"plp_policy": "ignore"},
                           "disks": [{"name": "a", "path": root + "/a", "capacity_gb": 0.2},
                                     {"name": "b", "path": root + "/b", "capacity_gb": 0.2}]})
    s = L3Store(cfg, rank=rank, ranks_per_node=n, payloads={"kv": 8192}, cold_start="clear")
    def content(k):
        return (hashlib.sha256(b"%d/" % rank + k).digest() * 256)[:8192]
    # The same keys on every rank: the rank is part of the digest, so nobody sees another rank's page.
    ks = [b"shared-%d" % i for i in range(600)]
    for lo in range(0, 600, 50):
        assert all(s.write_pages("kv", ks[lo:lo + 50], [content(k) for k in ks[lo:lo + 50]]))
    outs = [np.zeros(8192, np.uint8) for _ in ks]
    assert all(s.read_pages("kv", ks, outs))
    assert all(bytes(o) == content(k) for k, o in zip(ks, outs))
    assert s.exists_prefix("kv", ks) == 600
    print(s.state.pools["kv"].slab.path, s.stats()["counters"]["map_grows"])
    s.close()
""")


def test_four_ranks_share_one_index(tmp_path):
    root = str(tmp_path)
    for d in ("idx", "a", "b"):
        os.makedirs(os.path.join(root, d))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, root, str(r), "4"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(4)]
    paths = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        paths.append(out.split()[0])
    # Ranks 0, 2 on disk a and 1, 3 on disk b (default r % len(disks)); four distinct slab files.
    assert len(set(paths)) == 4
    assert ["/a/" in p for p in paths] == [True, False, True, False]
    # Restart rank 2 with load: it recovers its own 600 pages only; rank 1 clearing does not touch them.
    cfg = parse_l3_config({"index": {"dir": root + "/idx", "map_size_gb": 0.0001, "max_map_size_gb": 0.1},
                           "durability": {"plp_policy": "ignore"},
                           "disks": [{"name": "a", "path": root + "/a", "capacity_gb": 0.2},
                                     {"name": "b", "path": root + "/b", "capacity_gb": 0.2}]})
    r1 = L3Store(cfg, rank=1, ranks_per_node=4, payloads={"kv": 8192}, cold_start="clear")
    r2 = L3Store(cfg, rank=2, ranks_per_node=4, payloads={"kv": 8192}, cold_start="load")
    try:
        assert r2.stats()["cold_start"]["live"] == 600
        assert r1.exists_prefix("kv", [b"shared-0"]) == 0
        assert r2.exists_prefix("kv", [b"shared-%d" % i for i in range(600)]) == 600
        o = [np.zeros(8192, np.uint8)]
        assert r2.read_pages("kv", [b"shared-5"], o) == [True]
    finally:
        r1.close()
        r2.close()
