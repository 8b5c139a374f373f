"""What the store's threads hand each other: the page being written (WriteTask) and the typed messages
of the write thread's queue and of the commit thread's queue.

Caller and I/O threads post to the write thread (StoreState.post); only the write thread consumes.
A message the write thread will never see (it stopped) is settled by its poster (StoreState.settle).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union

from .acks import OpState
from .format.index import IndexEntry
from .payload_slab import PayloadSlab
from .staging import Staging


@dataclass(eq=False)
class WriteTask:
    """One page on its way to disk, from its staging copy to its DURABLE ack. Submitters that write the
    same key while it is in flight ride it as extra waiters."""
    pool: PayloadSlab
    ikey: bytes
    digest: bytes
    buf: Optional[memoryview]                     # staging slot image, or the tail block if zero-copy;
                                                  # None once the write returned (token given back)
    waiters: list = field(default_factory=list)  # [(OpState, index_in_op)]
    src: Optional[memoryview] = None             # zero-copy: the sync caller's own page
    guard: Optional[OpState] = None              # the op whose caller memory `src` is
    token: bool = False                          # holds a staging token (zero-copy under a caller's bound)
    slot: int = -1
    seq: int = 0
    error: Optional[str] = None
    written: bool = False                        # its pwrite returned ok; the group commit is pending
    pcrc: Optional[int] = None                   # staged pages: payload CRC32C, taken by the submitter
                                                 # right after its copy (bytes still hot in cache), so the
                                                 # I/O threads only write; zero-copy pages: None

    def release_buffer(self, staging: Staging) -> None:
        """Give back what this page holds in staging: its slot image, or a zero-copy page's tail block
        and (under a caller's bound) its token. Idempotent."""
        if self.buf is None:
            return
        if self.src is not None:
            staging.release_tail(self.buf)
            if self.token:
                staging.unreserve()
                self.token = False
        else:
            staging.release(self.pool.extent, self.buf)
        self.buf = None

    def entry(self, rank: int) -> IndexEntry:
        p = self.pool
        return IndexEntry(rank, p.slab.disk_index, self.slot, p.tag, p.page_bytes, self.seq, self.seq)


class Touch(NamedTuple):
    """A read hit's LRU bump, queued for the write thread (the LRU's only writer)."""
    pool: PayloadSlab
    ikey: bytes
    stamp: int


class _Unanswered:
    def __repr__(self) -> str:
        return "<unanswered>"


UNANSWERED = _Unanswered()


@dataclass(eq=False)
class Reply:
    """The answer to a control message. `done` is set once the write thread ran it, or once it was
    settled unrun (the write thread stopped): then `result` stays UNANSWERED."""
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = UNANSWERED


# -- the write thread's queue -----------------------------------------------------------------------

@dataclass(frozen=True)
class WriteBatch:
    """Staged pages (caller thread), in about _MESSAGE_BYTES per message."""
    tasks: list[WriteTask]


@dataclass(frozen=True)
class IoDone:
    """The pages of one write I/O task (a group of runs) whose pwrites returned, ok or not."""
    run: list[WriteTask]


@dataclass(frozen=True)
class Committed:
    """A group whose commit finished, ok or not (commit thread)."""
    group: list[WriteTask]


@dataclass(frozen=True)
class Drop:
    """A reader found a bad page. `deleted`: its exact index entry was deleted (True), was already gone
    (False), or the delete failed and the write thread retries it (None)."""
    pool: PayloadSlab
    ikey: bytes
    entry: IndexEntry
    deleted: Optional[bool]


@dataclass(frozen=True)
class Delete:
    """delete(): drop these pages (index delete, then slot free); reply.result = pages deleted."""
    reply: Reply
    pool: PayloadSlab
    ikeys: list[bytes]


@dataclass(frozen=True)
class Clear:
    """clear(): once no write is in flight, drop every page of the rank; reply.result = succeeded."""
    reply: Reply


@dataclass(frozen=True)
class Stop:
    """close(): finish what is in flight, persist LRU touches, exit; reply.done when it did."""
    reply: Reply


Message = Union[WriteBatch, IoDone, Committed, Drop, Delete, Clear, Stop]


# -- the commit thread's queue ------------------------------------------------------------------------

@dataclass(frozen=True)
class CommitJob:
    """A group of written pages to make durable, with the LRU touches that ride its index txn."""
    group: list[WriteTask]
    touches: list[tuple[bytes, IndexEntry]]
