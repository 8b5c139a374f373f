"""At most N real servers starting at once on one GPU (imports nothing GPU-specific; checked on CPU
by ``test/unit/test_gpu_soak_support.py``).

Why: with four servers starting at once on one H200 (``-n 4``), a server's own warm-up gave up:
upstream polls ``/model_info`` 120 times and then calls ``kill_process_tree``, and the server exited -9
after 240 s. One start alone takes 33-57 s there (docs_internal/gpu_server.md). A start slot is an flock
on a file shared by every pytest worker of the host, held from spawn until the server is healthy (or
failed); serving is not limited, only the CPU- and JIT-heavy start.

Knobs: ``SGLANG_CP_GPU_START_SLOTS`` (default 2), ``SGLANG_CP_GPU_START_WAIT_S`` (bound on the wait for a
slot, default 1800), ``SGLANG_CP_GPU_START_LOCK_DIR`` (default ``/tmp/sglang-cp-gpu-start-<uid>``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time


@contextlib.contextmanager
def start_slot(env: dict, slots: int | None = None, wait_s: float | None = None, lock_dir: str | None = None):
    """Hold one start slot of the GPU ``env`` selects (``CUDA_VISIBLE_DEVICES``); yields the slot number.
    TimeoutError when none is free within ``wait_s``."""
    slots = int(os.environ.get("SGLANG_CP_GPU_START_SLOTS", "2")) if slots is None else slots
    wait_s = float(os.environ.get("SGLANG_CP_GPU_START_WAIT_S", "1800")) if wait_s is None else wait_s
    d = lock_dir or os.environ.get("SGLANG_CP_GPU_START_LOCK_DIR") or f"/tmp/sglang-cp-gpu-start-{os.geteuid()}"
    gpu = (env.get("CUDA_VISIBLE_DEVICES") or "all").replace(",", "_")
    os.makedirs(d, mode=0o700, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        for i in range(max(1, slots)):
            fd = os.open(os.path.join(d, f"gpu{gpu}.slot{i}"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:
                yield i
            finally:
                os.close(fd)  # drops the flock
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no server start slot of GPU {gpu} free within {wait_s:.0f} s ({slots} slots in {d})")
        time.sleep(0.2)
