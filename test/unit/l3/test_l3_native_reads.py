"""io.read_engine = "native": the package's C read engine behind the same read path guarantees.

Real store, real O_DIRECT slabs and LMDB, the built library through ctypes. What the Python engine's
own tests check (bad pages are misses with their counters, bounds on a stuck disk) runs under both
engines through conftest.READ_PATH_MODULES; this module checks what only the native engine has: its
CRC32C, page geometries against the chunk size, and the gate that keeps a late read out of the
caller's memory.
"""

from __future__ import annotations

import random
import threading
import time

import crc32c as crc32c_pkg
import numpy as np
import pytest

from l3_helpers import build_native_variant, config_doc, native_source, page
from sglang_cp.l3 import L3Store, native, parse_l3_config
from sglang_cp.l3.format.index import index_key
from sglang_cp.l3.errors import L3ConfigError, L3InvariantError, L3StartupError
from sglang_cp.l3.native.reads import CHUNK_BYTES, NativeReader

MiB = 1 << 20


@pytest.fixture
def lib():
    lib = native.load("test", "native")
    yield lib
    lib.cpl3_crc32c_hardware(0)  # back to the default path


@pytest.mark.parametrize("software", [0, 1], ids=["sse4.2", "table"])
def test_crc32c_equals_the_crc32c_package(lib, software):
    """Every length around the three-chain block edges (3 x 256 B, 3 x 8 KiB), every alignment, with and
    without a running value: a wrong CRC would turn every page into a miss (or, worse, pass a bad one)."""
    if lib.cpl3_crc32c_hardware(software) != (not software) and not software:
        pytest.skip("this CPU has no SSE4.2: the table path serves both")
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, size=3 * 24576 + 4096, dtype=np.uint8).tobytes()
    lengths = sorted({*range(0, 40), 255, 256, 257, 767, 768, 769, 1535, 1536, 8191, 8192, 24575, 24576, 24577,
                      2 * 24576 + 768 + 9, 3 * 24576})
    for n in lengths:
        for off in (0, 1, 5, 8):
            chunk = data[off:off + n]
            for value in (0, 0xDEADBEEF):
                assert native.crc32c(chunk, value) == crc32c_pkg.crc32c(chunk, value), (software, n, off, value)


# Payload sizes against the 1 MiB chunk and the 4 KiB block: header alone in the tail block, header
# straddling two blocks, exactly one chunk, one chunk + a tail, several chunks + a partial one, tiny.
SIZES = [100, 4032, 4033, 5000, MiB, MiB + 100, 3 * MiB + 3 * 4096 + 17, 65536]


@pytest.mark.parametrize("size", SIZES)
def test_native_reads_give_the_python_engines_bytes(l3_root, size):
    keys = [b"g%d-%d" % (size, i) for i in range(6)]
    pages = [np.frombuffer(page(i, size), np.uint8) for i in range(len(keys))]
    got = {}
    for engine in ("python", "native"):
        cfg = parse_l3_config(config_doc(l3_root, capacity_gb=0.06, io={"read_engine": engine}))
        with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": size},
                     cold_start="clear" if engine == "python" else "load") as s:
            if engine == "python":
                assert all(s.write_pages("kv", keys, pages))
            outs = [np.full(size, 0xA5, np.uint8) for _ in keys]
            assert s.read_pages("kv", keys + [b"absent"], outs + [np.zeros(size, np.uint8)]) == [True] * 6 + [False]
            got[engine] = [bytes(o) for o in outs]
            assert s.stats()["counters"]["reload_hits"] == 6
    assert got["native"] == got["python"] == [bytes(p) for p in pages]


def _store(root, size, n, engine="native", **io):
    cfg = parse_l3_config(config_doc(root, capacity_gb=(n + 8) * (size + 8192) / 0.85 / 1e9,
                                     io={"read_engine": engine, **io}))
    s = L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": size}, cold_start="clear")
    keys = [b"r%d" % i for i in range(n)]
    for k in range(0, n, 16):
        assert all(s.write_pages("kv", keys[k:k + 16], [page(i, size) for i in range(k, min(n, k + 16))]))
    return s, keys


