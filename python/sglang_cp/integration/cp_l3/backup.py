"""Hook point: upstream's backup of one storage operation, batch by batch
(``managers/cache_controller.py`` ``HiCacheController._page_backup``).

Target and why: upstream's backup thread takes one ``StorageOperation`` (a radix-tree node's
pages) and calls the backend's ``batch_set_v1`` once per ``STORAGE_BATCH_SIZE`` (128) pages,
in turn, then acks the whole operation (``ack_backup_queue``), which releases the host lock
on its pages. Nothing upstream looks at between two batches. With ``durability.backup_ack =
"durable"`` every batch waits for its own fdatasync and index commit, so each batch drains
the rank's write pipeline before the next one is staged; at CP=4 a rank owns 32 pages of a
128-key batch, and on the H200 host it kept 3.1 of 4 pwrites in flight (3.85 at CP=1/2) and
spent 211 ms per backup in four index commits (docs_internal/figures.md, "Upstream's storage path").
Under ``backup_ack = "operation"`` this hook opens the operation on our backend before
upstream's loop (each batch then returns once its pages are staged) and, after the loop,
waits until every page is durable before the operation is acked: the ack still means
durable, the batches no longer wait one by one.

``HybridCacheController._page_backup`` writes its sidecar pools and then calls this method
through ``super()``: its KV batches are bracketed, its sidecar calls stay per call (durable).

A page that failed after its batch returned makes the operation's ``completed_tokens`` stop
before that page (upstream reads it for its backup metrics); the page itself is a miss later,
counted by the store (``write_errors``, ``write_timeouts``), never wrong bytes.

Seed item: "a page is durable only when every owner rank acked it" -- the operation's ack is
the one upstream acts on, and it still comes after DURABLE.
"""

from __future__ import annotations

import logging

from sglang_cp.integration.hookspec import HookSpec

logger = logging.getLogger(__name__)

_CC = "sglang.srt.managers.cache_controller.HiCacheController"


def _per_operation_backend(controller):
    from sglang_cp.integration.cp_l3.backend import CpL3Storage

    backend = getattr(controller, "storage_backend", None)
    if isinstance(backend, CpL3Storage) and backend.backup_per_operation:
        return backend
    return None


def page_backup_around(original, self, operation):
    backend = _per_operation_backend(self)
    if backend is None:
        return original(self, operation)
    backend.begin_backup()
    try:
        result = original(self, operation)
    finally:
        first_bad = backend.end_backup()
    if first_bad is not None:
        done = min(operation.completed_tokens, first_bad * self.page_size)
        logger.warning("sglang-cp L3: backup operation %s: page %d of %d not stored after its batch "
                       "returned; %d of %d tokens backed up", operation.id, first_bad,
                       len(operation.hash_value), done, operation.completed_tokens)
        operation.completed_tokens = done
    return result


HOOKS = (
    HookSpec(f"{_CC}._page_backup", "around", page_backup_around,
             seed="a page is durable only when every owner rank acked it",
             why="the one method that runs an operation's batches; its end is where the ack may wait"),
)
