"""Blob header format and slot allocator: round trips, every single-bit corruption detected, loud misuse."""

import struct

import pytest
from hypothesis import given, settings, strategies as st

from sglang_cp.l3.format.blob import (HEADER_BYTES, BlobError, BlobHeader, check_identity, crc32c, default_slot_bytes,
                               header_block, key_digest, pack_header, parse_header, payload_tag, write_extent)
from sglang_cp.l3.errors import L3InvariantError
from sglang_cp.l3.slot_allocator import SlotAllocator

headers = st.builds(BlobHeader, payload_tag=st.integers(0, 2**32 - 1), rank=st.integers(0, 2**32 - 1),
                    slot=st.integers(0, 2**32 - 1), length=st.integers(0, 2**63), digest=st.binary(min_size=16, max_size=16),
                    seq=st.integers(0, 2**64 - 1), payload_crc=st.integers(0, 2**32 - 1))


@given(headers)
def test_header_round_trip(h):
    raw = pack_header(h)
    assert len(raw) == HEADER_BYTES
    assert parse_header(raw) == h


@settings(max_examples=300)
@given(headers, st.integers(0, HEADER_BYTES * 8 - 1))
def test_any_single_bit_flip_in_header_is_detected(h, bit):
    raw = bytearray(pack_header(h))
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(BlobError):
        parse_header(bytes(raw))


def test_reasons():
    h = BlobHeader(1, 2, 3, 4, b"d" * 16, 5, 6)
    raw = bytearray(pack_header(h))
    with pytest.raises(BlobError) as e:
        parse_header(b"\0" * 64)
    assert e.value.reason == "bad_magic"
    raw[20] ^= 1
    with pytest.raises(BlobError) as e:
        parse_header(bytes(raw))
    assert e.value.reason == "header_crc"
    with pytest.raises(BlobError) as e:
        parse_header(b"CPL3")
    assert e.value.reason == "short_header"
    # A well-formed header of a future version, or of version 1 (per-payload digests), is refused, not misread.
    for version in (99, 1):
        body = bytearray(pack_header(h)[:60])
        body[4:6] = struct.pack("<H", version)
        with pytest.raises(BlobError) as e:
            parse_header(bytes(body) + struct.pack("<I", crc32c(bytes(body))))
        assert e.value.reason == "bad_version"


def test_identity_check_catches_foreign_blobs():
    d = key_digest(0, b"k")
    h = BlobHeader(payload_tag("kv"), 0, 7, 100, d, 1, 0)
    check_identity(h, payload_tag=payload_tag("kv"), rank=0, slot=7, length=100, digest=d)
    for kw in (dict(slot=8), dict(rank=1), dict(length=101), dict(digest=key_digest(0, b"other")),
               dict(payload_tag=payload_tag("ix"))):
        args = dict(dict(payload_tag=payload_tag("kv"), rank=0, slot=7, length=100, digest=d), **kw)
        with pytest.raises(BlobError) as e:
            check_identity(h, **args)
        assert e.value.reason == "foreign_blob"


def test_digest_separates_rank_and_key():
    ds = {key_digest(r, k) for r in (0, 1, 10) for k in (b"a", b"b", b"")}
    assert len(ds) == 9
    assert key_digest(1, b"0a") != key_digest(10, b"a")  # the rank is not a key prefix


@pytest.mark.parametrize("page, extent", [(3274752, 3276800), (3276800, 3280896), (65536, 69632),
                                          (4032, 4096), (4033, 8192), (1, 4096)])
def test_geometry(page, extent):
    assert write_extent(page) == default_slot_bytes(page) == extent
    off, length = header_block(page)
    assert off % 4096 == 0 and length % 4096 == 0
    assert off <= page and page + HEADER_BYTES <= off + length <= extent


# -- slot allocator -------------------------------------------------------------------------------------

def test_slot_allocator_alloc_free_full():
    p = SlotAllocator(4, "t")
    got = [p.alloc() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3] and p.alloc() is None and p.occupancy() == 1.0
    p.free_slot(2)
    assert p.alloc() == 2


def test_slot_allocator_loud_misuse():
    p = SlotAllocator(3, "t")
    s = p.alloc()
    p.free_slot(s)
    with pytest.raises(L3InvariantError, match="double free"):
        p.free_slot(s)
    with pytest.raises(L3InvariantError, match="out of range"):
        p.free_slot(3)
    with pytest.raises(L3InvariantError, match="out of range"):
        p.is_used(-1)
    with pytest.raises(L3InvariantError, match="claimed twice"):
        p.rebuild_from_allocated([1, 1])
    with pytest.raises(ValueError, match="num_slots"):
        SlotAllocator(0)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 31)), max_size=200))
def test_slot_allocator_matches_model(ops):
    p, used = SlotAllocator(32, "m"), set()
    for do_alloc, pick in ops:
        if do_alloc:
            s = p.alloc()
            if len(used) == 32:
                assert s is None
            else:
                assert s not in used
                used.add(s)
        elif used:
            s = sorted(used)[pick % len(used)]
            p.free_slot(s)
            used.discard(s)
        assert p.used == len(used) and all(p.is_used(s) for s in used)


@given(st.sets(st.integers(0, 63)))
def test_rebuild_from_allocated_never_hands_out_live_slots(live):
    p = SlotAllocator(64, "r")
    p.rebuild_from_allocated(live)
    handed = [p.alloc() for _ in range(64 - len(live))]
    assert set(handed).isdisjoint(live) and p.alloc() is None
