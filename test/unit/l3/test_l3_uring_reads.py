"""io.read_engine = "uring": the io_uring read engine (native/read_uring.c) behind the read path's guarantees.

Real store, real O_DIRECT slabs and LMDB, the real kernel's io_uring. What every engine must do (bad pages
are misses with their counters, bounds on a stuck disk, nothing written after the caller's bound) runs under
this engine too through conftest.READ_PATH_MODULES; this module checks what only it has:
  - its guards against the ways io_uring readers delivered wrong bytes: a short completion, a completion of
    an earlier batch, a read that outlives its batch. Each fault is made to happen (a test-only switch in
    the C code, or a pipe: a read the test completes when it wants), and each guard's check is run against
    the same sources with that guard taken out, built here, to show the check fails without it;
  - the fallback to the native engine where io_uring is refused, under a real seccomp filter.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from l3_helpers import build_native_variant, config_doc, native_source, page
from sglang_cp.l3 import L3Store, native, parse_l3_config
from sglang_cp.l3.errors import L3ConfigError, L3StartupError
from sglang_cp.l3.format.index import index_key
from sglang_cp.l3.native.uring import PIECE_BYTES, UringReader, declare, probe

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def io_uring_here(request):
    """Every test but the refusal and config ones needs io_uring from this environment."""
    if request.node.originalname in ("test_a_refused_io_uring_reads_with_the_native_engine",
                                     "test_config_names_the_field"):
        return
    err = probe()
    if err:
        pytest.skip(f"io_uring is refused in this environment (errno {err}); the fallback test covers that case")


def _store(root, size, n, prefix=b"u", **io):
    cfg = parse_l3_config(config_doc(root, capacity_gb=(n + 8) * (size + 8192) / 0.85 / 1e9,
                                     io={"read_engine": "uring", "threads": 2, **io}))
    s = L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": size}, cold_start="clear")
    keys = [prefix + b"%d" % i for i in range(n)]
    for k in range(0, n, 16):
        assert all(s.write_pages("kv", keys[k:k + 16], [page(i, size) for i in range(k, min(n, k + 16))]))
    return s, keys


def _run(s, keys):
    """What the read path hands the engine for these keys: slots, offsets, digests."""
    pool = s.state.pools["kv"]
    digests = [s.state.digest(k) for k in keys]
    entries = s.state.index.get_many([index_key(pool.tag, d, 0) for d in digests])
    slots = [e.slot for e in entries]
    return pool, slots, [pool.slab.slot_offset(x) for x in slots], digests


def _read(reader, s, keys, first):
    """Read `keys` (pages first, first + 1, ...) through `reader`: the pages that did not come back exact."""
    pool, slots, offsets, digests = _run(s, keys)
    outs = [np.zeros(pool.page_bytes, np.uint8) for _ in keys]
    items = reader.read(pool, slots, offsets, digests, outs, reader.new_gate())
    return [(i, int(st)) for i, st in enumerate(items["status"])
            if st != native.OK or bytes(outs[i]) != page(first + i, pool.page_bytes)]


def _broken(tmp_path, old: str, new: str) -> ctypes.CDLL:
    """The engine built from the shipped sources with one guard taken out."""
    text = native_source("read_uring.c")
    assert text.count(old) == 1, old
    lib = build_native_variant(tmp_path, "read_uring.c", text.replace(old, new), "broken.so")
    broken = ctypes.CDLL(str(lib))
    native._declare(broken)  # the gate's functions, as the package's library has them
    return declare(broken)


# Payload sizes against the 256 KiB piece and the 4 KiB block: one request per page; a header straddling
# two blocks; exactly one piece (head = header block alone); a piece minus a little (header past the piece
# edge); pieces + a tail; GLM-5's page.
SIZES = [100, 4033, PIECE_BYTES, PIECE_BYTES - 32, PIECE_BYTES + 100, 3 * MiB + 3 * 4096 + 17, 5750784]


@pytest.mark.parametrize("size", SIZES)
def test_uring_reads_give_the_python_engines_bytes(l3_root, size):
    keys = [b"g%d-%d" % (size, i) for i in range(6)]
    pages = [np.frombuffer(page(i, size), np.uint8) for i in range(len(keys))]
    got = {}
    for engine in ("python", "uring"):
        cfg = parse_l3_config(config_doc(l3_root, capacity_gb=0.06,
                                         io={"read_engine": engine, "threads": 1, "uring_depth": 4}))
        with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": size},
                     cold_start="clear" if engine == "python" else "load") as s:
            if engine == "python":
                assert all(s.write_pages("kv", keys, pages))
            outs = [np.full(size, 0xA5, np.uint8) for _ in keys]
            assert s.read_pages("kv", keys + [b"absent"], outs + [np.zeros(size, np.uint8)]) == [True] * 6 + [False]
            got[engine] = [bytes(o) for o in outs]
            assert s.stats()["read_engine_effective"] == engine
    assert got["uring"] == got["python"] == [bytes(p) for p in pages]


def test_a_ring_keeps_its_depth_of_reads_in_flight(make_store):
    """One thread, depth 8: the reads of a run go to the kernel together, a round of completions per
    io_uring_enter, not one enter per read (what the engine is for)."""
    s = make_store(payloads={"kv": MiB}, capacity_gb=0.1, io={"read_engine": "uring", "threads": 1, "uring_depth": 8})
    keys = [b"d%d" % i for i in range(32)]
    assert all(s.write_pages("kv", keys, [page(i, MiB) for i in range(32)]))
    outs = [np.zeros(MiB, np.uint8) for _ in keys]
    assert s.read_pages("kv", keys, outs) == [True] * 32
    st = s.stats()["read_engine_stats"]
    assert st["reads"] == 32 * 5 and st["enters"] < st["reads"] / 2, st
    assert st["reads_in_kernel"] == 0 and st["free_slots"] == 8


def test_no_byte_reaches_the_callers_page_after_the_gate_closed(l3_root):
    """The caller's bound passes at a random moment of a run (the gate closes): once close_gate returned, the
    caller's pages do not change any more, pages reported good hold exactly their bytes, the rest are
    cancelled, and every landing slot comes back to the ring."""
    import random

    size, n = 2 * MiB, 24
    s, keys = _store(l3_root, size, n, uring_depth=16)
    reader = s.reads._native
    try:
        pool, slots, offsets, digests = _run(s, keys)
        late, rng = 0, random.Random(5)
        for _ in range(12):
            outs = [np.zeros(size, np.uint8) for _ in keys]
            gate = reader.new_gate()
            result = {}
            t = threading.Thread(target=lambda: result.setdefault(
                "items", reader.read(pool, slots, offsets, digests, outs, gate)))
            t.start()
            time.sleep(rng.uniform(0.001, 0.03))
            reader.close_gate(gate, wait=True)
            snapshot = [o.copy() for o in outs]
            t.join(30)
            assert not t.is_alive()
            late += any(not np.array_equal(a, b) for a, b in zip(outs, snapshot))
            for i, st in enumerate(result["items"]["status"]):
                assert st == native.CANCELLED or (st == native.OK and bytes(outs[i]) == page(i, size)), (i, st)
        assert late == 0
        st = reader.stats()
        assert st["reads_in_kernel"] == 0 and st["free_slots"] == 2 * 16, st
    finally:
        s.close()


# ------------------------------------------------------------------ guard: short completions

def _short_read(s, keys, reader):
    reader.inject("short")  # the next full completion comes back 4 KiB short, those bytes never written
    return _read(reader, s, keys, 0)


def test_a_short_completion_is_read_again_not_accepted(l3_root):
    s, keys = _store(l3_root, MiB, 4)
    try:
        reader = s.reads._native
        assert _short_read(s, keys, reader) == []
        assert reader.stats()["short_read_resubmits"] == 1
    finally:
        s.close()


def test_the_short_read_check_catches_an_engine_that_accepts_it(l3_root, tmp_path):
    lib = _broken(tmp_path, "} else if ((uint32_t)res < want) {  /* GUARD(short)", "} else if (0) {  /* GUARD(short)")
    s, keys = _store(l3_root, MiB, 4)
    reader = UringReader(lib, 1, 8)
    try:
        bad = _short_read(s, keys, reader)
        assert len(bad) == 1 and bad[0][1] in (native.CRC_MISMATCH, native.BAD_MAGIC, native.HEADER_CRC), bad
    finally:
        reader.close()
        s.close()


def test_a_short_completion_that_cannot_continue_is_a_short_read_miss(make_store):
    """A short count that is no multiple of 512 (an end of file) cannot be read on with O_DIRECT: the page is
    a miss counted as a short read, as in the other engines."""
    s = make_store(payloads={"kv": 65536}, io={"read_engine": "uring", "threads": 1})
    keys = [b"o%d" % i for i in range(4)]
    assert all(s.write_pages("kv", keys, [page(i, 65536) for i in range(4)]))
    s.reads._native.inject("short_odd")
    outs = [np.zeros(65536, np.uint8) for _ in keys]
    assert sorted(s.read_pages("kv", keys, outs)) == [False, True, True, True]
    st = s.stats()
    assert st["counters"]["short_reads"] == 1 and st["payload_counters"]["kv"]["short_reads"] == 1
    assert st["counters"]["crc_errors"] == 0


# ------------------------------------------------------------------ guard: stale completions

def _replayed_completion(s, keys, reader):
    """A first batch, then a second one (other pages) whose first completion reaped is a replay of the first
    batch's first read: what an earlier batch's late read looks like."""
    assert _read(reader, s, keys[:4], 0) == []
    reader.inject("replay")
    return _read(reader, s, keys[4:], 4)


def test_a_completion_of_an_earlier_batch_is_not_taken_for_a_read_of_this_one(l3_root):
    s, keys = _store(l3_root, 65536, 8)
    try:
        reader = s.reads._native
        assert _replayed_completion(s, keys, reader) == []
        assert reader.stats()["stale_completions"] == 1
    finally:
        s.close()


def test_the_stale_completion_check_catches_an_engine_that_takes_it(l3_root, tmp_path):
    lib = _broken(tmp_path, "if (!b || i >= b->nreq || b->reqs[i].ud != ud || b->reqs[i].state != R_FLIGHT) {",
                  "if (!b || i >= b->nreq) {")
    s, keys = _store(l3_root, 65536, 8)
    reader = UringReader(lib, 1, 8)
    try:
        assert _replayed_completion(s, keys, reader) != []
    finally:
        reader.close()
        s.close()


# ------------------------------------------------------------------ guard: reads that outlive their batch

def _late_read(s, key, reader):
    """Batch 1 reads from a pipe nobody writes (a device that does not answer); its caller's bound passes and
    the read stays in the kernel (its cancel not sent). Batch 2 reads the real slot image through another
    pipe, in two halves; between them batch 1's read lands (garbage). Returns batch 2's page: exact unless the
    late read landed in batch 2's slot."""
    pool, slots, _, digests = _run(s, [key])
    fd = os.open(pool.slab.path, os.O_RDONLY)
    try:
        image = os.pread(fd, pool.extent, slots[0] * pool.slab.slot_bytes)
    finally:
        os.close(fd)
    pipe1, pipe2 = os.pipe(), os.pipe()
    try:
        def items():
            from sglang_cp.l3.native.reads import read_items
            out = np.zeros(pool.page_bytes, np.uint8)
            return read_items(slots, [0], digests, [out]), out

        it1, _ = items()
        gate1 = reader.new_gate()
        threading.Timer(0.1, reader.close_gate, (gate1, False)).start()
        reader.inject("no_cancel")
        got1 = reader.read_fd(pipe1[0], pool.tag, pool.rank, pool.page_bytes, pool.extent, it1, gate1, drain_s=0.05)
        assert got1["status"].tolist() == [native.CANCELLED]
        assert reader.stats()["reads_in_kernel"] == 1
        it2, out2 = items()
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("items", reader.read_fd(
            pipe2[0], pool.tag, pool.rank, pool.page_bytes, pool.extent, it2, reader.new_gate())))
        t.start()
        half = pool.extent // 2

        def until(what, cond):
            end = time.monotonic() + 10
            while not cond():
                assert time.monotonic() < end, what
                time.sleep(0.005)

        os.write(pipe2[1], image[:half])
        until("batch 2's first half", lambda: reader.stats()["short_read_resubmits"] == 1)
        os.write(pipe1[1], b"\xee" * pool.extent)  # batch 1's read lands now
        until("batch 1's late completion", lambda: reader.stats()["stale_completions"] == 1)
        os.write(pipe2[1], image[half:])
        t.join(10)
        assert not t.is_alive()
        return done["items"]["status"].tolist(), bytes(out2)
    finally:
        for fd in (*pipe1, *pipe2):
            os.close(fd)


