"""The hit query's key digests in C, over threads (``index.digest_threads > 0``; off by default).

Why: a 16K-key hit query (a 1M-token context) spends most of its time on 16K blake2b digests, and
that cost is the compression function itself, not Python's per-key overhead: hashlib's loop and a C
loop differ by about 1.5x on one core (docs_internal/l3_store.md, "The hit query's floor"). What moves
the floor is spreading the digests over cores, which hashlib cannot do for short inputs (it keeps the
GIL below 2 KiB). ctypes releases the GIL for the call, so each thread hashes its slice in parallel.

The digests are bit-identical to ``blob.key_digests`` (the index format does not change); the library
is checked against hashlib when it is loaded, and a mismatch refuses the store's start.

The C source ships with the package and is compiled once per host and source version with the
system's C compiler (``$CC``, else ``cc``) into ``<index.dir>/native/``: private (0700) like the rest
of the index directory, so no other user can swap the library this process loads. Plain C without
Python headers, so one build serves every Python on the host.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from .blob import mixed_keys_error
from .errors import L3InvariantError, L3StartupError
from .files import check_private_file, private_dir

FIELD = "index.digest_threads"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "key_digests.c")
BUILD_TIMEOUT_S = 120.0
WAIT_S = 30.0  # one slice of a query is microseconds of CPU; a slice not back by then is a bug
PARALLEL_MIN = 1024  # below this many keys one call on the caller's thread is cheaper than a hand-off
MAX_THREADS = 64
SUB_SLICE = 4096  # keys per C call (see _slice)

_loaded: dict[str, ctypes.CDLL] = {}  # library path -> handle, one per process
_load_lock = threading.Lock()


def _refuse(threads: int, why: str) -> L3StartupError:
    return L3StartupError(
        f"{FIELD} = {threads}: the native key hasher is not available ({why}); install a C compiler "
        f"(cc or gcc on PATH, or set CC) or set {FIELD} = 0 to hash keys with hashlib")


def _build(native_dir: str, threads: int) -> str:
    """The compiled library for this source and compiler, built now if it is not there yet."""
    with open(SOURCE, "rb") as f:
        src = f.read()
    cc = shlex.split(os.environ.get("CC", "cc"))
    tag = hashlib.sha256(src + b"\0" + " ".join(cc).encode()).hexdigest()[:16]
    lib = os.path.join(native_dir, f"key_digests-{tag}.so")
    if check_private_file(lib, FIELD):  # built before (by this rank or another); mode narrowed
        return lib
    tmp = f"{lib}.{os.getpid()}.{threading.get_ident()}.tmp"
    cmd = cc + ["-O3", "-shared", "-fPIC", "-o", tmp, SOURCE]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except FileNotFoundError:
            raise _refuse(threads, f"no C compiler: '{cc[0]}' is not on PATH") from None
        except subprocess.TimeoutExpired:
            raise _refuse(threads, f"'{' '.join(cmd)}' ran past {BUILD_TIMEOUT_S:g} s") from None
        if done.returncode != 0 or not os.path.exists(tmp):
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise _refuse(threads, f"'{' '.join(cmd)}' exited {done.returncode}: {' | '.join(tail)}")
        os.chmod(tmp, 0o600)
        os.replace(tmp, lib)  # atomic: a rank building at the same time replaces it with the same bytes
    finally:
        if os.path.lexists(tmp):  # a failed or cut build leaves nothing behind
            os.unlink(tmp)
    return lib


def _load(lib: str) -> ctypes.CDLL:
    with _load_lock:
        h = _loaded.get(lib)
        if h is None:
            h = ctypes.CDLL(lib)  # ctypes.CDLL (not PyDLL): calls release the GIL
            u8p, sz = ctypes.c_char_p, ctypes.c_size_t
            h.cpl3_digests_sep.argtypes = [u8p, u8p, sz, u8p, sz, sz, ctypes.c_void_p]
            h.cpl3_digests_ends.argtypes = [u8p, u8p, sz, u8p, sz, ctypes.c_void_p, sz, ctypes.c_void_p]
            h.cpl3_digests_sep.restype = h.cpl3_digests_ends.restype = ctypes.c_int
            _loaded[lib] = h
        return h


class NativeDigests:
    """digests(person, keys, prefix) -> bytes of 16 x len(keys): key i's digest at [16 i, 16 i + 16).
    Keys: all str (their UTF-8 bytes) or all bytes-like, as blob.key_digests takes them."""

    def __init__(self, native_dir: str, threads: int):
        if not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"{FIELD}: must be an integer in [1, {MAX_THREADS}], got {threads!r}")
        private_dir(native_dir, FIELD)
        self._lib = _load(_build(native_dir, threads))
        self.threads = threads
        # Threads are started only when a query is big enough to split (PARALLEL_MIN keys).
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="l3-digest") if threads > 1 else None
        self._self_test(threads)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _self_test(self, threads: int) -> None:
        """Refuse a library whose digests differ from hashlib's: it would name every page wrongly."""
        person = b"cpl3-r7"
        cases = [(b"", [b""]), (b"p", [b"a" * 64, b"\0x", b"b" * 300]), (b"q" * 130, ["ключ", "k" * 127])]
        for prefix, keys in cases:
            got = self.digests(person, keys, prefix)
            want = b"".join(hashlib.blake2b(prefix + (k.encode() if isinstance(k, str) else k), digest_size=16,
                                            person=person).digest() for k in keys)
            if got != want:
                self.close()
                raise _refuse(threads, "its digests differ from hashlib's blake2b; the build is wrong "
                                       "for this host")

    def digests(self, person: bytes, keys, prefix: bytes = b"") -> bytes:
        n = len(keys)
        if n == 0:
            return b""
        person16 = person.ljust(16, b"\0")
        if self._pool is None or n < PARALLEL_MIN:
            return self._slice(person16, keys, prefix)
        step = -(-n // self.threads)
        futs = [self._pool.submit(self._slice, person16, keys[i:i + step], prefix) for i in range(step, n, step)]
        try:
            head = self._slice(person16, keys[:step], prefix)
            return head + b"".join(f.result(timeout=WAIT_S) for f in futs)
        except TypeError:
            raise mixed_keys_error(keys) from None  # name the odd key by its place in the whole list

    def _slice(self, person16: bytes, keys, prefix: bytes) -> bytes:
        """The digests of keys on this thread, in pieces of <= SUB_SLICE keys: a joined buffer of that
        size stays below glibc's mmap threshold, where a fresh 1 MB one costs ~1 ms of page faults."""
        n = len(keys)
        out = ctypes.create_string_buffer(16 * n)
        base = ctypes.addressof(out)
        for i in range(0, n, SUB_SLICE):
            self._piece(person16, keys[i:i + SUB_SLICE], prefix, base + 16 * i)
        return out.raw

    def _piece(self, person16: bytes, keys, prefix: bytes, out: int) -> None:
        n = len(keys)
        try:
            data = "\0".join(keys).encode() if isinstance(keys[0], str) else b"\0".join(keys)
        except TypeError:
            raise mixed_keys_error(keys) from None
        if self._lib.cpl3_digests_sep(person16, prefix, len(prefix), data, len(data), n, out) != 0:
            # A key holds a NUL byte, so the separators are ambiguous: give each key's end instead.
            parts = [k.encode() for k in keys] if isinstance(keys[0], str) else [bytes(k) for k in keys]
            ends, total = (ctypes.c_int64 * n)(), 0
            for i, p in enumerate(parts):
                total += len(p)
                ends[i] = total
            data = b"".join(parts)
            if self._lib.cpl3_digests_ends(person16, prefix, len(prefix), data, len(data), ends, n, out) != 0:
                raise L3InvariantError("cpl3_digests_ends refused offsets built from the keys' own lengths")


def native_digests(index_dir: str, threads: int) -> Optional[NativeDigests]:
    """The store's native hasher for index.digest_threads (None when 0: hashlib, the default)."""
    if threads == 0:
        return None
    return NativeDigests(os.path.join(index_dir, "native"), threads)
