"""The self-describing 64-byte blob header and slot geometry.

A slot holds `[payload][64 B header][zero pad]`; the header follows the payload so that an O_DIRECT read
can land the payload straight in a 4 KiB-aligned caller buffer (see docs_internal/l3_store.md).
CRC32C comes from the `crc32c` package (SSE4.2 / ARMv8 hardware path), with the GIL released on big
buffers so I/O threads checksum in parallel.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import crc32c as _crc32c

MAGIC = b"CPL3"
# 2: the digest names (rank, key), shared by every payload of the key (1: one per payload); see key_digest.
VERSION = 2
HEADER_BYTES = 64
ALIGN = 4096  # O_DIRECT's unit: every slot, extent, file offset and I/O buffer is a multiple of it
_FMT = struct.Struct("<4sHHIIIIQ16sQI")  # everything except the trailing header CRC
assert _FMT.size == HEADER_BYTES - 4


class BlobError(Exception):
    """A slot does not hold the expected blob; `reason` is a stable counter name."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class BlobHeader:
    payload_tag: int
    rank: int
    slot: int
    length: int
    digest: bytes
    seq: int
    payload_crc: int


def crc32c(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value, gil_release_mode=1)


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def payload_tag(payload: str) -> int:
    return _crc32c.crc32c(payload.encode())


def _person(rank: int) -> bytes:
    return b"cpl3-r%d" % rank  # blake2b's personalization (<= 16 B): free, no extra block


def key_digest(rank: int, key: bytes) -> bytes:
    """16-byte digest naming (rank, key): blake2b-128 of the key, personalized with the rank. One digest
    serves every payload of the key (the payload tag beside it in the index key and in the blob header
    keeps payloads apart); the rank keeps ranks' namespaces apart."""
    return hashlib.blake2b(key, digest_size=16, person=_person(rank)).digest()


def key_digester(rank: int):
    """key -> key_digest(rank, key), from a copy of a seeded state (cheaper than a new hasher)."""
    copy = hashlib.blake2b(digest_size=16, person=_person(rank)).copy

    def digest(key: bytes) -> bytes:
        h = copy()
        h.update(key)
        return h.digest()
    return digest


def key_digests(rank: int, native=None):
    """(keys, prefix=b"") -> [key_digest(rank, prefix + k) for k in keys]: one Python loop with no call per
    key, and a common prefix hashed once (the hit query). Keys are all bytes, or all str (taken as their
    UTF-8 bytes, encoded inside the loop: cheaper than a list of encoded copies first).
    With `native` (a native.digests.NativeDigests) the same digests come back as one bytes object,
    digest i at [16 i, 16 i + 16) (digest_list splits it where a list is needed)."""
    if native is not None:
        person = _person(rank)
        return lambda keys, prefix=b"": native.digests(person, keys, prefix)
    base = hashlib.blake2b(digest_size=16, person=_person(rank))

    def digests(keys, prefix: bytes = b"") -> list[bytes]:
        seed = base
        if prefix:
            seed = base.copy()
            seed.update(prefix)
        copy = seed.copy
        out = []
        add = out.append
        try:
            for k in map(str.encode, keys) if keys and isinstance(keys[0], str) else keys:
                h = copy()
                h.update(k)
                add(h.digest())
        except TypeError:
            raise mixed_keys_error(keys) from None
        return out
    return digests


def mixed_keys_error(keys) -> TypeError:
    """The error for a key list that mixes str and bytes (or holds neither), naming the first odd key."""
    kind = str if isinstance(keys[0], str) else (bytes, bytearray, memoryview)
    bad = next((i for i, k in enumerate(keys) if not isinstance(k, kind)), 0)
    return TypeError(f"keys: must be all bytes or all str; keys[0] is {type(keys[0]).__name__}, "
                     f"keys[{bad}] is {type(keys[bad]).__name__}")


def digest_list(digests) -> list:
    """key_digests' answer as a list of 16-byte digests, from either of its forms."""
    if isinstance(digests, bytes):
        return [digests[i:i + 16] for i in range(0, len(digests), 16)]
    return digests


def write_extent(page_bytes: int) -> int:
    """Bytes actually written per slot: payload + header rounded to the O_DIRECT block."""
    return round_up(page_bytes + HEADER_BYTES)


def default_slot_bytes(page_bytes: int) -> int:
    return write_extent(page_bytes)


def header_block(page_bytes: int) -> tuple[int, int]:
    """(offset in slot, length) of the aligned block(s) holding the header: what recovery reads."""
    start = page_bytes // ALIGN * ALIGN
    return start, write_extent(page_bytes) - start


def pack_header(h: BlobHeader) -> bytes:
    body = _FMT.pack(MAGIC, VERSION, HEADER_BYTES, h.payload_tag, h.rank, h.slot, 0, h.length, h.digest,
                     h.seq, h.payload_crc)
    return body + struct.pack("<I", _crc32c.crc32c(body))


def parse_header(buf) -> BlobHeader:
    """Parse and self-check 64 header bytes; raises BlobError(reason) on anything off."""
    mv = memoryview(buf)
    if mv.nbytes < HEADER_BYTES:
        raise BlobError("short_header", f"{mv.nbytes} bytes")
    body = mv[: HEADER_BYTES - 4]
    (stored,) = struct.unpack_from("<I", mv, HEADER_BYTES - 4)
    if bytes(mv[:4]) != MAGIC:
        raise BlobError("bad_magic")
    if _crc32c.crc32c(body) != stored:
        raise BlobError("header_crc")
    magic, version, hlen, tag, rank, slot, _res, length, digest, seq, pcrc = _FMT.unpack(body)
    if version != VERSION or hlen != HEADER_BYTES:
        raise BlobError("bad_version", f"version {version} header {hlen}")
    return BlobHeader(tag, rank, slot, length, digest, seq, pcrc)


def check_identity(h: BlobHeader, *, payload_tag: int, rank: int, slot: int, length: int, digest: bytes) -> None:
    """The header must name exactly the blob the index points at; otherwise it is foreign/stale."""
    if h.payload_tag != payload_tag or h.rank != rank or h.length != length:
        raise BlobError("foreign_blob", "payload/rank/length differ")
    if h.slot != slot:
        raise BlobError("foreign_blob", f"blob of slot {h.slot} found in slot {slot}")
    if h.digest != digest:
        raise BlobError("foreign_blob", "key digest differs")
