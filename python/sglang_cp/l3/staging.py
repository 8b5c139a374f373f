"""Bounded staging memory of the write path (GATHERED copies wait here until their pwrite returns)."""

from __future__ import annotations

import threading
import time
from typing import Optional

from .format.aligned import aligned_buffer
from .errors import L3InvariantError


class Tokens:
    """A counting semaphore whose waits take a deadline (time.monotonic) and end when it is shut:
    a token held by I/O stuck on a dead disk may never come back, and nobody may wait for it
    past their bound or past close()."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free = limit
        self._shut = False
        self._cond = threading.Condition()
        self._waiting: list[int] = []  # how many free tokens each blocked caller waits for

    def acquire(self, blocking: bool = True, deadline: Optional[float] = None, ready: int = 1) -> bool:
        """One token. A caller that finds none free blocks until `ready` are free (at most the limit), so
        it wakes once per run of returned tokens rather than once per token: each wake-up of a thread
        costs it up to the switch interval to get the GIL back beside a busy Python thread."""
        with self._cond:
            if not self._free and blocking and not self._shut:
                if not self._wait_for(max(1, min(ready, self.limit)), deadline):
                    return False
            if self._shut or not self._free:
                return False
            self._free -= 1
            return True

    def _wait_for(self, need: int, deadline: Optional[float]) -> bool:
        """Under the condition's lock: wait until `need` tokens are free or the pool is shut (True), or
        until `deadline` passed (False)."""
        self._waiting.append(need)
        try:
            while self._free < need and not self._shut:
                if deadline is None:
                    self._cond.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
            return True
        finally:
            self._waiting.remove(need)

    def acquire_many(self, n: int, deadline: Optional[float] = None) -> bool:
        """``n`` tokens (1..limit) at once, or none: a caller never holds some while it waits for the rest.
        Callers that each take a run one token at a time can split the tokens between them and wait for
        ever with nothing in flight to give any back (three readers of 32-page runs under 64 permits held
        31, 31 and 2). False past `deadline` or once shut."""
        if not 1 <= n <= self.limit:
            raise L3InvariantError(f"{n} tokens asked at once of {self.limit}")
        with self._cond:
            if self._free < n and not self._shut and not self._wait_for(n, deadline):
                return False
            if self._shut or self._free < n:
                return False
            self._free -= n
            return True

    @property
    def free(self) -> int:
        with self._cond:
            return self._free

    def release(self) -> None:
        with self._cond:
            if self._free >= self.limit:
                raise L3InvariantError(f"token released twice ({self.limit} tokens)")
            self._free += 1
            if self._waiting and self._free >= min(self._waiting):
                # one token serves one waiter of one; a waiter of a run may sit behind others in the queue
                self._cond.notify(1 if max(self._waiting) == 1 else len(self._waiting))

    def shut(self) -> None:
        """Every waiter (now and later) gets False at once."""
        with self._cond:
            self._shut = True
            self._cond.notify_all()


class Staging:
    """Bounded staging memory: `max_inflight_pages` tokens shared by all payloads (backpressure).

    Each payload gets an arena of `limit` slot images, on transparent huge pages where the kernel
    allows, allocated and faulted in at open so the write path never pays first-touch page faults
    (slow on VMs with free-page reporting). A token comes back when its page's pwrite returned."""

    def __init__(self, limit: int, extents: set[int]):
        self._sem = Tokens(limit)
        self._free: dict[int, list[memoryview]] = {}
        self._arenas = []
        for ext in extents:
            arena = aligned_buffer(ext * limit, populate=True, huge=True)
            self._arenas.append(arena)
            mv = memoryview(arena)
            self._free[ext] = [mv[i * ext:(i + 1) * ext] for i in range(limit)]
        self._tails: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.limit = limit
        self.in_use = 0

    def acquire(self, extent: int, blocking: bool = True, deadline: Optional[float] = None,
                ready: int = 1) -> Optional[memoryview]:
        """A staging slot, or None: not blocking and none free, past `deadline`, or shut. When none is free
        the caller sleeps until `ready` are (``Tokens.acquire``)."""
        if not self._sem.acquire(blocking, deadline, ready):
            return None
        with self._lock:
            self.in_use += 1
            return self._free[extent].pop()

    def release(self, extent: int, buf: memoryview) -> None:
        with self._lock:
            self.in_use -= 1
            if self._closed:  # a submit that raced close() hands its slot back late
                return
            self._free[extent].append(buf)
        self._sem.release()

    def reserve(self, blocking: bool = True, deadline: Optional[float] = None) -> bool:
        """A token without a slot image: a zero-copy page written under a caller's bound counts against
        the same in-flight limit as a staged one (a stuck disk keeps it, like a staged page's)."""
        if not self._sem.acquire(blocking, deadline):
            return False
        with self._lock:
            self.in_use += 1
        return True

    def unreserve(self) -> None:
        with self._lock:
            self.in_use -= 1
            if self._closed:
                return
        self._sem.release()

    def tail(self, nbytes: int) -> memoryview:
        """A small aligned block for a zero-copy write's unaligned end + header (no token: the sync
        caller that owns the page bounds these by its own batch)."""
        with self._lock:
            free = self._tails.setdefault(nbytes, [])
            if free:
                return free.pop()
        return memoryview(aligned_buffer(nbytes))

    def release_tail(self, buf: memoryview) -> None:
        with self._lock:
            self._tails.setdefault(buf.nbytes, []).append(buf)

    def shut(self) -> None:
        """Wake every submitter waiting for a slot (the store is closing); later acquires get None."""
        self._sem.shut()

    def close(self) -> None:
        self._sem.shut()
        with self._lock:
            self._closed = True
            self._free.clear()
        for a in self._arenas:
            try:
                a.close()
            except BufferError:
                pass  # a view is still referenced somewhere; the GC unmaps it later
