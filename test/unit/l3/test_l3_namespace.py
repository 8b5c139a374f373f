"""The optional `namespace` of the L3 TOML: validated, and every tool follows it."""

import os

import pytest

from l3_helpers import config_doc, page
from sglang_cp.l3 import L3ConfigError, L3Store, parse_l3_config
from sglang_cp.l3.tools.fsck import find_slabs, open_index
from sglang_cp.l3.tools.occupancy import collect


@pytest.mark.parametrize("bad", ["", "-x", "a/b", "..", "x" * 65, 3, "sp ace"])
def test_bad_namespace_names_the_field(l3_root, bad):
    with pytest.raises(L3ConfigError, match=r"^namespace: .* is not a valid namespace"):
        parse_l3_config(config_doc(l3_root, namespace=bad))


def test_namespace_places_index_and_slabs_and_tools_follow_it(l3_root):
    plain = parse_l3_config(config_doc(l3_root))
    ns = parse_l3_config(config_doc(l3_root, namespace="srv.b-1"))
    assert plain.namespace == "" and plain.index_dir == plain.index.dir
    assert ns.index_dir == os.path.join(ns.index.dir, "ns-srv.b-1")
    assert ns.slab_dir("/d") == "/d/sglang-cp-l3/ns-srv.b-1"
    with L3Store(plain, rank=0, ranks_per_node=1, payloads={"kv": 16384}) as a, \
            L3Store(ns, rank=0, ranks_per_node=1, payloads={"kv": 16384}) as b:
        assert all(a.write_pages("kv", [b"a0", b"a1"], [page(0), page(1)]))
        assert all(b.write_pages("kv", [b"b0"], [page(2)]))
    # Each config sees its own slabs, index and counts only.
    assert [os.path.dirname(s.path) for s in find_slabs(ns)] == [ns.slab_dir(ns.disks[0].path)]
    assert [os.path.dirname(s.path) for s in find_slabs(plain)] == [plain.slab_dir(plain.disks[0].path)]
    assert [r["used"] for r in collect(ns)["slabs"]] == [1]
    assert [r["used"] for r in collect(plain)["slabs"]] == [2]
    ix = open_index(ns)
    assert ix.path == ns.index_dir
    ix.close()
