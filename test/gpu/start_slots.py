"""At most N real servers starting at once on one GPU (imports nothing GPU-specific; checked on CPU
by ``test/unit/test_gpu_test_support.py``).

Why: with four servers starting at once on one H200 (``-n 4``), a server's own warm-up gave up:
upstream polls ``/model_info`` 120 times and then calls ``kill_process_tree``, and the server exited -9
after 240 s. One start alone takes 33-57 s there (docs_internal/gpu_server.md). A start slot is an flock
on a file shared by every pytest worker of the host, held from spawn until the server is healthy (or
failed); serving is not limited, only the CPU- and JIT-heavy start.

Knobs: ``SGLANG_CP_GPU_START_SLOTS`` (default 2), ``SGLANG_CP_GPU_START_WAIT_S`` (bound on the wait for a
slot, default 1800), ``SGLANG_CP_GPU_START_LOCK_DIR`` (default ``/tmp/sglang-cp-gpu-start-<uid>``),
``SGLANG_CP_GPU_FIRST_START_GATE`` (default 1; 0 turns the gate below off).

The first-start gate: the first start of one model's kernels on a GPU JIT-builds them (MLA 51 s, DSA 84 s
on an H200), and two such starts at once each pay the whole build (196 / 207 s against 132 s alone, the
thirteenth run). So until one start of a model has come up healthy on a GPU, other starts of that model
wait for it, without holding a slot, while starts of other models go on. A marker file beside the slots
says the model is warm; it lives as long as the lock dir, as the JIT caches live as long as the machine.

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
import re
import threading
import time

from soak_support import percentile


def _where(env: dict, lock_dir: str | None) -> tuple:
    """(lock dir, GPU name) of the GPU ``env`` selects: the files every worker of the host shares."""
    d = lock_dir or os.environ.get("SGLANG_CP_GPU_START_LOCK_DIR") or f"/tmp/sglang-cp-gpu-start-{os.geteuid()}"
    return d, (env.get("CUDA_VISIBLE_DEVICES") or "all").replace(",", "_")


def _wait_bound(wait_s: float | None) -> float:
    return float(os.environ.get("SGLANG_CP_GPU_START_WAIT_S", "1800")) if wait_s is None else wait_s


def _priority_waiters(d: str, gpu: str) -> int:
    """Priority starts of ``gpu`` waiting for a slot now (their files, whose processes live)."""
    n = 0
    for name in os.listdir(d):
        parts = name.split(".")
        if len(parts) != 4 or parts[:2] != [f"gpu{gpu}", "prio"]:
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:  # a waiter killed while waiting left its file: not a waiter
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, name))
            continue
        except (ValueError, PermissionError):
            pass
        n += 1
    return n


@contextlib.contextmanager
def start_slot(env: dict, slots: int | None = None, wait_s: float | None = None, lock_dir: str | None = None,
               priority: bool = False):
    """Hold one start slot of the GPU ``env`` selects (``CUDA_VISIBLE_DEVICES``); yields the slot number.
    TimeoutError when none is free within ``wait_s``. A ``priority`` start (a call's long pole: the soak's
    servers) takes the next free slot before any other waiting start; the others wait while one is queued,
    so the long pole stops paying the slot queue of every short test beside it (the soaks waited 97 and
    131 s in all for slots in the fourteenth run)."""
    slots = int(os.environ.get("SGLANG_CP_GPU_START_SLOTS", "2")) if slots is None else slots
    wait_s = _wait_bound(wait_s)
    d, gpu = _where(env, lock_dir)
    os.makedirs(d, mode=0o700, exist_ok=True)
    deadline = time.monotonic() + wait_s
    queued = None
    if priority:
        queued = os.path.join(d, f"gpu{gpu}.prio.{os.getpid()}.{threading.get_ident()}")
        os.close(os.open(queued, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))
    try:
        while True:
            if priority or not _priority_waiters(d, gpu):
                for i in range(max(1, slots)):
                    fd = os.open(os.path.join(d, f"gpu{gpu}.slot{i}"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                 0o600)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        os.close(fd)
                        continue
                    if queued:
                        os.unlink(queued)
                        queued = None
                    try:
                        yield i
                    finally:
                        os.close(fd)  # drops the flock
                    return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no server start slot of GPU {gpu} free within {wait_s:.0f} s "
                                   f"({slots} slots in {d})")
            time.sleep(0.2)
    finally:
        if queued:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(queued)


def kernels_key(model_path: str, argv: list) -> str:
    """What a server's first start JIT-builds: its model under its attention backend, "default" when the
    command leaves the choice to upstream (the README's launch line)."""
    backend = argv[argv.index("--attention-backend") + 1] if "--attention-backend" in argv else "default"
    return f"{os.path.basename(model_path.rstrip('/'))}-{backend}"


@contextlib.contextmanager
def first_start_gate(env: dict, kernels: str | None, wait_s: float | None = None, lock_dir: str | None = None):
    """Yields True when the caller's start is the first of ``kernels`` on its GPU (it builds them; every
    other start of them waits here until it is healthy), False when they are warm or the gate is off. A
    first start that fails leaves no marker: the next waiter builds. TimeoutError after ``wait_s``."""
    if not kernels or os.environ.get("SGLANG_CP_GPU_FIRST_START_GATE", "1") == "0":
        yield False
        return
    wait_s = _wait_bound(wait_s)
    d, gpu = _where(env, lock_dir)
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", kernels)
    warm = os.path.join(d, f"gpu{gpu}.{key}.warm")
    if os.path.exists(warm):
        yield False
        return
    os.makedirs(d, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(d, f"gpu{gpu}.{key}.first"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)
    builds = False
    try:
        deadline = time.monotonic() + wait_s
        # A waiter leaves as soon as the model is warm and never holds the gate for a warm start: holding
        # it serialised every waiter behind the one before (the fourteenth run: 169 + 78 + 43 s queues).
        while not os.path.exists(warm):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the first start of {kernels} on GPU {gpu} was not healthy within "
                                       f"{wait_s:.0f} s ({d})") from None
                time.sleep(0.2)
                continue
            builds = not os.path.exists(warm)  # under the lock: the start before may just have built them
            break
    finally:
        if not builds:
            os.close(fd)  # drops the flock, if taken
    if not builds:
        yield False
        return
    try:
        yield True
        os.close(os.open(warm, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))
    finally:
        os.close(fd)  # drops the flock: the waiters see the marker (or, after a failure, one of them builds)


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
def ledgered_start(env: dict, tag: str, path: str | None = None, kernels: str | None = None, **slot_kw):
    """The first-start gate of ``kernels`` and a start slot (``start_slot``) around one server start,
    recorded in the ledger when the start ends, failed (the exception passes through) or not: the wait
    (gate and slot; ``gate_s`` of it at the gate), whether it built the kernels, and the start's own time."""
    asked = time.monotonic()
    with first_start_gate(env, kernels, slot_kw.get("wait_s"), slot_kw.get("lock_dir")) as first:
        gated = time.monotonic()
        with start_slot(env, **slot_kw) as slot:
            began = time.monotonic()
            entry = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "tag": tag,
                     "gpu": env.get("CUDA_VISIBLE_DEVICES", "all"), "slot": slot, "kernels": kernels,
                     "first": first, "priority": bool(slot_kw.get("priority")),
                     "gate_s": round(gated - asked, 2), "wait_s": round(began - asked, 2), "ok": False}
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
    # The first start of each kernels key: a cold build (minutes on a fresh machine) or, with the JIT caches
    # kept, a warm start; this line says which a run had, and so whether a call's bound was the layout's.
    firsts = [e for e in starts if e.get("first")]
    if firsts:
        lines.append("first starts (built kernels): " + "; ".join(
            f"{e.get('kernels')} {e['start_s']:.0f} s{'' if e['ok'] else ' FAILED'}" for e in firsts))
    worst = sorted(starts, key=lambda e: -(e["wait_s"] + e["start_s"]))[:slowest]
    lines.append("slowest (wait + start): " + "; ".join(
        f"{e['test']} [{e['tag']}] {e['wait_s']:.0f} + {e['start_s']:.0f} s"
        f"{' (built kernels)' if e.get('first') else ''}{'' if e['ok'] else ' FAILED'}"
        for e in worst))
    return "\n".join(lines)
