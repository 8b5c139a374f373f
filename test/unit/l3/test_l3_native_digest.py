"""index.digest_threads: the hit query's digests in C over threads, bit-identical to hashlib's.

Real compiler, real ctypes library, real store on O_DIRECT slabs and LMDB. A wrong digest would name
another page (wrong bytes served), so every answer is compared with the hashlib path's.
"""

from __future__ import annotations

import os
import random
import shutil
import stat

import pytest

from l3_helpers import config_doc, page
from sglang_cp.l3 import L3Store, parse_l3_config
from sglang_cp.l3 import native_digest
from sglang_cp.l3.blob import digest_list, key_digests
from sglang_cp.l3.errors import L3ConfigError, L3StartupError
from sglang_cp.l3.native_digest import NativeDigests

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc").split()[0]) is None,
                                reason="needs a C compiler (cc) to build the native hasher")
P = 4096


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    nd = NativeDigests(str(tmp_path_factory.mktemp("nd") / "native"), 3)
    yield nd
    nd.close()


def _random_keys(rng, n):
    if rng.random() < 0.5:
        return [rng.randbytes(rng.choice([0, 1, 63, 64, 127, 128, 129, 255, 256, 257])) for _ in range(n)]
    alphabet = "0123456789abcdefé\0ключ"
    return ["".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 64, 127, 128, 200]))) for _ in range(n)]


def test_digests_equal_hashlibs_across_block_edges_threads_and_key_forms(native):
    rng = random.Random(15)
    for trial in range(300):
        rank = rng.randrange(256)
        keys = _random_keys(rng, rng.choice([1, 2, 7, 1023, 1024, 1025, 2500]))
        prefix = rng.randbytes(rng.choice([0, 5, 127, 128, 129, 300]))
        got = key_digests(rank, native)(keys, prefix)
        assert isinstance(got, bytes) and len(got) == 16 * len(keys)
        assert digest_list(got) == key_digests(rank)(keys, prefix), (trial, rank, len(keys), len(prefix))


def test_hex_page_hashes_split_over_threads(native):
    """Upstream's keys (SHA-256 hex), a 1M-token query's worth: the threaded path against hashlib."""
    keys = [os.urandom(32).hex() for _ in range(16384)]
    assert digest_list(key_digests(5, native)(keys, b"glm/0of8/")) == key_digests(5)(keys, b"glm/0of8/")


def test_mixed_key_types_raise_as_the_hashlib_path_does(native):
    with pytest.raises(TypeError, match=r"keys: must be all bytes or all str; keys\[0\] is str, keys\[2\] is bytes"):
        key_digests(0, native)(["a", "b", b"c"])
    with pytest.raises(TypeError, match=r"keys\[0\] is bytes, keys\[1\] is str"):
        key_digests(0, native)([b"a", "b"])
    keys = [os.urandom(8).hex() for _ in range(3000)]  # split over threads: the place in the whole list
    with pytest.raises(TypeError, match=r"keys\[0\] is str, keys\[2500\] is bytes"):
        key_digests(0, native)(keys[:2500] + [b"x"] + keys[2501:])


def test_build_is_private_and_reused(tmp_path):
    d = tmp_path / "native"
    NativeDigests(str(d), 1).close()
    libs = os.listdir(d)
    assert len(libs) == 1 and libs[0].endswith(".so"), libs
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / libs[0]).st_mode) == 0o600
    mtime = os.stat(d / libs[0]).st_mtime_ns
    NativeDigests(str(d), 2).close()
    assert os.listdir(d) == libs and os.stat(d / libs[0]).st_mtime_ns == mtime


def test_a_library_path_that_is_a_link_is_refused(tmp_path):
    d = tmp_path / "native"
    NativeDigests(str(d), 1).close()
    (lib,) = os.listdir(d)
    os.rename(d / lib, tmp_path / "elsewhere.so")
    os.symlink(tmp_path / "elsewhere.so", d / lib)
    with pytest.raises(L3StartupError, match="index.digest_threads.*symbolic link"):
        NativeDigests(str(d), 1)


def test_no_compiler_refuses_the_start_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-sglang-cp")
    with pytest.raises(L3StartupError, match=r"index.digest_threads = 2: .*no C compiler.*set index.digest_threads = 0"):
        NativeDigests(str(tmp_path / "native"), 2)
    monkeypatch.setenv("CC", "false")
    with pytest.raises(L3StartupError, match=r"index.digest_threads = 2: .*'false .*' exited 1"):
        NativeDigests(str(tmp_path / "native"), 2)
    # A compiler that writes part of its output and then fails leaves no temp file behind.
    half = tmp_path / "half-cc"
    half.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done; echo partial > "$2"; exit 3\n')
    half.chmod(0o700)
    monkeypatch.setenv("CC", str(half))
    with pytest.raises(L3StartupError, match="exited 3"):
        NativeDigests(str(tmp_path / "native"), 2)
    assert os.listdir(tmp_path / "native") == []


def test_a_library_whose_digests_differ_is_refused(tmp_path, monkeypatch):
    """The load-time check against hashlib: a build that hashes differently (one IV word changed here)
    would name every page wrongly, so the store must not start with it."""
    with open(native_digest.SOURCE) as f:
        src = f.read()
    bad = tmp_path / "key_digests.c"
    bad.write_text(src.replace("0x6a09e667f3bcc908ULL", "0x6a09e667f3bcc909ULL", 1))
    monkeypatch.setattr(native_digest, "SOURCE", str(bad))
    with pytest.raises(L3StartupError, match="differ from hashlib's blake2b"):
        NativeDigests(str(tmp_path / "native"), 2)


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


def test_ranks_building_at_once_leave_one_library_and_no_temp_files(tmp_path):
    """A server's ranks open their stores together, so they build together: each builds to its own
    temp name and renames it into place; every one loads a checked library."""
    import subprocess
    import sys
    d = str(tmp_path / "native")
    code = ("import sys; from sglang_cp.l3.native_digest import NativeDigests; "
            "NativeDigests(sys.argv[1], 2).close(); print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", code, d], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 and o.strip() == "ok" for p, (o, _e) in zip(procs, outs)), outs
    libs = os.listdir(d)
    assert len(libs) == 1 and libs[0].endswith(".so"), libs
