"""Damage to stored pages, made behind the store's back the way a bad drive would, for the real-server
damage tests (imports nothing GPU-specific; checked on CPU against a real store by
``test/unit/l3/test_slab_damage_helper.py``)."""

from __future__ import annotations

import os

from sglang_cp.l3.format.blob import MAGIC


def flip_payload_bytes(slab_paths, select=lambda name: True, every: int = 1, phase: int = 0, back: int = 77) -> int:
    """Flip one byte ``back`` bytes before each blob's 64-byte header (which starts with MAGIC and follows the
    payload), in every ``every``-th stored page counted from ``phase``, in the slab files whose name
    (``r<rank>.<payload>.s<B>.slab``) ``select`` accepts. Returns how many pages were damaged."""
    damaged = seen = 0
    for path in slab_paths:
        if not select(os.path.basename(path)):
            continue
        with open(path, "r+b") as f:
            data = f.read()
            pos = data.find(MAGIC)
            while pos != -1:
                if seen % every == phase % every:
                    f.seek(pos - back)
                    b = f.read(1)
                    f.seek(pos - back)
                    f.write(bytes([b[0] ^ 0x5A]))
                    damaged += 1
                seen += 1
                pos = data.find(MAGIC, pos + 64)
        os.sync()
    return damaged