def _gate_race(root, lib_path=None, rounds=24):
    """Read many pages on a thread and close the gate at a random moment: once close_gate returned, the
    caller's pages must not change any more. Returns the number of rounds in which they did."""
    size, n = 2 * MiB, 24
    s, keys = _store(root, size, n)
    try:
        pool = s.state.pools["kv"]
        reader = NativeReader(1)
        if lib_path is not None:  # the library under test, loaded beside the package's
            import ctypes
            reader._lib = ctypes.CDLL(lib_path)
            native._declare(reader._lib)
        entries = s.state.index.get_many([index_key(pool.tag, s.state.digest(k), 0) for k in keys])
        slots = [e.slot for e in entries]
        digests = [s.state.digest(k) for k in keys]
        late, rng = 0, random.Random(3)
        for _ in range(rounds):
            outs = [np.zeros(size, np.uint8) for _ in keys]
            gate = reader.new_gate()
            result = {}
            t = threading.Thread(target=lambda: result.setdefault(
                "items", reader.read(pool, slots, [pool.slab.slot_offset(x) for x in slots], digests, outs, gate)))
            t.start()
            time.sleep(rng.uniform(0.002, 0.03))
            reader.close_gate(gate, wait=True)
            snapshot = [o.copy() for o in outs]
            t.join(30)
            assert not t.is_alive()
            late += any(not np.array_equal(a, b) for a, b in zip(outs, snapshot))
            status = result["items"]["status"]
            for i, st in enumerate(status):  # a page reported good holds exactly its bytes
                if st == native.OK:
                    assert bytes(outs[i]) == page(i, size)
                else:
                    assert st == native.CANCELLED
        return late
    finally:
        s.close()


def test_no_byte_reaches_the_callers_page_after_the_gate_closed(l3_root):
    assert _gate_race(l3_root) == 0


def test_the_gate_race_check_catches_a_gate_that_does_not_close(l3_root, tmp_path):
    """The check above must be able to fail: against an engine whose gate never refuses a copy (built
    here from the shipped sources with that one line changed), the caller's pages change after close."""
    text = native_source("read_pages.c")
    broken = text.replace("if (__atomic_load_n(&g->closed, __ATOMIC_SEQ_CST)) {", "if (0) {", 1)
    broken = broken.replace("if (__atomic_load_n(&gate->closed, __ATOMIC_SEQ_CST)) {", "if (0) {", 1)
    assert broken.count("if (0) {") == 2
    lib = build_native_variant(tmp_path, "read_pages.c", broken, "broken.so")
    assert _gate_race(l3_root, str(lib), rounds=8) > 0


def test_read_timeout_leaves_the_callers_pages_alone(make_store):
    """A read held at the device past the caller's bound: read_pages returns in time with those pages as
    misses, and when the device answers later nothing is copied into the caller's pages."""
    hold = threading.Event()
    held = []

    def injector(op, slab, slot):
        if op == "read" and hold.is_set():
            held.append(slot)
            while hold.is_set():
                time.sleep(0.01)

    s = make_store(payloads={"kv": 65536}, fault_injector=injector, io={"read_engine": "native", "threads": 2})
    keys = [b"t%d" % i for i in range(8)]
    assert all(s.write_pages("kv", keys, [page(i, 65536) for i in range(8)]))
    outs = [np.full(65536, 0x5A, np.uint8) for _ in keys]
    hold.set()
    t0 = time.monotonic()
    ok = s.read_pages("kv", keys, outs, timeout=0.5)
    assert time.monotonic() - t0 < 2.0 and held
    assert not all(ok)
    before = [o.copy() for o in outs]
    hold.clear()  # the device answers now
    deadline = time.monotonic() + 10
    while s.stats()["inflight"]["reads"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.stats()["inflight"]["reads"] == 0
    for i, good in enumerate(ok):
        assert np.array_equal(outs[i], before[i])
        if good:
            assert bytes(outs[i]) == page(i, 65536)
        else:
            assert (outs[i] == 0x5A).all()
    assert s.read_pages("kv", keys, outs) == [True] * 8  # the store still serves


def test_engine_contract_is_checked(l3_root, lib):
    """Arguments the C engine cannot honour (a chunk that is not a multiple of 4 KiB) read nothing and
    fail loud, not silently as misses."""
    s, keys = _store(l3_root, 8192, 2)
    try:
        pool = s.state.pools["kv"]
        reader = NativeReader(1)
        import sglang_cp.l3.native.reads as nr
        old = nr.CHUNK_BYTES
        nr.CHUNK_BYTES = 1000
        try:
            e = s.state.index.get_many([index_key(pool.tag, s.state.digest(keys[0]), 0)])[0]
            with pytest.raises(L3InvariantError, match="without a status"):
                reader.read(pool, [e.slot], [pool.slab.slot_offset(e.slot)], [s.state.digest(keys[0])],
                            [np.zeros(8192, np.uint8)], reader.new_gate())
        finally:
            nr.CHUNK_BYTES = old
    finally:
        s.close()
    assert CHUNK_BYTES % 4096 == 0


def test_config_names_the_field(l3_root, monkeypatch):
    with pytest.raises(L3ConfigError, match=r"io.read_engine: must be one of 'python', 'native', 'uring', got 'c'"):
        parse_l3_config(config_doc(l3_root, io={"read_engine": "c"}))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "library_path", lambda: None)
    cfg = parse_l3_config(config_doc(l3_root, io={"read_engine": "native"}))
    with pytest.raises(L3StartupError, match=r"io.read_engine = 'native' needs the sglang-cp native library"):
        L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": 4096}, cold_start="clear")
