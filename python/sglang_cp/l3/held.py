"""The hit query's view of one rank's held pages: key digest -> bitmask of the payload slabs holding it.

Written by the store's write thread (through PageLRU, gc.py) and by recovery before the threads start;
read by the hit query (hits.py) on any thread. Not GC: GC decides what leaves the LRU, this table only
mirrors what the LRUs hold.
"""

from __future__ import annotations

import struct
from typing import Optional

import numpy as np

from .errors import L3InvariantError
from .native import held_probe

_QQ = struct.Struct("<QQ")  # a 16-byte digest as two little-endian words
_VAL = 0xFFFF               # the low 16 bits of a table slot hold its value (0: empty slot)
_TOMB = 0x8000              # value of a key no pool holds any more (its slot stays in the probe chain)
_BUILD_LOAD = 0.625         # a (re)built table holds at most this many keys per slot
_MAX_LOAD = 0.75            # used slots (held + tombs) per table slot that trigger a rebuild (>= 1/8 of
                            # the table between a rebuild and the next)
_MAX_PROBES = 64            # batch lookups probe this far, then ask the dict (bounded under concurrent puts)
_PAST_BOUND = (1 << 64) - 1  # the native probe's answer for a chain longer than _MAX_PROBES
_NATIVE_PROBE = True        # batch lookups in C where the library is installed (tests turn it off to compare)


def _capacity(n: int) -> int:
    """Slots for n keys: a power of two, at least 4096, at most _BUILD_LOAD full."""
    cap = 4096
    while n > _BUILD_LOAD * cap:
        cap <<= 1
    return cap


