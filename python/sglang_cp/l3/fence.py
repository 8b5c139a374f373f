"""What must wait for group commits that are still pending when a write has already returned.

Under durability.backup_ack = "written" write_pages returns once its pages are in their slots, before
their group commit. A delete or a touch that the caller makes after that return must act after that
commit, or the commit undoes it: a delete finds no LRU entry (returns 0) and the commit then indexes the
page, which comes back (also after a restart or a power loss); a touch finds no LRU entry, is lost, and
pages written before it are committed, so ranked warmer, after it. The write thread (the fence's only
user) holds such operations here until those commits landed:

  delete  until every write of its keys that had returned (pwrite done, commit pending) is final; then
          it runs as any delete: index delete committed, then slot free. So a slot is freed only once
          the commit that names it landed and its entry was deleted, never while that commit can land.
  touch   until every group commit pending when it arrived landed (at most two: the one running and the
          one of the writes completed meanwhile); touches stay in arrival order.

Without backup_ack = "written" nothing is held: every write returns after its commit.
Rejected (docs_internal/l3_write_ack.md): cancelling the pending page's commit, and a tombstone.
"""

from __future__ import annotations

import collections

from .messages import Delete, Touch, WriteTask
from .state import StoreState

# Touches held for pending commits; past this many (a commit that hangs) further touches are dropped and
# counted, as the store's own touch queue does: a touch is advisory.
_MAX_HELD_TOUCHES = 65536


class CommitFence:
    def __init__(self, st: StoreState):
        self.st = st
        self.on = st.ack_at_write
        self.landed = 0  # group commits finished (ok or not)
        self.deletes: list[tuple[Delete, list[tuple[bytes, WriteTask]]]] = []
        self.touches: collections.deque[tuple[int, Touch]] = collections.deque()

    def commit_landed(self) -> None:
        self.landed += 1

    # -- deletes --------------------------------------------------------------------------------------

    def hold_delete(self, m: Delete) -> bool:
        """True: `m` names a page whose write returned and whose commit is pending; it waits here."""
        if not self.on:
            return False
        st = self.st
        with st.lock:
            waits = [(k, t) for k, t in ((k, st.inflight.get(k)) for k in m.ikeys)
                     if t is not None and t.written and t.error is None]
        if not waits:
            return False
        self.deletes.append((m, waits))
        return True

    def ready_deletes(self, force: bool = False) -> list[Delete]:
        """Held deletes whose writes are final now (committed or failed); `force`: all of them (the write
        thread stops: what it has not dispatched is never written)."""
        if not self.deletes:
            return []
        st = self.st
        with st.lock:
            done = [force or all(st.inflight.get(k) is not t for k, t in waits) for _, waits in self.deletes]
        ready = [m for (m, _), d in zip(self.deletes, done) if d]
        self.deletes = [h for h, d in zip(self.deletes, done) if not d]
        return ready

    # -- touches --------------------------------------------------------------------------------------

    def hold_touch(self, touch: Touch, groups_pending: int) -> bool:
        """True: the touch waits for the `groups_pending` commits pending now (or behind touches held
        already, so that touches keep their order)."""
        if not self.on or not (groups_pending or self.touches):
            return False
        if len(self.touches) >= _MAX_HELD_TOUCHES:
            self.st.count("touches_dropped")
            return True
        need = self.landed + groups_pending
        if self.touches:
            need = max(need, self.touches[-1][0])
        self.touches.append((need, touch))
        return True

    def ready_touches(self, force: bool = False) -> list[Touch]:
        out = []
        while self.touches and (force or self.touches[0][0] <= self.landed):
            out.append(self.touches.popleft()[1])
        return out

    # -- exit -----------------------------------------------------------------------------------------

    def abandon(self) -> None:
        """The write thread exits without running what it holds: wake the callers of held deletes (their
        reply stays unanswered, so they raise 'closed' or the store's fatal error)."""
        for m, _ in self.deletes:
            m.reply.done.set()
        self.deletes = []
        self.touches.clear()
