"""Helpers shared by the L3 tests (uniquely named so it never shadows another conftest)."""

import os
import subprocess
import threading
import time

from sglang_cp.l3 import L3Store


def fs_type(path: str) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return out.stdout.strip()


# io.read_engine of every config_doc that does not set it: conftest.py's `read_engine` fixture runs the
# read-path test modules (READ_PATH_MODULES there) once per engine.
READ_ENGINE = {"engine": "python"}


def config_doc(root: str, *, capacity_gb: float = 0.02, two_disks: bool = False, **sections) -> dict:
    doc = {
        "index": {"dir": os.path.join(root, "idx"), "map_size_gb": 0.004},
        "durability": {"plp_policy": "ignore"},
        "gc": {},
        "io": {"threads": 4, "max_inflight_pages": 64, "read_engine": READ_ENGINE["engine"]},
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
    return store.state.pools[payload].slab.path


def slot_of(store: L3Store, key: bytes, payload: str = "kv") -> int:
    from sglang_cp.l3.format.blob import key_digest
    from sglang_cp.l3.format.index import index_key
    pool = store.state.pools[payload]
    return pool.lru.get(index_key(pool.tag, key_digest(store.rank, key), store.rank)).slot


def index_rows(store: L3Store, payloads: list[str], keys: list[bytes]) -> list[list[bytes]]:
    """The index keys of each key in every payload, one row per key (LmdbIndex.exists_prefix's input)."""
    from sglang_cp.l3.format.index import index_key
    st = store.state
    return [[index_key(st.pool(p).tag, st.digest(k), store.rank) for p in payloads] for k in keys]


def slot_offset(store: L3Store, key: bytes, payload: str = "kv") -> int:
    return slot_of(store, key, payload) * store.state.pools[payload].slab.slot_bytes


def flip(path: str, offset: int, mask: int = 0x01) -> None:
    """Flip bits of one byte in place (buffered; O_DIRECT readers see it after the kernel's writeback)."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ mask]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def aligned_pages(n: int, size: int):
    """n page buffers, each 4 KiB aligned (host-pool-like memory): reads of these go zero-copy/coalesced."""
    import mmap

    import numpy as np
    stride = (size + 4095) // 4096 * 4096
    arr = np.frombuffer(mmap.mmap(-1, n * stride), np.uint8)
    return [arr[i * stride: i * stride + size] for i in range(n)]


def within(fn, bound):
    """Run fn on a daemon thread; (returned in time, its result or exception)."""
    box = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["v"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    return not t.is_alive(), box.get("v")


def settle(s, what, deadline_s=60.0):
    """Wait (bounded) until the store has no I/O of `what` in flight after a stall was released."""
    end = time.monotonic() + deadline_s
    while s.stats()["inflight"][what] and time.monotonic() < end:
        time.sleep(0.01)
    assert s.stats()["inflight"][what] == 0


def each_reference(present: list[bool], classes: int) -> list[bool]:
    """What exists_each answers, key by key: key i (class i % classes) is a hit iff it is present and no
    earlier key of its class missed."""
    out, missed = [], set()
    for i, ok in enumerate(present):
        c = i % classes
        if not ok:
            missed.add(c)
        out.append(ok and c not in missed)
    return out


WAIT_S = 60.0  # bound for state another thread reaches on its own: generous, a loaded CI box is slow


def wait_for(pred, what, bound_s=WAIT_S):
    """Wait (bounded) until pred() holds: state another thread or process reaches asynchronously.
    `what` names the awaited state in the failure."""
    end = time.monotonic() + bound_s
    while not pred():
        assert time.monotonic() < end, f"not reached within {bound_s:g} s: {what}"
        time.sleep(0.005)


def device_before_bound(monkeypatch, s, pred, what):
    """A sync caller's bound passes only once pred() holds (bounded), e.g. once its I/O reached the
    stalled device. A test of a caller whose device hangs needs the I/O stuck there before the bound:
    on a loaded machine an I/O thread can start only after a short bound passed, and then the op is
    cancelled and never reaches the device (a different path than the one the test asserts)."""
    timed_out = s._timed_out

    def held(op, counter):
        wait_for(pred, what)
        return timed_out(op, counter)
    monkeypatch.setattr(s, "_timed_out", held)


class _Syncs(list):
    """fdatasync arrivals (slots); `arrived` is set at the first one."""

    def __init__(self):
        super().__init__()
        self.arrived = threading.Event()


def held_sync():
    """A fault injector that parks every fdatasync until `gate` is set; `syncs` counts arrivals."""
    gate, syncs = threading.Event(), _Syncs()

    def injector(op, slab, slot):
        if op == "sync":
            syncs.append(slot)
            syncs.arrived.set()
            assert gate.wait(30), "test gate never opened"
    return injector, gate, syncs


def build_native_variant(tmp_path, name: str, text: str, out: str = "variant.so") -> str:
    """The native library built from the shipped C sources with `name` (e.g. "read_pages.c") replaced by
    `text`: a deliberately wrong engine for a test that must be able to fail. Every other source goes in
    as shipped (module.c aside: the Python face), so the variant exports every function the loader
    declares. Skips when no C compiler is installed."""
    import shutil

    import pytest

    from sglang_cp.l3 import native

    cc = shutil.which(os.environ.get("CC", "cc").split()[0])
    if cc is None:
        pytest.skip("needs a C compiler to build a deliberately wrong library")
    src = os.path.dirname(native.__file__)  # the C sources sit beside their ctypes loader
    changed = os.path.join(str(tmp_path), name)
    with open(changed, "w") as f:
        f.write(text)
    others = sorted(os.path.join(src, f) for f in os.listdir(src)
                    if f.endswith(".c") and f not in (name, "module.c"))
    lib = os.path.join(str(tmp_path), out)
    subprocess.run([cc, "-O2", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-I", src, "-o", lib, changed] + others,
                   check=True)
    return lib


def native_source(name: str) -> str:
    """A shipped C source of the native library, as text."""
    from sglang_cp.l3 import native

    with open(os.path.join(os.path.dirname(native.__file__), name)) as f:
        return f.read()
