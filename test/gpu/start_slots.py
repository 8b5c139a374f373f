"""At most N real servers starting at once on one GPU (imports nothing GPU-specific; checked on CPU
by ``test/unit/test_gpu_test_support.py``).

Why: with four servers starting at once on one H200 (``-n 4``), a server's own warm-up gave up:
upstream polls ``/model_info`` 120 times and then calls ``kill_process_tree``, and the server exited -9
after 240 s. One start alone takes 33-57 s there (docs_internal/gpu_server.md). A start slot is an flock
on a file shared by every pytest worker of the host, held from spawn until the server is healthy (or
failed); serving is not limited, only the CPU- and JIT-heavy start.

Knobs: ``SGLANG_CP_GPU_START_SLOTS`` (default 2), ``SGLANG_CP_GPU_START_WAIT_S`` (bound on the wait for a
slot, default 1800), ``SGLANG_CP_GPU_START_LOCK_DIR`` (default ``/tmp/sglang-cp-gpu-start-<uid>``).

The start ledger: every test server's start (its slot wait, spawn -> healthy, failed or not) is one JSON
line in ``SGLANG_CP_GPU_START_LOG`` (set by the suite's conftest for the whole run, workers included), and
the run ends with ``start_table`` of it. Why: the slots and the calls' bounds are chosen from these
figures; a test's wall time alone cannot say whether it waited for a slot or for its own server.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import time

from soak_support import percentile


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


def record_start(entry: dict, path: str | None = None) -> None:
    """Append one start to the ledger ``path`` (None: ``SGLANG_CP_GPU_START_LOG``; empty: no ledger, no-op).
    One ``write`` of one line on an O_APPEND file: the workers' lines never interleave."""
    if path is None:
        path = os.environ.get("SGLANG_CP_GPU_START_LOG")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


@contextlib.contextmanager
def ledgered_start(env: dict, tag: str, path: str | None = None, **slot_kw):
    """A start slot (``start_slot``) around one server start, recorded in the ledger when the start ends,
    failed (the exception passes through) or not: the slot wait, and the start's own time."""
    asked = time.monotonic()
    with start_slot(env, **slot_kw) as slot:
        began = time.monotonic()
        entry = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "tag": tag,
                 "gpu": env.get("CUDA_VISIBLE_DEVICES", "all"), "slot": slot,
                 "wait_s": round(began - asked, 2), "ok": False}
        try:
            yield entry
            entry["ok"] = True
        finally:
            entry["start_s"] = round(time.monotonic() - began, 2)
            record_start(entry, path)


def read_starts(path: str) -> list:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def start_table(starts: list, slowest: int = 3) -> str:
    """Per GPU: how many starts, how many failed, the slot wait and spawn -> healthy (p50 / max, s), and the
    slowest starts with their tests; empty when there were none."""
    if not starts:
        return ""
    by_gpu = collections.defaultdict(list)
    for e in starts:
        by_gpu[e.get("gpu", "all")].append(e)
    def sec(v, width):
        return f"{v:>{width}.1f}" if v is not None else f"{'-':>{width}}"

    head = f"{'gpu':>4} {'starts':>6} {'failed':>6} {'wait p50':>8} {'wait max':>8} {'start p50':>9} {'start max':>9}"
    lines = [head, "-" * len(head)]
    for gpu, es in sorted(by_gpu.items()):
        waits = [e["wait_s"] for e in es]
        ok = [e["start_s"] for e in es if e["ok"]]
        lines.append(f"{gpu:>4} {len(es):>6} {sum(not e['ok'] for e in es):>6} {sec(percentile(waits, 50), 8)} "
                     f"{sec(max(waits), 8)} {sec(percentile(ok, 50), 9)} {sec(max(ok, default=None), 9)}")
    worst = sorted(starts, key=lambda e: -(e["wait_s"] + e["start_s"]))[:slowest]
    lines.append("slowest (wait + start): " + "; ".join(
        f"{e['test']} [{e['tag']}] {e['wait_s']:.0f} + {e['start_s']:.0f} s{'' if e['ok'] else ' FAILED'}"
        for e in worst))
    return "\n".join(lines)
