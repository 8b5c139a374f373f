"""The group-commit thread: a page is indexed only after its data is on stable storage.

Per group handed over by the write thread: fdatasync every slab the group touched, then one durable
LMDB write txn with all their index entries (and the LRU touches that ride along), then Committed back
to the write thread, which does the bookkeeping and the DURABLE acks. One group at a time.
"""

from __future__ import annotations

import queue
import threading
from typing import Optional

from .format.index import IndexFull, IndexUnavailable
from .messages import CommitJob, Committed, WriteTask
from .state import StoreState


class GroupCommitter:
    def __init__(self, st: StoreState):
        self.st = st
        self._jobs: queue.SimpleQueue[Optional[CommitJob]] = queue.SimpleQueue()  # None: exit
        self._thread = threading.Thread(target=self._loop, name=f"l3-commit-r{st.rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: CommitJob) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """After the group in flight (if any) is done."""
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        st = self.st
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self.commit_group(job.group, job.touches)
            except BaseException as err:
                for t in job.group:
                    t.error = t.error or repr(err)
                st.set_fatal(err)
            st.post(Committed(job.group))

    def commit_group(self, group: list[WriteTask], touches: list) -> None:
        """fdatasync touched slabs, then one durable index txn; a page that failed either is marked."""
        st = self.st
        good = [t for t in group if t.error is None]
        for slab in {t.pool.slab for t in good}:
            try:
                slab.sync()
            except OSError as err:
                st.fault("write_errors", "sync", "L3 fdatasync of %s failed: %s", slab.path, err)
                for t in good:
                    if t.pool.slab is slab:
                        t.error = "fdatasync"
        good = [t for t in good if t.error is None]
        try:
            st.index.commit(puts=[(t.ikey, t.entry(st.rank)) for t in good], touches=touches)
        except IndexFull as err:
            st.fault("mapfull", "mapfull", "L3 index full (%s); %d page(s) not stored", err, len(good))
            for t in good:
                t.error = "mapfull"
        except IndexUnavailable as err:
            st.fault("index_errors", "index-w", "L3 index commit failed (%s); %d page(s) not stored",
                     err, len(good))
            for t in good:
                t.error = "index"
