"""Acknowledgements and per-operation completion.

Async users drain `Ack`s from the store's queue; the sync helpers wait on their own op's completion
and never emit into (or consume from) that queue, so they cannot steal other users' acks.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Optional


class AckKind(enum.Enum):
    GATHERED = "gathered"  # the page was copied into staging; the caller may reuse its buffer
    DURABLE = "durable"    # ok=True: data + index are on stable storage; ok=False: the write failed
    READ = "read"          # ok=True: verified bytes are in outs[i]; ok=False: a miss


@dataclass(frozen=True)
class Ack:
    op: int
    index_in_op: int
    key: bytes
    kind: AckKind
    ok: bool


class OpState:
    """Completion of one submit_* call: one final result (DURABLE or READ) per page."""

    def __init__(self, op_id: int, keys: list[bytes], sync: bool):
        self.op_id = op_id
        self.keys = keys
        self.sync = sync
        self.results: list[Optional[bool]] = [None] * len(keys)
        self.remaining = len(keys)
        self.done = threading.Event()
        self.cond = threading.Condition()
        self.cancelled = False
        self.running = 0  # pages whose I/O touches caller memory right now
        # The caller returned while some of that I/O was still running (io.zero_copy_writes under a
        # timeout): its memory may have changed under those writes, so none of them may be indexed.
        self.abandoned = False
        self.on_done = None
        # write_pages under durability.backup_ack = "written": a page's result is final once its pwrite
        # returned (its group commit follows); see docs_internal/l3_write_ack.md.
        self.ack_at_write = False
        # Native reads (io.read_engine = "native"): the C engine's permission to write the caller's
        # pages, and close_gate(wait) to revoke it; cancel and cancel_and_quiesce close it too.
        self.gate = None
        self.close_gate = None
        if not keys:
            self.done.set()

    def finish(self, i: int, ok: bool) -> bool:
        """Record page i's final result; True when that completed the op."""
        with self.cond:
            if self.results[i] is not None:
                return False
            self.results[i] = ok
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()
                done = True
            else:
                return False
        if done and self.on_done is not None:
            self.on_done(self)
        return True

    def begin_io(self) -> bool:
        with self.cond:
            if self.cancelled:
                return False
            self.running += 1
            return True

    def end_io(self) -> bool:
        """True when the caller gave up waiting for this I/O (its memory may have changed under it)."""
        with self.cond:
            self.running -= 1
            self.cond.notify_all()
            return self.abandoned

    def cancel(self) -> None:
        """Stop pages that have not started touching caller memory; do not wait for the others."""
        with self.cond:
            self.cancelled = True
        if self.close_gate is not None:
            self.close_gate(False)

    def cancel_and_quiesce(self, deadline: Optional[float] = None) -> bool:
        """Stop pages that have not started; wait for those already touching caller memory, until
        `deadline` (time.monotonic) if given. False: some still run and the op is abandoned from now on
        (their end_io returns True). Native reads' copies under way are always waited for: each is a
        memory copy of one chunk (the engine raises past its own bound)."""
        with self.cond:
            self.cancelled = True
        if self.close_gate is not None:
            self.close_gate(True)
        with self.cond:
            while self.running:
                if deadline is None:
                    self.cond.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    self.abandoned = True
                    return False
                self.cond.wait(left)
            return True

    def final(self) -> list[bool]:
        return [bool(r) for r in self.results]
