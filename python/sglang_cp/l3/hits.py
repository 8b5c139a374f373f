"""The hit query: how long a prefix of keys (or which keys of each residue class) this rank holds.

No LMDB: a page is durable on this rank iff it is in its pool's LRU. The write thread adds it there after
its index commit and removes it after its index delete, and only this process writes this rank's
entries (cold start seeds the LRU from the index), so the LRU is this rank's view of the index; the
query reads the LRUs' shared HeldDigests without a lock (state.py: what relies on the GIL). In the
windows around a commit or delete the answer errs towards a miss, or towards a hit that read_pages
(which looks each slot up again) turns into a miss: never wrong bytes.
"""

from __future__ import annotations

import itertools
import operator
import time

from .format.blob import digest_list, mixed_keys_error
from .format.index import key_prefix as index_key_prefix
from .state import StoreState

# Chunks of at least this many keys look up the held digests in HeldDigests' table (one C call that keeps
# the GIL, or numpy without the native library: overlapped cache misses); smaller ones in its dict
# (~60 ns per key, more at millions of held pages).
_TABLE_CHUNK = 1024


class HitQuery:
    def __init__(self, st: StoreState):
        self.st = st

    def exists(self, payloads: list[str], keys: list, classes: int, key_prefix: bytes = b""):
        """One hit query, counted with its keys and wall time (hit_queries, hit_query_keys,
        hit_query_ns: what an operator needs to see whether index.digest_threads would pay)."""
        t0 = time.perf_counter_ns()
        try:
            return self._query(payloads, keys, classes, key_prefix)
        finally:
            spent = time.perf_counter_ns() - t0
            st = self.st
            with st.lock:
                c = st.counters
                c["hit_queries"] += 1
                c["hit_query_keys"] += len(keys)
                c["hit_query_ns"] += spent

    def _query(self, payloads: list[str], keys: list, classes: int, key_prefix: bytes):
        """classes=0: the prefix length; else exists_each's flags.
        Cost: one digest per key for all payloads and one lookup of it in the pools' shared HeldDigests
        (a bit per payload; chunks of _TABLE_CHUNK keys or more in its vectorized table, smaller ones in
        its dict), over chunks that grow from 64 keys: a miss at key i costs about i keys of work; a chunk
        whose keys are all held is one count, no flags built. Pages pending a commit or being dropped
        take the per-payload path. Keys: all bytes or all str (UTF-8)."""
        st = self.st
        st.raise_fatal()
        if not isinstance(key_prefix, bytes):
            raise TypeError(f"key_prefix: must be bytes, got {type(key_prefix).__name__}")
        pools = [st.pool(p) for p in payloads]
        cols = [(index_key_prefix(st.rank, pl.tag).__add__, pl.lru.bit) for pl in pools]
        mask = 0
        for pl in pools:
            mask |= pl.lru.bit
        get, probe = st.held.get, st.held.probe
        every = mask == (1 << len(st.pools)) - 1
        pending = st.written_pending()
        dropping = st.dropping or None
        digests_of = st.digests
        n = len(keys)
        flags: list = []
        missed: set = set()
        s, step = 0, 64
        while s < n:
            e = min(n, s + step)
            step = min(step * 2, 4096)
            try:
                digests = digests_of(keys[s:e], key_prefix)
            except TypeError:
                raise mixed_keys_error(keys) from None  # the odd key's place in the whole list
            # Big chunks: the vectorized table (its probes' cache misses overlap); small ones: the dict.
            got = probe(digests, mask) if e - s >= _TABLE_CHUNK else None
            if got is not None:
                arr, full = got
                # Every key of the chunk held (the usual big chunk): one count, no flag list built.
                if dropping is None and full == e - s:
                    if classes:
                        flags += itertools.repeat(True, e - s)
                    s = e
                    continue
                held = arr.tolist()
            else:
                digests = digest_list(digests)
                held = list(map(get, digests, itertools.repeat(0, e - s)))
            # A query of every payload of the store (the usual one) needs no masking: one pass less.
            hit = list(map(mask.__eq__, held if every else map(mask.__and__, held)))
            if (pending is not None and False in hit) or dropping is not None:
                hit = _per_payload(cols, digest_list(digests), held, pending, dropping)
            if not classes:
                if False in hit:
                    return s + hit.index(False)
            else:
                flags += hit
                missed.update(i % classes for i in itertools.compress(range(s, e), map(operator.not_, hit)))
                if len(missed) == classes:
                    break
            s = e
        if not classes:
            return n
        if not missed and len(flags) == n:  # no miss anywhere
            return flags
        # Each class answers its prefix only: from its first miss on, its keys read False.
        out = flags + [False] * (n - len(flags))
        for c in range(classes):
            col = out[c::classes]
            if False in col:
                j = col.index(False)
                out[c + j * classes::classes] = [False] * (len(col) - j)
        return out


def _per_payload(cols, digests, held, pending, dropping) -> list[bool]:
    """The hit flags of one chunk payload by payload: pages written but not committed count
    (pending), pages being dropped do not."""
    hit = None
    for prefixed, bit in cols:
        h = [bool(v & bit) for v in held]
        ikeys = list(map(prefixed, digests))
        if pending is not None:
            h = [x or pending(k) for x, k in zip(h, ikeys)]
        if dropping is not None:
            h = [x and k not in dropping for x, k in zip(h, ikeys)]
        hit = h if hit is None else list(map(operator.and_, hit, h))
    return hit
