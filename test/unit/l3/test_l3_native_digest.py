"""index.digest_threads: the hit query's digests in C over threads, bit-identical to hashlib's.

The package's built native library through ctypes, real store on O_DIRECT slabs and LMDB. A wrong digest would name
another page (wrong bytes served), so every answer is compared with the hashlib path's.
"""

from __future__ import annotations

import os
import random

import pytest

from l3_helpers import build_native_variant, config_doc, native_source, page
from sglang_cp.l3 import L3Store, parse_l3_config
from sglang_cp.l3 import native
from sglang_cp.l3.format.blob import digest_list, key_digests
from sglang_cp.l3.errors import L3ConfigError, L3StartupError
from sglang_cp.l3.native.digests import NativeDigests

P = 4096


@pytest.fixture(scope="module")
def hasher():
    nd = NativeDigests(3)
    yield nd
    nd.close()


def _random_keys(rng, n):
    if rng.random() < 0.5:
        return [rng.randbytes(rng.choice([0, 1, 63, 64, 127, 128, 129, 255, 256, 257])) for _ in range(n)]
    alphabet = "0123456789abcdefé\0ключ"
    return ["".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 64, 127, 128, 200]))) for _ in range(n)]


def test_digests_equal_hashlibs_across_block_edges_threads_and_key_forms(hasher):
    rng = random.Random(15)
    for trial in range(300):
        rank = rng.randrange(256)
        keys = _random_keys(rng, rng.choice([1, 2, 7, 1023, 1024, 1025, 2500]))
        prefix = rng.randbytes(rng.choice([0, 5, 127, 128, 129, 300]))
        got = key_digests(rank, hasher)(keys, prefix)
        assert isinstance(got, bytes) and len(got) == 16 * len(keys)
        assert digest_list(got) == key_digests(rank)(keys, prefix), (trial, rank, len(keys), len(prefix))


def test_hex_page_hashes_split_over_threads(hasher):
    """Upstream's keys (SHA-256 hex), a 1M-token query's worth: the threaded path against hashlib."""
    keys = [os.urandom(32).hex() for _ in range(16384)]
    assert digest_list(key_digests(5, hasher)(keys, b"glm/0of8/")) == key_digests(5)(keys, b"glm/0of8/")


def test_mixed_key_types_raise_as_the_hashlib_path_does(hasher):
    with pytest.raises(TypeError, match=r"keys: must be all bytes or all str; keys\[0\] is str, keys\[2\] is bytes"):
        key_digests(0, hasher)(["a", "b", b"c"])
    with pytest.raises(TypeError, match=r"keys\[0\] is bytes, keys\[1\] is str"):
        key_digests(0, hasher)([b"a", "b"])
    keys = [os.urandom(8).hex() for _ in range(3000)]  # split over threads: the place in the whole list
    with pytest.raises(TypeError, match=r"keys\[0\] is str, keys\[2500\] is bytes"):
        key_digests(0, hasher)(keys[:2500] + [b"x"] + keys[2501:])


def test_without_the_native_library_the_start_is_refused_naming_the_field(monkeypatch):
    """A package built without a compiler has no sglang_cp/l3/_native: the store must say which field
    needs it and how to get it, not fail later on the hit query."""
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "library_path", lambda: None)
    with pytest.raises(L3StartupError, match=r"index.digest_threads = 2 needs the sglang-cp native library "
                                             r".*reinstall sglang-cp.*or set index.digest_threads back to its default"):
        NativeDigests(2)


def test_a_library_whose_digests_differ_is_refused(tmp_path, monkeypatch):
    """The load-time check against hashlib: a build that hashes differently (one IV word changed here)
    would name every page wrongly, so the store must not start with it."""
    text = native_source("key_digests.c")
    assert text.count("0x6a09e667f3bcc908ULL") >= 1
    lib = build_native_variant(tmp_path, "key_digests.c",
                               text.replace("0x6a09e667f3bcc908ULL", "0x6a09e667f3bcc909ULL", 1), "_native_wrong.so")
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "library_path", lambda: str(lib))
    with pytest.raises(L3StartupError, match="differ from hashlib's blake2b"):
        NativeDigests(2)


@pytest.mark.parametrize("bad, msg", [(-1, r"must be in \[0, 64\], got -1"), (65, r"must be in \[0, 64\], got 65"),
                                      ("4", "must be an integer, got str"), (True, "must be an integer, got bool")])
def test_config_field_is_checked(l3_root, bad, msg):
    with pytest.raises(L3ConfigError, match=f"index.digest_threads: {msg}"):
        parse_l3_config(config_doc(l3_root, index={"digest_threads": bad}))


def test_store_answers_are_the_same_with_the_native_hasher(l3_root):
    """One index, read by a store with hashlib digests and then by one with the native hasher: every
    hit query answers the same, holes, chunk edges and str/bytes keys included."""
    head = b"id/0of2/"
    tails = [os.urandom(32).hex() if i % 9 else "é%d" % i for i in range(2600)]
    full = [head + t.encode() for t in tails]
    answers = []
    for threads in (0, 4):
        cfg = parse_l3_config(config_doc(l3_root, capacity_gb=0.08, index={"digest_threads": threads}))
        with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": P, "ix": P},
                     cold_start="clear" if threads == 0 else "load") as s:
            if threads == 0:
                for p in ("kv", "ix"):
                    assert all(s.write_pages(p, full, [page(0, P)] * len(full)))
                s.delete("ix", [full[2200]])
                s.delete("kv", [full[1500]])
            answers.append((
                s.exists_prefix("kv", tails, key_prefix=head),
                s.exists_prefix("ix", tails, key_prefix=head),
                s.exists_prefix_multi(["kv", "ix"], tails, key_prefix=head),
                s.exists_prefix_multi(["kv", "ix"], full),
                s.exists_each(["kv", "ix"], tails, classes=8, key_prefix=head),
                s.exists_prefix("kv", tails[:1499], key_prefix=head),
            ))
    assert answers[0][0] == 1500 and answers[0][1] == 2200 and answers[0][2] == 1500 and answers[0][5] == 1499
    assert answers[0][4][:1500] == [True] * 1500 and answers[0][4][1500] is False
    assert answers[1] == answers[0]
