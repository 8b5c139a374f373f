"""Hook point: CUDA-graph capture of the decode graph runners.

Targets:
- ``sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture``
  (AROUND; inherited by the EAGLE draft and draft-extend runners): log the
  runner's static input/output buffer table (name/shape/dtype/MB), flagging
  buffers that upstream's ``share_buffers()`` aliased onto an earlier family,
  then a per-family TOTAL of graph-pool growth after capture.
- ``DecodeCudaGraphRunner.capture_one_shape``,
  ``EAGLEDraftCudaGraphRunner.capture_one_shape``,
  ``EAGLEDraftExtendCudaGraphRunner.capture_one_shape`` (AROUND): graph-pool
  growth of each captured shape (the draft runners override the per-shape step).
- ``DecodeCudaGraphRunner._post_process_after_profile`` (AROUND): with
  ``--enable-profile-cuda-graph`` every family dumps to the same
  ``cuda_graph_runner_memory_usage.pickle``, so the last family overwrites the
  others; we move each dump to ``cuda_graph_mem_<family>.pickle``.

Why: attributing decode CUDA-graph GPU memory across the three EAGLE graph
families is otherwise guesswork; upstream 0.5.23 logs none of it.

Seed item 002#17: "Attribute decode CUDA-graph GPU memory at capture time, gated
by SGLANG_LOG_CG_BUFFERS=1 (off by default, startup-only, rank0) ... Also fix
--enable-profile-cuda-graph dumping all families to one overwritten pickle".

Gate: ``SGLANG_CP_LOG_CG_BUFFERS=1`` (our name for the seed's env). Unlike a CLI
flag, an environment variable is known when the plugin registers, and resolving
these targets imports the graph runners (seconds in every process, the launcher
included, and it reorders upstream's ``--reasoning-parser`` help choices). So
``HOOKS`` is empty unless the variable is set; ``CANDIDATE_HOOKS`` holds the specs.
The hooks still re-check it at call time; rank 0 only. Capture runs once at
startup, so the cost never reaches the serving path.
"""

from __future__ import annotations

import logging
import os

from sglang_cp.compute.cg_buffers import (
    BufferLedger,
    ShapeGrowth,
    format_buffer_table,
)
from sglang_cp.integration.hookspec import HookSpec

logger = logging.getLogger(__name__)

ENV = "SGLANG_CP_LOG_CG_BUFFERS"
UPSTREAM_PICKLE = "cuda_graph_runner_memory_usage.pickle"

_ledger = BufferLedger()
_growth: dict[int, ShapeGrowth] = {}


def _env_on() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _enabled() -> bool:
    if not _env_on():
        return False
    try:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().tp_rank == 0
    except Exception:
        # No published topology (a single process): it is rank 0.
        return True


def family_of(runner) -> str:
    mode = getattr(runner, "capture_forward_mode", None)
    suffix = f"[{mode.name.lower()}]" if mode is not None and hasattr(mode, "name") else ""
    return f"{type(runner).__name__}{suffix}"


def _pool_bytes() -> int:
    import torch

    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def capture_around(original, self, *args, **kwargs):
    if not _enabled():
        return original(self, *args, **kwargs)
    family = family_of(self)
    try:
        rows = _ledger.table(family, getattr(self, "buffers", None))
        logger.info("%s", format_buffer_table(family, rows))
    except Exception:  # a debug aid must never stop a capture
        logger.warning("[cg-buffers] %s: buffer table failed", family, exc_info=True)
    growth = _growth.setdefault(id(self), ShapeGrowth(family))
    try:
        return original(self, *args, **kwargs)
    finally:
        if growth.deltas:
            logger.info("%s", growth.total_line())
        _growth.pop(id(self), None)


def capture_one_shape_around(original, self, size, *args, **kwargs):
    if not _enabled():
        return original(self, size, *args, **kwargs)
    before = _pool_bytes()
    try:
        return original(self, size, *args, **kwargs)
    finally:
        growth = _growth.setdefault(id(self), ShapeGrowth(family_of(self)))
        variant = [str(a) for a in args[1:] if a is not None]
        shape = f"bs={size}" + (f" ({', '.join(variant)})" if variant else "")
        logger.info("%s", growth.add(shape, _pool_bytes() - before))


def post_process_after_profile_around(original, self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    if _enabled() and os.path.exists(UPSTREAM_PICKLE):
        target = f"cuda_graph_mem_{family_of(self)}.pickle".replace("[", "_").replace("]", "")
        os.replace(UPSTREAM_PICKLE, target)
        logger.info("[cg-buffers] %s memory snapshot -> %s", family_of(self), target)
    return result


_DECODE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_SEED = "002#17 SGLANG_LOG_CG_BUFFERS decode CUDA-graph memory attribution"

CANDIDATE_HOOKS = (
    HookSpec(
        target=f"{_DECODE}.capture",
        kind="around",
        fn=capture_around,
        seed=_SEED,
        why="the one capture entry of all decode graph families; buffers exist, graphs not yet",
    ),
    HookSpec(
        target=f"{_DECODE}.capture_one_shape",
        kind="around",
        fn=capture_one_shape_around,
        seed=_SEED,
        why="per-shape capture step of the target/verify family",
    ),
    HookSpec(
        target="sglang.srt.speculative.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner.capture_one_shape",
        kind="around",
        fn=capture_one_shape_around,
        seed=_SEED,
        why="the draft family overrides the per-shape capture step",
    ),
    HookSpec(
        target="sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner.capture_one_shape",
        kind="around",
        fn=capture_one_shape_around,
        seed=_SEED,
        why="the draft-extend family overrides the per-shape capture step",
    ),
    HookSpec(
        target=f"{_DECODE}._post_process_after_profile",
        kind="around",
        fn=post_process_after_profile_around,
        seed="002#17 per-family cuda_graph_mem_<family>.pickle instead of one overwritten file",
        why="the only writer of the shared cuda_graph_runner_memory_usage.pickle",
    ),
)

HOOKS = CANDIDATE_HOOKS if _env_on() else ()