class HeldDigests:
    """key digest -> bitmask of the payload slabs (of one rank's store) whose LRU holds that key. The hit
    query maps `get` over digests: one C lookup per key for all payloads, no index keys built.

    Beside the dict, a mirror for batch lookups (`many`): an open-addressing table (linear probing) in
    one numpy array of one 64-bit word per slot: the digest's first word with its low 16 bits replaced by
    the value (pool bits; _TOMB once no pool holds the key; 0 = empty). The home slot comes from the
    digest's second word, so the 48 key bits a slot keeps are independent of where it sits: digests are
    blake2b output, and a false match is ~2^-48 per probe (a hit that read_pages, which looks the slot
    up again and checks the blob's identity, turns into a miss; never bytes). A dict lookup per key
    costs a few dependent cache misses, one key after another; at a rank's share of a node (millions of
    pages) that is most of a 16K-key hit query. The table's vectorized probes cost one random memory
    access per key and issue them together, and at 8 bytes per slot and up to 0.625 load the table
    stays small (2.5M held pages: 32 MB): on a host where a random access into a 128 MB table cost ~6 ms
    per 16K keys (nested paging), a table of 32 MB did not (docs_internal/l3_store.md, "Slot layout").
    Written by the one thread that writes the dict (the store's write thread; recovery before it starts),
    read by any: a put is one aligned 64-bit store (key and value together), and a rebuild swaps one
    tuple, so a concurrent batch lookup sees a key as held, not held, or (around a discard) still held,
    as a dict lookup can. `drop_table` / `rebuild_table` bracket bulk changes (cold start) so they cost
    one vectorized build instead of a put per key."""

    def __init__(self):
        self._d: dict[bytes, int] = {}
        self.get = self._d.get
        self._table: Optional[tuple] = None  # (slots: uint64 [cap], cap - 1), swapped whole
        self._used = 0                       # table slots holding a key (held or tomb)

    def add(self, digest: bytes, bit: int) -> None:
        v = self._d.get(digest, 0) | bit
        self._d[digest] = v
        if self._table is not None:
            self._put(digest, v)

    def discard(self, digest: bytes, bit: int) -> None:
        v = self._d.get(digest, 0) & ~bit
        if v:
            self._d[digest] = v
        else:
            self._d.pop(digest, None)
        if self._table is not None:
            self._put(digest, v)

    def __len__(self) -> int:
        return len(self._d)

    @property
    def has_table(self) -> bool:
        """Batch lookups are answered by the table (False: by the dict, until rebuild_table)."""
        return self._table is not None

    # -- the batch-lookup table (writer side) ---------------------------------------------------------

    def drop_table(self) -> None:
        """Batch lookups answer from the dict until rebuild_table (bulk changes skip per-key puts)."""
        self._table = None

    def rebuild_table(self) -> None:
        """Build the table from the dict, no tombs."""
        n = len(self._d)
        cap = _capacity(n)
        tab = np.zeros(cap, np.uint64)
        if n:
            raw = b"".join(self._d)
            if len(raw) != 16 * n:
                raise L3InvariantError("HeldDigests: a digest that is not 16 bytes")
            keys = np.frombuffer(raw, dtype="<u8")
            vals = np.fromiter(self._d.values(), np.int64, n)
            if vals.max(initial=0) >= _TOMB:  # more pools than the value has bits: the dict answers
                self._table = None
                return
            words = (keys[0::2] & ~np.uint64(_VAL)) | vals.astype(np.uint64)
            m = np.uint64(cap - 1)
            pos = keys[1::2] & m
            todo = np.arange(n)
            while todo.size:  # each round places, per free slot wanted, the first key that wants it
                p = pos[todo]
                free = (tab[p] & np.uint64(_VAL)) == 0
                slots, first = np.unique(p[free], return_index=True)
                won = todo[free][first]
                tab[slots] = words[won]
                placed = np.zeros(n, bool)
                placed[won] = True
                todo = todo[~placed[todo]]
                pos[todo] = (pos[todo] + np.uint64(1)) & m
        self._used = n
        self._table = (tab, cap - 1)

    def _put(self, digest: bytes, value: int) -> None:
        if value >= _TOMB:  # more pools than the value has bits: the dict answers
            self._table = None
            return
        tab, m = self._table
        a, b = _QQ.unpack(digest)
        a &= ~_VAL
        i = b & m
        while True:
            w = int(tab[i])
            if not w & _VAL:  # an empty slot: the key is not in the table
                if not value:
                    return
                if self._used + 1 > _MAX_LOAD * (m + 1):
                    self.rebuild_table()  # the dict already has this key
                    return
                tab[i] = a | value  # one 64-bit store: a reader sees the key with its value or not at all
                self._used += 1
                return
            if w & ~_VAL == a:
                tab[i] = a | (value or _TOMB)
                return
            i = (i + 1) & m

    # -- batch lookups (any thread) -------------------------------------------------------------------

    def many(self, digests) -> Optional[np.ndarray]:
        """The held bitmask of each digest (uint64 array), as `get(d, 0)` would answer; None while there
        is no table (ask the dict). Digests: a list of 16-byte digests, or one bytes object of them
        back to back (the native hasher's form)."""
        got = self.probe(digests, 0)
        return None if got is None else got[0]

    def probe(self, digests, mask: int) -> Optional[tuple[np.ndarray, int]]:
        """``many``'s answer and how many of its values hold every bit of `mask` (the hit query's "whole
        chunk held" test), or None while there is no table. With the native library it is one C call
        that keeps the GIL (native/held_probe.c: numpy's array operations release it, each a wait of up
        to 5 ms beside a busy scheduler thread); without it, numpy."""
        t = self._table
        if t is None:
            return None
        tab, m = t
        if isinstance(digests, bytes):
            raw = digests
            n = len(raw) // 16
        else:
            n = len(digests)
            raw = b"".join(digests)
        if len(raw) != 16 * n:
            raise L3InvariantError("HeldDigests.many: a digest that is not 16 bytes")
        native = held_probe(tab, raw, _MAX_PROBES, mask) if _NATIVE_PROBE else None
        if native is not None:
            out, full, past = native
            if past:  # chains past the probe bound (a burst of puts between rebuilds): the dict answers
                get = self._d.get
                idx = [i for i, v in enumerate(out.tolist()) if v == _PAST_BOUND]
                vals = [get(raw[16 * i:16 * i + 16], 0) & (_TOMB - 1) for i in idx]
                out[idx] = vals
                full += sum(1 for v in vals if v & mask == mask)
            return out, full
        out = self._probe_numpy(raw, n, tab, m)
        return out, int(np.count_nonzero((out & np.uint64(mask)) == np.uint64(mask)))

    def _probe_numpy(self, raw: bytes, n: int, tab: np.ndarray, m: int) -> np.ndarray:
        q = np.frombuffer(raw, dtype="<u8")
        vm = np.uint64(_VAL)
        q0 = q[0::2] & ~vm
        out = np.zeros(n, np.uint64)
        idx = None  # positions in `digests` still probing (None: all of them)
        pos = (q[1::2] & np.uint64(m)).astype(np.intp)
        for _ in range(_MAX_PROBES):
            w = tab.take(pos)  # one random access per key, issued together
            v = w & vm
            found = ((w & ~vm) == q0) & (v != 0)
            if idx is None:
                out[found] = v[found]
            else:
                out[idx[found]] = v[found]
            go = (v != 0) & ~found
            if not go.any():
                break
            idx = np.flatnonzero(go) if idx is None else idx[go]
            q0, pos = q0[go], (pos[go] + 1) & m
        else:
            get = self._d.get
            out[idx] = [get(raw[16 * i:16 * i + 16], 0) for i in idx.tolist()]
        out &= np.uint64(_TOMB - 1)
        return out
