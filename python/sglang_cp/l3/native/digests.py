"""The hit query's key digests in C, over threads (``index.digest_threads > 0``; off by default).

Why: a 16K-key hit query (a 1M-token context) spends most of its time on 16K blake2b digests, and
that cost is the compression function itself, not Python's per-key overhead: hashlib's loop and a C
loop differ by about 1.5x on one core (docs_internal/l3_store.md, "The hit query's floor"). What moves
the floor is spreading the digests over cores, which hashlib cannot do for short inputs (it keeps the
GIL below 2 KiB). ctypes releases the GIL for the call, so each thread hashes its slice in parallel.

The digests are bit-identical to ``blob.key_digests`` (the index format does not change); the library
is checked against hashlib when the store opens, and a mismatch refuses the start.

The C source (native/key_digests.c) is compiled by the package build into the store's native library
(l3/native/__init__.py); nothing is compiled on the serving host.
"""

from __future__ import annotations

import ctypes
import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from .. import native
from ..format.blob import mixed_keys_error
from ..errors import L3InvariantError, L3StartupError

FIELD = "index.digest_threads"
WAIT_S = 30.0  # one slice of a query is microseconds of CPU; a slice not back by then is a bug
PARALLEL_MIN = 1024  # below this many keys one call on the caller's thread is cheaper than a hand-off
MAX_THREADS = 64
SUB_SLICE = 4096  # keys per C call (see _slice)


def _refuse(threads: int, why: str) -> L3StartupError:
    return L3StartupError(f"{FIELD} = {threads}: the native key hasher is not usable ({why}); reinstall "
                          f"sglang-cp on this host, or set {FIELD} = 0 to hash keys with hashlib")


class NativeDigests:
    """digests(person, keys, prefix) -> bytes of 16 x len(keys): key i's digest at [16 i, 16 i + 16).
    Keys: all str (their UTF-8 bytes) or all bytes-like, as blob.key_digests takes them."""

    def __init__(self, threads: int):
        if not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"{FIELD}: must be an integer in [1, {MAX_THREADS}], got {threads!r}")
        self._lib = native.load(FIELD, threads)
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


def native_digests(threads: int) -> Optional[NativeDigests]:
    """The store's native hasher for index.digest_threads (None when 0: hashlib, the default)."""
    if threads == 0:
        return None
    return NativeDigests(threads)
