"""The restore path's state, in objects that say what they hold.

``PrefetchPlan``: what our hooks decide about one upstream prefetch operation, from its creation to
its completion: the phase the anchor chain forces, this rank's held prefix per candidate phase, the
agreed phase and length, the reads of the whole prefetch, and when each step happened. It is created
with the operation (``PrefetchOperation.__init__``, on the thread that creates it, before upstream
queues it) and is the operation's one reference to our state (``operation.cp_l3_plan``); every later
hook takes it from there and nothing else carries it.

``AnchorNote``: the one hand-over upstream leaves no object for. Upstream's ``prefetch_from_storage``
asks the tree core about the prefetch's anchor node and then, on the same scheduler thread, has the
controller create the operation; the tree core holds the anchor's rotation and has no reference to
the controller. The tree-core hook writes the note (the anchor's last page hash and the phase it
forces); the plan created next takes it only if the operation continues that very anchor (same last
page hash), so a note left by a declined prefetch is never applied to another chain.

``RestorePath`` (``RESTORE``): what the tree-core hooks need to know about the process's backend.

Nothing here imports sglang: it is plain state, tested on its own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional


def continuation_phase(anchor_phase: Optional[int], anchor_pages: int, shard_size: int) -> Optional[int]:
    """Owner of the first page after an anchor whose first page is owned by ``anchor_phase`` and which
    spans ``anchor_pages`` pages; None for a root anchor (the phase is free)."""
    if anchor_phase is None:
        return None
    return (anchor_phase + anchor_pages) % shard_size


def rotation_base(first_owner: int, start_page: int, shard_size: int) -> int:
    """The chain rotation base ``b`` (owner of position-page P is ``(b + P) % N``) of a span whose
    first page, at position ``start_page``, is owned by ``first_owner``."""
    return (first_owner - start_page) % shard_size


def held_prefix_per_phase(held: list[bool], shard_rank: int, shard_size: int) -> list[int]:
    """For every candidate phase b (owner of page i is (b + i) % N): how long a prefix of the pages
    this rank's own stripe covers. ``held[i]`` says whether this rank holds page i as its own; pages
    other ranks own under b count as present (their owners answer for them)."""
    n, vector = len(held), []
    for b in range(shard_size):
        first = (shard_rank - b) % shard_size  # the first page this rank owns under phase b
        mine = held[first::shard_size]
        vector.append(first + shard_size * mine.index(False) if False in mine else n)
    return vector


@dataclass
class AnchorNote:
    last_hash: Optional[str]  # the anchor node's last page hash: the operation's ``last_hash``
    phase: Optional[int]  # the owner its continuation must start at; None for a root anchor


class AnchorHandover:
    """The single note from the tree core's anchor query to the next operation created."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._note: Optional[AnchorNote] = None

    def write(self, note: AnchorNote) -> None:
        with self._lock:
            self._note = note

    def take(self, last_hash: Optional[str]) -> Optional[int]:
        """The forced phase if the note is about the anchor ``last_hash`` continues; the note is spent
        either way (the next anchor query writes a fresh one)."""
        with self._lock:
            note, self._note = self._note, None
        if note is None or last_hash is None or note.last_hash != last_hash:
            return None
        return note.phase


@dataclass
class QueryRide:
    """Our per-phase vector riding upstream's hit-count MIN (``HiCacheController._all_reduce``): the
    extra values to append and, after the collective, what came back. Only the collective over
    ``groups`` (upstream's ``prefetch_hits_sync_groups``) carries it, once."""
    groups: Any
    extra: list[int]
    reduced: Optional[list[int]] = None


@dataclass
class PrefetchPlan:
    """Our decisions about one upstream prefetch operation (see the module docstring)."""

    request_id: str
    shard_size: int  # 1 without KV sharding: no phase to agree on
    forced_phase: Optional[int] = None  # owner of the first prefetched page fixed by the anchor chain
    phase_vector: Optional[list[int]] = None  # this rank's held prefix (pages) per candidate phase
    agreed_vector: Optional[list[int]] = None  # the same after the MIN over every rank
    start_owner: Optional[int] = None  # the agreed phase: owner of the first prefetched page; None: no load
    agreed_pages: int = 0  # pages every owner holds at the agreed phase (before upstream's own cut)
    reads: Any = None  # the whole prefetch's reads, started at once (backend.RestoreReads)
    read_pages: int = 0  # this rank's own result: the prefix it restored (pages)
    stamps: dict[str, float] = field(default_factory=dict)  # step -> time.perf_counter()

    def stamp(self, step: str) -> None:
        self.stamps[step] = time.perf_counter()

    def add_query_batch(self, offset: int, batch_pages: int, vector: list[int]) -> None:
        """Fold one hit-query call (pages ``offset .. offset + batch_pages``, its ``vector`` indexed
        by the phase of the batch's own first page) into the phase vector: a phase's prefix grows
        only while every earlier batch was held in full at that phase."""
        n = self.shard_size
        if self.phase_vector is None or offset == 0:
            self.phase_vector = [0] * n
        for b in range(n):
            if self.phase_vector[b] == offset:
                self.phase_vector[b] = offset + min(vector[(b + offset) % n], batch_pages)

    def ride_vector(self) -> list[int]:
        """What this rank contributes to the MIN: the same length on every rank, always."""
        v = self.phase_vector
        return list(v) if v is not None and len(v) == self.shard_size else [0] * self.shard_size

    def agree(self, reduced: list[int]) -> int:
        """Pick the phase from the MIN-reduced vector (identical on every rank, so every rank picks the
        same): the anchor's forced phase when there is one, else the longest prefix, ties to the lowest
        phase. Returns the agreed length in pages."""
        self.agreed_vector = list(reduced)
        if self.forced_phase is not None:
            best = self.forced_phase
        else:
            best = max(range(self.shard_size), key=lambda b: (reduced[b], -b))
        self.agreed_pages = int(reduced[best])
        self.start_owner = best if self.agreed_pages > 0 else None
        return self.agreed_pages

    def durations_ms(self) -> dict[str, float]:
        """Milliseconds from the plan's creation to each step (for benchmarks and logs)."""
        t0 = self.stamps.get("created")
        if t0 is None:
            return {}
        return {k: round((t - t0) * 1e3, 3) for k, t in self.stamps.items()}


class RestorePath:
    """This scheduler process's restore path. A scheduler process has one cache controller and one
    radix tree core; our backend attaches to the controller (``attach``, every rank in lockstep) and
    the tree-core hooks, which upstream gives no reference to the controller, read from here whether
    it is attached and over how many shards."""

    def __init__(self) -> None:
        self.backend = None  # our CpL3Storage while attached
        self.shard_size = 0  # ranks a logical page is striped over (1: no KV sharding); 0: detached
        self.anchors = AnchorHandover()

    @property
    def attached(self) -> bool:
        return self.backend is not None

    def attach(self, backend, shard_size: int) -> None:
        self.backend, self.shard_size = backend, shard_size
        self.anchors = AnchorHandover()

    def detach(self, backend) -> None:
        if self.backend is backend:
            self.backend, self.shard_size = None, 0


RESTORE = RestorePath()
