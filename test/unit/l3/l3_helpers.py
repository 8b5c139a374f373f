"""Helpers shared by the L3 tests (uniquely named so it never shadows another conftest)."""

import os
import subprocess

from sglang_cp.l3 import L3Store


def fs_type(path: str) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return out.stdout.strip()


def config_doc(root: str, *, capacity_gb: float = 0.02, two_disks: bool = False, **sections) -> dict:
    doc = {
        "index": {"dir": os.path.join(root, "idx"), "map_size_gb": 0.004},
        "durability": {"plp_policy": "ignore"},
        "gc": {},
        "io": {"threads": 4, "max_inflight_pages": 64},
        "disks": [{"name": "d0", "path": os.path.join(root, "d0"), "capacity_gb": capacity_gb}],
    }
    if two_disks:
        doc["disks"].append({"name": "d1", "path": os.path.join(root, "d1"), "capacity_gb": capacity_gb})
    for k, v in sections.items():
        doc[k] = dict(doc.get(k, {}), **v) if isinstance(v, dict) else v
    return doc


def page(i: int, size: int = 16384) -> bytes:
    """Deterministic, key-specific content so a wrong page is always detectable."""
    import hashlib
    seed = hashlib.sha256(b"page-%d" % i).digest()
    return (seed * (size // len(seed) + 1))[:size]


def slab_path(store: L3Store, payload: str = "kv") -> str:
    return store._pools[payload].slab.path
