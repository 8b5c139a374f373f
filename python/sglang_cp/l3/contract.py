"""The contract of one rank's L3 page store (L3Store implements it; the HiCache backend uses it).

A store holds fixed-size pages of one or more payloads (each payload: its own page size and slab),
addressed by content key (bytes: same key, same bytes). A key is stored per payload; a logical page
is a hit where every payload asked for holds the key.

Lifecycle
  open       L3Store(config, rank=, ranks_per_node=, payloads=, cold_start=): takes this rank's locks,
             opens index and slabs, allocates staging, runs the cold start ('clear' | 'load' | 'verify')
             and starts the threads. Fails with L3StartupError / ValueError naming the field.
  serve      any thread may call the primitives below at once.
  close      close(timeout): lets writes in flight commit, then closes files; returns within the bound
             even when the device never answers (pending operations fail, files stay open until exit).
             Idempotent; every primitive raises RuntimeError afterwards. A context manager closes it.
  fatal      a bug inside the store (a broken invariant) fails every pending operation and makes every
             later call raise L3InvariantError: loud, never silent wrong bytes.

When a write returns (durability.backup_ack; "operation" is "durable" for the store: it changes only when
the HiCache backend acks an upstream backup operation, docs_internal/l3_write_ack.md)
  durable    a page write_pages reports True is durable: data -> fdatasync -> index commit, then True.
  written    True once the page is in its slot; durable once its group commit lands (a crash or power
             loss before that loses it, a failed commit makes it a later miss). Until then this process
             reads it and counts it held, and every primitive called after the return acts on it as on a
             durable page: delete and touch wait for that commit on the write thread (l3/fence.py), clear
             waits for every write dispatched. Nothing changes for submit_write: DURABLE means durable.

Primitives (the data path fails soft: a device or index error is a miss / a False, plus a counter)
  write_pages(payload, keys, pages, timeout) -> [bool]
             store and wait: True once a page is durable, or under "written" once it is in its slot.
             With a timeout it returns within it and never reads `pages` afterwards.
  start_write_pages(...) -> PendingWrite, finish_write_pages(pending) -> [bool]
             write_pages in two halves (stage, then wait), so one caller can stage the next batch while
             the last one is written; `pages` stay unchanged until finish returns.
  read_pages(payload, keys, outs, timeout) -> [bool]
             read, verify (header identity, payload CRC) and copy into `outs`; False: a miss (absent,
             damaged, late). A read that completes after the return never touches `outs`. Under
             "written" it finds pages written whose commit is pending too.
  start_read_pages(...) -> PendingRead, finish_read_pages(pending) -> [bool]
             read_pages in two halves (look up and put on the device, then wait), so a caller restoring
             several payloads or batches keeps the device queue deep; `outs` are the caller's only once
             finish returns.
  exists_prefix(payload, keys, key_prefix) -> int,  exists_prefix_multi(payloads, ...) -> int,
  exists_each(payloads, keys, classes, key_prefix) -> [bool]
             the hit query, from memory (no I/O): the length of the held prefix, or per key whether its
             residue class (i % classes) is held up to it. May err towards a miss, never towards bytes.
             Under "written" a page whose write returned is held from that return on.
  submit_write(payload, keys, pages) -> op id,  submit_read(payload, keys, outs) -> op id,
  drain_acks(max_n) -> [Ack]
             the asynchronous form: per page one GATHERED ack (staged: the caller may reuse `pages`)
             then one DURABLE ack (ok or not) for writes, one READ ack for reads. Acks of sync calls
             never enter this queue. The crash suite and bench_l3_store drive the store through it.
  touch(payload, keys)      advisory LRU bump, applied on the write thread after the call returns: a
             touched page ranks warmer than every page whose write returned before the touch (GC
             reclaims the coldest pages first; the rank is persisted with later commits). Under
             "written" it is applied once the group commits pending at the touch landed. Past a bound
             of queued touches more are dropped (touches_dropped).
  delete(payload, keys) -> int
             drop pages (index delete committed, then slot free) and return how many were held. Under
             "written" a page whose write returned but whose commit is pending is waited for, then
             dropped and counted (not counted if that commit failed: it was never stored). Once delete
             returns no key of it is read, a hit, or back after a commit, a restart (load, verify) or a
             power loss, until it is written again. A write of a key that had not returned when the
             delete began may land on either side of it. Waits at most CONTROL_TIMEOUT_S, then raises
             TimeoutError (a device that does not answer; the delete runs once it does).
  clear() -> bool           drop every page of this rank, after every write already dispatched (under
             "written": every returned write) is final; once it returns True none of them is read, a
             hit, or back after a restart or a power loss. Pages staged but not yet dispatched are
             written after it. False if the index failed (the store serves on, pages as they were).
  stats() -> dict           counters, occupancy, in-flight work, index size, last cold start.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

from .acks import Ack, OpState


@dataclass(frozen=True)
class PendingWrite:
    """A write_pages call between start_write_pages and finish_write_pages (opaque to callers)."""
    op: OpState
    deadline: Optional[float]


@dataclass(frozen=True)
class PendingRead:
    """A read_pages call between start_read_pages and finish_read_pages (opaque to callers)."""
    op: OpState
    deadline: Optional[float]
    started_ns: int


class PageStore(ABC):
    @abstractmethod
    def write_pages(self, payload: str, keys: list[bytes], pages: list,
                    timeout: Optional[float] = None) -> list[bool]: ...

    @abstractmethod
    def start_write_pages(self, payload: str, keys: list[bytes], pages: list,
                          timeout: Optional[float] = None) -> PendingWrite: ...

    @abstractmethod
    def finish_write_pages(self, pending: PendingWrite) -> list[bool]: ...

    @abstractmethod
    def read_pages(self, payload: str, keys: list[bytes], outs: list,
                   timeout: Optional[float] = None) -> list[bool]: ...

    @abstractmethod
    def start_read_pages(self, payload: str, keys: list[bytes], outs: list,
                         timeout: Optional[float] = None) -> PendingRead: ...

    @abstractmethod
    def finish_read_pages(self, pending: PendingRead) -> list[bool]: ...

    @abstractmethod
    def exists_prefix(self, payload: str, keys: list, key_prefix: bytes = b"") -> int: ...

    @abstractmethod
    def exists_prefix_multi(self, payloads: list[str], keys: list, key_prefix: bytes = b"") -> int: ...

    @abstractmethod
    def exists_each(self, payloads: list[str], keys: list, classes: int = 1,
                    key_prefix: bytes = b"") -> list[bool]: ...

    @abstractmethod
    def submit_write(self, payload: str, keys: list[bytes], pages: list) -> int: ...

    @abstractmethod
    def submit_read(self, payload: str, keys: list[bytes], outs: list) -> int: ...

    @abstractmethod
    def drain_acks(self, max_n: Optional[int] = None) -> list[Ack]: ...

    @abstractmethod
    def touch(self, payload: str, keys: list[bytes]) -> None: ...

    @abstractmethod
    def delete(self, payload: str, keys: list[bytes]) -> int: ...

    @abstractmethod
    def clear(self) -> bool: ...

    @abstractmethod
    def stats(self) -> dict: ...

    @abstractmethod
    def close(self, timeout: Optional[float] = None) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
