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
import select
import subprocess
import sys
import threading
import time
from typing import Optional

CHUNK = 256 << 20  # bytes the child takes or gives back per step
TICK_S = 0.25  # how often the goal is re-read against /proc/meminfo
GROW_STEP = 16 * CHUNK  # the most the holder takes in one step near its goal (seconds at ~1 GB/s): a
# server's growth shows between steps. Far from it (the first fill, ~100 GB on a GPU host) it takes
# GROW_STEP_FAR at a time: the lag after each step would otherwise double the fill's time.
GROW_STEP_FAR = 64 * CHUNK
# The kernel folds its per-CPU memory counters into /proc/meminfo every vm.stat_interval (1 s by default):
# a reading taken sooner after a step may not show it yet, and acting on it would step again (the holder
# overshot by a whole step before it waited). After each step the controller waits this long.
STAT_LAG_S = 1.2
# A step the child has not answered within ASK_BASE_S + ASK_PER_GIB_S per GiB it was asked to take is taken
# as the holder's death (it is killed): generous for pages faulted in under reclaim, bounded for a stuck one.
ASK_BASE_S = 30.0
ASK_PER_GIB_S = 20.0
SLACK = 2 * CHUNK  # the holder steps in chunks: MemAvailable within two of the goal is at it


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
        self._lock = threading.Lock()  # guards the child's pipe and the fields below
        self._proc: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._died = False
        self._quiet_until = 0.0  # monotonic time before which /proc/meminfo may not show the last step
        self._phase: Optional[dict] = None  # what the phase under way has seen: min/max available, time above

    # --- the controller ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "benchmark.support.ram_hold", "--child"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        if not self._readline(ASK_BASE_S).startswith("ready"):
            self._kill()
            raise RuntimeError("ram_hold: the holder did not start")
        self._thread = threading.Thread(target=self._run, name="ram-hold", daemon=True)
        self._thread.start()

    def _readline(self, timeout_s: float) -> str:
        """One reply line from the child, or '' if it ended or said nothing within ``timeout_s``."""
        try:
            ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
            return self._proc.stdout.readline() if ready else ""
        except (OSError, ValueError):
            return ""

    def _ask(self, held: int) -> bool:
        """Have the child hold ``held`` bytes (rounded to CHUNK); False once it is gone. Caller holds the lock."""
        if self._died or self._proc is None:
            return False
        self._quiet_until = float("inf")  # a step in flight: no reading counts as settled until it is answered
        grow_gib = max(0, held - self._held) / (1 << 30)
        try:
            self._proc.stdin.write(f"{held // CHUNK}\n")
            self._proc.stdin.flush()
            reply = self._readline(ASK_BASE_S + ASK_PER_GIB_S * grow_gib)
            got = int(reply.split()[1]) * CHUNK if reply.startswith("held ") else None
        except (OSError, ValueError, IndexError):
            got = None
        if got is None:
            self._died, self._held = True, 0  # what a dead holder held went back to the kernel with it
            self._kill()
            return False
        self._quiet_until = time.monotonic() + (STAT_LAG_S if got != self._held else 0.0)
        self._held = got
        return True

    def _kill(self) -> None:
        try:
            self._proc.kill()
        except (OSError, AttributeError):
            pass

    def _note(self, avail: int) -> None:
        """Count a reading into the phase under way (caller holds the lock): the time since the phase's
        previous reading is charged as above the goal when either reading is, since the memory between them
        moved one way or the other at an unknown moment."""
        ph, now = self._phase, time.monotonic()
        if ph is None:
            return
        above = avail > self.leave + SLACK
        if above or ph["last_above"]:
            ph["above_goal_s"] += now - ph["last_t"]
        ph["last_t"], ph["last_above"] = now, above
        ph["available_min"] = min(ph["available_min"], avail)
        ph["available_max"] = max(ph["available_max"], avail)

    def _run(self) -> None:
        try:
            self._control()
        except Exception:  # a controller that stopped must not leave a holder that no longer gives way
            with self._lock:
                self._died, self._held = True, 0
                self._kill()

    def _control(self) -> None:
        while not self._stop.is_set() and not self._died:
            with self._lock:
                now, goal, avail = time.monotonic(), self._goal, available()
                self._note(avail)
                if now >= self._quiet_until:
                    want = 0 if goal is None else max(0, self._held + avail - goal)
                    far = want - self._held > 2 * GROW_STEP_FAR
                    want = min(want, self._held + (GROW_STEP_FAR if far else GROW_STEP))
                    if abs(want - self._held) >= CHUNK or (want == 0 and self._held):
                        self._ask(want)
            self._stop.wait(TICK_S)

    def loosen(self, extra: int) -> None:
        """Give back room (``leave + extra`` available) before a start; returns once the child has. Only
        gives back: a reading taken within STAT_LAG_S of the controller's last step is waited out first, so
        a step the counters do not show yet cannot shrink the room."""
        with self._lock:
            self._goal = self.leave + int(extra)
            self._phase = None
            wait = self._quiet_until - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        with self._lock:
            want = max(0, self._held + available() - self._goal)
            if want < self._held:
                self._ask(want)

    def tighten(self) -> dict:
        """Hold down to ``leave`` and wait (at most ``wait_s``) until ``MemAvailable`` is within SLACK of it;
        returns how it went. From here until ``phase_stats`` the readings count toward the phase."""
        t0 = time.monotonic()
        with self._lock:
            self._goal = self.leave
        while time.monotonic() - t0 < self.wait_s and not self._died:
            if time.monotonic() >= self._quiet_until and self._near_goal():
                break
            time.sleep(TICK_S)
        with self._lock:  # the phase's record starts here, with no time from before it
            avail = available()
            self._phase = {"available_min": avail, "available_max": avail, "above_goal_s": 0.0,
                           "last_t": time.monotonic(), "last_above": False}
            return {"wait_s": time.monotonic() - t0, "reached": self._near_goal(), "held": self._held,
                    "alive": self.alive()}

    def _near_goal(self) -> bool:
        return available() <= self.leave + SLACK

    def alive(self) -> bool:
        return not self._died and self._proc is not None and self._proc.poll() is None

    def phase_stats(self) -> dict:
        """What the phase ran under: the goal, what was held at its end, the lowest and highest
        ``MemAvailable`` read in it and the seconds it was above the goal (the holder gives way to a
        growing server at once but takes memory back at the kernel's pace), whether the holder lived
        through it, and the host's swap (with swap the cap is weaker)."""
        with self._lock:
            info = meminfo()
            self._note(info["MemAvailable"])  # the reading at its end counts, and the time up to it
            ph = dict(self._phase or {})
            return {"leave": self.leave, "held": self._held if self.alive() else 0,
                    "available_min": ph.get("available_min"), "available_max": ph.get("available_max"),
                    "above_goal_s": ph.get("above_goal_s"), "available": info.get("MemAvailable"),
                    "swap_total": info.get("SwapTotal", 0), "alive": self.alive()}

    def stop(self) -> None:
        """End the child (EOF, then a kill if it does not go) and the controller; never raises."""
        self._stop.set()
        if self._proc is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._kill()
                try:
                    self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        if self._thread is not None:
            self._thread.join(timeout=ASK_BASE_S + 5)
        self._died = True


# --- the child -------------------------------------------------------------------------------------------
def _child() -> None:
    """Hold a list of CHUNK-sized bytearrays (``bytearray(n)`` writes zeros to every byte, so each page is
    resident, not a promise); a number on stdin is the count of chunks to hold, answered with the count
    held. EOF releases everything."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # under pressure the kernel kills the holder first, never a server
    except OSError:
        pass
    chunks: list = []
    print("ready", flush=True)
    for line in sys.stdin:
        want = max(0, int(line))
        while len(chunks) > want:
            chunks.pop()
        while len(chunks) < want:
            chunks.append(bytearray(CHUNK))
        print(f"held {len(chunks)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        _child()
    else:
        sys.exit("ram_hold: run by benchmark.support.ram_hold.RamHold, not by hand")
