"""Storage keys of the L3 backend: who may read a page, derived from what the bytes are.

Upstream's page hashes (``mem_cache/utils.get_storage_hash_str``) already chain the token
ids with the request namespace (extra_key, cache salt, hence LoRA). They do not say
which model, dtype, page size or host layout produced the bytes, nor which CP rank holds
which stripe. Our key adds exactly that, so two deployments that differ in any of them
can never read each other's pages (a miss, never a collision):

    {identity digest}/{owner rank}of{cp size}/{page hash}

The identity digest covers upstream's own ``hicache_key_scheme`` namespace fields
(model, page size, layout, rank replication, and the *logical* KV cache dtype of every
payload: fp8_e4m3fn and fp8_e5m2 both store as uint8 in the host pool, so the host
storage dtype alone would let a page of one format hit under the other -- the logical
dtypes come from the device pools, recorded by ``l3_storage_config``) plus the topology that
changes what a rank's page holds: TP rank/size for head-sharded (non-MLA) pools, PP
rank/size (layer ranges), the attention-CP size and strategy, and whether pages are
striped (``--enable-kv-cache-sharding``). Payload kind (target KV, DSA indexer, draft)
is kept apart by the store itself (one slot pool and index namespace per payload).

Seed item: "content hash is L3's key" + "keys that cannot collide across ranks".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

KEY_SCHEMA = 2  # 2: logical dtypes per payload


@dataclass(frozen=True)
class KeyIdentity:
    model: str
    dtype: str
    page_size: int
    layout: str
    rank_replicated: bool
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_size: int
    cp_strategy: str
    sharded: bool
    page_bytes: tuple  # ((payload, bytes per page), ...): a shape change is a new keyspace
    logical_dtypes: tuple  # ((payload, logical KV dtype), ...); `dtype` is the host storage dtype

    def digest(self) -> str:
        body = json.dumps({"schema": KEY_SCHEMA, **asdict(self)}, sort_keys=True, default=list)
        return "cpl3v%d-%s" % (KEY_SCHEMA, hashlib.sha256(body.encode()).hexdigest()[:20])


class KeyScheme:
    """Turns upstream page hashes into our store keys for one rank."""

    def __init__(self, identity: KeyIdentity):
        self.identity = identity
        self._prefix = identity.digest()

    def key(self, page_hash: str, owner: int) -> bytes:
        if not 0 <= owner < max(1, self.identity.cp_size):
            raise ValueError(f"owner rank {owner} outside cp size {self.identity.cp_size}")
        return f"{self._prefix}/{owner}of{self.identity.cp_size}/{page_hash}".encode()

    def prefix(self, owner: int) -> bytes:
        """The part of every key of `owner` before the page hash: key(h, owner) == prefix(owner) + h.encode()."""
        return self.key("", owner)

    @staticmethod
    def suffixes(page_hashes) -> list[bytes]:
        """The page hashes as the keys' tails (the hit query passes prefix(owner) once beside them)."""
        return list(map(str.encode, page_hashes))

    def keys(self, page_hashes, owner: int) -> list[bytes]:
        """[self.key(h, owner) for h in page_hashes], the constant part built once (the hit query's keys)."""
        return list(map(self.prefix(owner).__add__, self.suffixes(page_hashes)))
