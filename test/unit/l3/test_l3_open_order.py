"""A store whose open fails after its slabs and index are open: cold start 'clear' has not run yet,
and every file it opened is closed again.

Staging (io.max_inflight_pages page images per payload, allocated and faulted in at open) used to be
built after cold start: an allocation failure there came after 'clear' had wiped the rank's index,
and left the slab and LMDB descriptors open. The allocation failure is injected where it happens
(Staging's constructor raising MemoryError); everything else is the real store on real files.
"""

import os

import numpy as np
import pytest

from l3_helpers import config_doc, page
from sglang_cp.l3 import L3Store, parse_l3_config
from sglang_cp.l3 import opening

P = 16384


def _fds():
    return sorted(os.listdir("/proc/self/fd"))


def test_failed_staging_allocation_wipes_nothing_and_leaks_no_fd(l3_root, monkeypatch):
    cfg = parse_l3_config(config_doc(l3_root))
    keys = [b"k%d" % i for i in range(5)]
    with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}) as s:
        assert all(s.write_pages("kv", keys, [page(i) for i in range(5)], timeout=60))

    def no_memory(*a, **kw):
        raise MemoryError("staging: cannot allocate")

    before = _fds()
    monkeypatch.setattr(opening, "Staging", no_memory)
    with pytest.raises(MemoryError):
        L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}, cold_start="clear")
    monkeypatch.undo()
    assert _fds() == before, "the failed open left descriptors open"

    with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P}, cold_start="load") as s:
        outs = [np.zeros(P, np.uint8) for _ in keys]
        assert s.read_pages("kv", keys, outs, timeout=60) == [True] * 5, "the failed open wiped the index"
        assert all(bytes(o) == page(i) for i, o in enumerate(outs))
