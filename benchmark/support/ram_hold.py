"""Hold a host's spare RAM so that what is left for the page cache is the same small amount for every tier.

A storage tier that reads through the page cache (upstream's ``file``) serves its hits from DRAM whenever
the host's free RAM holds its files: on a GPU host with 125 GiB of RAM a 17 GB working set is a DRAM tier
for it and a disk tier for an O_DIRECT one. A deployment whose working set is larger than its RAM (the
case a storage tier exists for) gives neither that DRAM. ``RamHold`` emulates it on a big host: a child
process holds anonymous memory, sized every ``TICK_S`` so that the host's ``MemAvailable`` (free memory
plus the page cache the kernel can reclaim) stays at ``leave`` bytes. What the servers hold is theirs (the
child gives way when they grow); the page cache any tier can keep is at most ``leave``.

Lifecycle, as the harness uses it: ``start()`` once; ``loosen(extra)`` before a server or a side service
starts (their pinned pools and imports need room the kernel cannot make by reclaiming cache, and a
squeezed start would be killed, not slowed); ``tighten()`` before a measured phase, waiting (bounded)
until the goal is reached; ``phase_stats()`` after it; ``stop()`` at the end. The child sets its
``oom_score_adj`` to 1000: if memory runs out anyway the kernel kills the holder, never a server, and
``alive`` turns false in the stats, which the report shows beside the phase.

No swap is assumed (``SwapTotal`` is recorded): with swap the holder's pages could be swapped out and the
page cache would get their room back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Optional

CHUNK = 256 << 20  # bytes the child takes or gives back per step
TICK_S = 0.25  # how often the goal is re-read against /proc/meminfo
GROW_STEP = 64 * CHUNK  # the most the holder takes in one step
# The kernel folds its per-CPU memory counters into /proc/meminfo every vm.stat_interval (1 s by default):
# a reading taken sooner after a step may not show it yet, and acting on it would step again (the holder
# overshot by a whole step before it waited). After each step the controller waits this long.
STAT_LAG_S = 1.2
PAGE = 4096


def meminfo(path: str = "/proc/meminfo") -> dict:
    """/proc/meminfo's fields in bytes (the kernel writes kB)."""
    out = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def available() -> int:
    return meminfo()["MemAvailable"]


class RamHold:
    """A child process holding host RAM so that ``MemAvailable`` stays at the current goal (``leave``,
    or ``leave + extra`` while loosened)."""

    def __init__(self, leave: int, wait_s: float = 180.0):
        if leave <= 0:
            raise ValueError(f"ram_hold: leave must be > 0 bytes, got {leave}")
        self.leave, self.wait_s = int(leave), float(wait_s)
        self._goal = None  # bytes MemAvailable should be; None: hold nothing
        self._held = 0
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._avail_min: Optional[int] = None
        self._died = False
        self._quiet_until = 0.0  # monotonic time before which /proc/meminfo may not show the last step

    # --- the controller ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "benchmark.support.ram_hold", "--child"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        line = self._proc.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"ram_hold: the holder did not start (said {line!r})")
        self._thread = threading.Thread(target=self._run, name="ram-hold", daemon=True)
        self._thread.start()

    def _ask(self, held: int) -> bool:
        """Have the child hold ``held`` bytes (rounded to CHUNK); False once it is gone."""
        try:
            self._proc.stdin.write(f"{held // CHUNK}\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
        except (BrokenPipeError, OSError, ValueError):
            reply = ""
        if not reply.startswith("held "):
            self._died = True
            return False
        held = int(reply.split()[1]) * CHUNK
        if held != self._held:
            self._quiet_until = time.monotonic() + STAT_LAG_S
        self._held = held
        return True

    def _run(self) -> None:
        while not self._stop.is_set() and not self._died:
            with self._lock:
                goal, avail = self._goal, available()
                if goal is not None and self._avail_min is not None:
                    self._avail_min = min(self._avail_min, avail)
                if time.monotonic() >= self._quiet_until:
                    want = 0 if goal is None else max(0, self._held + avail - goal)
                    want = min(want, self._held + GROW_STEP)  # in steps: a server's growth shows between them
                    if abs(want - self._held) >= CHUNK or (want == 0 and self._held):
                        self._ask(want)
            self._stop.wait(TICK_S)

    def loosen(self, extra: int) -> None:
        """Make room (``leave + extra`` available) before a start; returns once the child has given it back."""
        with self._lock:
            self._goal = self.leave + int(extra)
            if not self._died:
                self._ask(max(0, self._held + available() - self._goal))

    def tighten(self) -> dict:
        """Hold down to ``leave`` and wait (at most ``wait_s``) until ``MemAvailable`` is within a chunk of
        it; returns how it went. The phase's minimum ``MemAvailable`` is tracked from here."""
        t0 = time.monotonic()
        with self._lock:
            self._goal = self.leave
            self._avail_min = None
        while time.monotonic() - t0 < self.wait_s and not self._died:
            if time.monotonic() >= self._quiet_until and self._near_goal():
                break
            time.sleep(TICK_S)
        with self._lock:
            self._avail_min = available()
        return {"wait_s": time.monotonic() - t0, "reached": self._near_goal(), "held": self._held,
                "alive": not self._died}

    def _near_goal(self) -> bool:
        return available() <= self.leave + 2 * CHUNK

    def phase_stats(self) -> dict:
        """What the phase ran under: the goal, what was held, the lowest ``MemAvailable`` seen, whether the
        holder lived through it, and the host's swap (with swap the cap is weaker)."""
        info = meminfo()
        with self._lock:
            return {"leave": self.leave, "held": self._held, "available_min": self._avail_min,
                    "available": info.get("MemAvailable"), "swap_total": info.get("SwapTotal", 0),
                    "alive": not self._died}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._proc is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._proc = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


# --- the child -------------------------------------------------------------------------------------------
def _child() -> None:
    """Hold a list of CHUNK-sized bytearrays, each page written once so the kernel backs it; a number on
    stdin is the count of chunks to hold, answered with the count held. EOF releases everything."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # under pressure the kernel kills the holder first, never a server
    except OSError:
        pass
    chunks: list = []
    touch = b"\x01" * (CHUNK // PAGE)
    print("ready", flush=True)
    for line in sys.stdin:
        want = max(0, int(line))
        while len(chunks) > want:
            chunks.pop()
        while len(chunks) < want:
            b = bytearray(CHUNK)
            b[::PAGE] = touch  # a write per page: the memory is resident, not a promise
            chunks.append(b)
        print(f"held {len(chunks)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        _child()
    else:
        sys.exit("ram_hold: run by benchmark.support.ram_hold.RamHold, not by hand")
