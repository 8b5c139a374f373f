"""benchmark/support/ram_hold.py on this host's real memory: the holder takes what leaves its goal
available and gives it back, is the OOM killer's first pick, ends with its owner, gives way to a growing
process, reads as dead once killed, and bounds what the page cache keeps of a file read through it. The
figures are slow-marked (serial); CI's suite runs a killed holder and the holder through a whole
bench_peers run (test_bench_peers)."""

import os
import time

import pytest

from benchmark.support import page_cache
from benchmark.support import ram_hold

GiB = 1 << 30


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# Slow-marked: the holder follows the whole host's memory, so its exact figures hold only where no other
# test runs beside it (`make test-slow` runs serially; CI's suite runs on parallel workers).
@pytest.mark.slow
def test_the_holder_keeps_its_goal_available_and_gives_the_room_back():
    avail = ram_hold.available()
    if avail < 3 * GiB:
        pytest.skip(f"{avail / GiB:.1f} GiB available: too little to hold 1 GiB safely")
    hold = ram_hold.RamHold(avail - GiB)
    with pytest.raises(ValueError, match="leave must be > 0"):
        ram_hold.RamHold(0)
    hold.start()
    try:
        pid = hold._proc.pid
        with open(f"/proc/{pid}/oom_score_adj") as f:
            assert f.read().strip() == "1000"  # under pressure the kernel kills the holder, not a server
        got = hold.tighten()
        assert got["reached"] and got["alive"]
        assert abs(got["held"] - GiB) <= 3 * ram_hold.CHUNK  # what leaves the goal available, give or take
        stats = hold.phase_stats()
        assert stats["leave"] == avail - GiB and stats["available_min"] <= avail - GiB + 2 * ram_hold.CHUNK
        hold.loosen(2 * GiB)  # room for a start: more than it holds, so it holds nothing
        assert hold.phase_stats()["held"] == 0
    finally:
        hold.stop()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid) and not hold.alive()  # its owner's stop ends it


@pytest.mark.slow
def test_the_holder_gives_way_when_a_process_grows():
    """What a server allocates in a phase comes out of the holder, not out of the goal: the holder shrinks
    (a step per TICK_S, after the kernel's counters show the last one) until the host's available memory
    is back at its goal, and the phase's record shows the dip it gave way to."""
    avail = ram_hold.available()
    if avail < 4 * GiB:
        pytest.skip(f"{avail / GiB:.1f} GiB available: too little to hold 2 GiB safely")
    hold = ram_hold.RamHold(avail - 2 * GiB)
    hold.start()
    try:
        before = hold.tighten()["held"]
        assert before > GiB
        size = before + GiB // 2  # more than the holder holds: the goal cannot stay met without it giving way
        grown = bytearray(size)
        grown[::4096] = b"\x01" * (size // 4096)  # a process's new resident memory
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(ram_hold.STAT_LAG_S)
            if hold.phase_stats()["held"] == 0:
                break
        stats = hold.phase_stats()
        assert stats["held"] == 0  # it gave everything back to the growing process
        assert stats["alive"] and stats["available_min"] < hold.leave  # and the dip is on the phase's record
        del grown
    finally:
        hold.stop()


@pytest.mark.slow
def test_a_file_read_through_the_page_cache_keeps_no_more_than_the_goal(tmp_path):
    """RED and GREEN in one: a 3 GiB file written and read back through the page cache stays resident
    without the holder (which is what a buffered tier serves from DRAM), and keeps at most the goal (1 GiB,
    plus slack for the holder's step) with it."""
    size = 3 * GiB
    avail = ram_hold.available()
    if avail < size + 4 * GiB:
        pytest.skip(f"{avail / GiB:.1f} GiB available: too little for this check")
    block = os.urandom(1 << 20) * 64

    def write_and_read(path):
        with open(path, "wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
        return page_cache.file_resident_bytes(path)

    free_run = write_and_read(tmp_path / "a")
    os.unlink(tmp_path / "a")
    assert free_run >= size * 0.9  # without the holder, the host's RAM keeps the whole file
    hold = ram_hold.RamHold(GiB)
    hold.start()
    try:
        assert hold.tighten()["reached"]
        held_run = write_and_read(tmp_path / "b")
        assert hold.phase_stats()["alive"]
    finally:
        hold.stop()
    assert held_run <= 1.5 * GiB, f"{held_run / GiB:.2f} GiB resident under a 1 GiB goal"


def test_a_holder_killed_under_it_reads_as_dead_and_holding_nothing():
    """The OOM killer's pick, as the harness sees it: once the child is gone the holder is not alive, holds
    nothing, its next step fails without blocking, and the phase's record names the death."""
    import signal

    from benchmark.hicache import peer_report

    avail = ram_hold.available()
    if avail < 2 * GiB:
        pytest.skip(f"{avail / GiB:.1f} GiB available: too little to hold 512 MiB safely")
    hold = ram_hold.RamHold(avail - GiB // 2, wait_s=20)
    hold.start()
    try:
        hold.tighten()
        os.kill(hold._proc.pid, signal.SIGKILL)
        hold._proc.wait(timeout=10)
        t0 = time.monotonic()
        hold.loosen(GiB)  # a start after the death: returns at once
        assert time.monotonic() - t0 < ram_hold.STAT_LAG_S + 5
        stats = hold.phase_stats()
        assert not hold.alive() and stats["held"] == 0 and not stats["alive"]
        assert peer_report.ram_hold_problems({**stats, "reached": True})[0].startswith("the RAM holder died")
    finally:
        hold.stop()