def test_a_read_that_outlives_its_batch_keeps_its_slot(l3_root):
    s, keys = _store(l3_root, 5000, 1)
    reader = UringReader(s.reads._native._lib, 1, 4)
    try:
        assert _late_read(s, keys[0], reader) == ([native.OK], page(0, 5000))
        st = reader.stats()
        assert st["late_slots"] == 1 and st["reads_in_kernel"] == 0 and st["free_slots"] == 4
    finally:
        reader.close()
        s.close()


def test_the_late_read_check_catches_an_engine_that_reuses_the_slot(l3_root, tmp_path):
    lib = _broken(tmp_path, "if (R->slot_ud[r->slot] == 0) give_slot(R, r->slot);", "if (1) give_slot(R, r->slot);")
    s, keys = _store(l3_root, 5000, 1)
    reader = UringReader(lib, 1, 4)
    try:
        status, got = _late_read(s, keys[0], reader)
        assert status != [native.OK] or got != page(0, 5000)
    finally:
        reader.close()
        s.close()


# ------------------------------------------------------------------ refusal and configuration

SECCOMP = r"""
import ctypes, errno, json, logging, os, struct, sys

def deny_io_uring_setup(err):
    # BPF: A = seccomp_data.nr; io_uring_setup (425 on x86-64 and arm64) -> ERRNO(err), else ALLOW.
    prog = [(0x20, 0, 0, 0), (0x15, 0, 1, 425), (0x06, 0, 0, 0x00050000 | err), (0x06, 0, 0, 0x7FFF0000)]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(Prog(len(prog), ctypes.addressof(code)))) == 0  # SECCOMP_MODE_FILTER

deny_io_uring_setup(getattr(errno, sys.argv[2]))
import numpy as np
from l3_helpers import config_doc, page
from sglang_cp.l3 import L3Store, parse_l3_config
from sglang_cp.doctor import _uring_read_engine_row
lines = []
class Keep(logging.Handler):
    def emit(self, r):
        lines.append(r.getMessage())
logging.getLogger("sglang_cp").addHandler(Keep())
cfg = parse_l3_config(config_doc(sys.argv[1], io={"read_engine": "uring"}))
with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": 16384}, cold_start="clear") as s:
    keys = [b"f%d" % i for i in range(8)]
    assert all(s.write_pages("kv", keys, [page(i) for i in range(8)]))
    outs = [np.zeros(16384, np.uint8) for _ in keys]
    ok = s.read_pages("kv", keys, outs) == [True] * 8 and all(bytes(o) == page(i) for i, o in enumerate(outs))
    st = s.stats()
row = _uring_read_engine_row()
print(json.dumps({"effective": st["read_engine_effective"], "ok": ok, "lines": lines,
                  "doctor": [row.status, row.detail]}))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="the filter names io_uring_setup by "
                    "its x86-64/arm64 syscall number")
@pytest.mark.parametrize("err", ["EPERM", "ENOSYS"])
def test_a_refused_io_uring_reads_with_the_native_engine(l3_root, err):
    """A seccomp filter that refuses io_uring_setup (what container runtimes do): the store opens, reads with
    the native engine, says so in one log line naming the errno and the fix, and in stats() and doctor."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SECCOMP, l3_root, err], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["effective"] == "native" and got["ok"]
    refusals = [line for line in got["lines"] if "io_uring" in line]
    assert len(refusals) == 1 and err in refusals[0] and 'reading with the "native" engine' in refusals[0], got
    assert ("seccomp" in refusals[0]) and ("io_uring_disabled" in refusals[0] or err == "ENOSYS"), refusals
    assert got["doctor"][0] == "WARN" and err in got["doctor"][1] and "native" in got["doctor"][1], got


def test_io_uring_works_here_and_reads_with_it(make_store, caplog):
    assert probe() == 0
    s = make_store(io={"read_engine": "uring"})
    assert s.stats()["read_engine_effective"] == "uring"
    assert not [r for r in caplog.records if "io_uring" in r.getMessage()]
    from sglang_cp.doctor import _uring_read_engine_row
    assert _uring_read_engine_row().status == "OK"


def test_config_names_the_field(l3_root, monkeypatch):
    assert parse_l3_config(config_doc(l3_root)).io.uring_depth == 64
    for bad in (1, 1025):
        with pytest.raises(L3ConfigError, match=r"io.uring_depth: must be in \[2, 1024\], got %d" % bad):
            parse_l3_config(config_doc(l3_root, io={"uring_depth": bad}))
    with pytest.raises(L3ConfigError, match=r"io.uring_depth: must be an integer"):
        parse_l3_config(config_doc(l3_root, io={"uring_depth": "64"}))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "library_path", lambda: None)
    cfg = parse_l3_config(config_doc(l3_root, io={"read_engine": "uring"}))
    with pytest.raises(L3StartupError, match=r"io.read_engine = 'uring' needs the sglang-cp native library"):
        L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": 4096}, cold_start="clear")
