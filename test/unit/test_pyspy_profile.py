"""benchmark/hicache/pyspy_profile.py (bench_server_ttft --profile) against a real process: py-spy
attaches to a running interpreter, records every thread (waits included) for the section inside the
``with``, and the summary names each thread by its role and says where its samples ended."""

import os
import subprocess
import sys
import textwrap
import time

from benchmark.hicache import pyspy_profile as pp

CHILD = textwrap.dedent("""
    import sys, threading, time; stop = threading.Event()  # ';' and newlines in the command line py-spy quotes
    def spin_in_python():
        while not stop.is_set():
            sum(range(1000))
    def wait_for_stop():
        stop.wait(120)
    for f in (spin_in_python, wait_for_stop):
        threading.Thread(target=f).start()
    print("ready", flush=True)
    sys.stdin.readline()
    stop.set()
""")


def test_a_recording_names_each_thread_and_where_it_spent_the_section(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        path = str(tmp_path / "p.txt")
        with pp.Recorder(child.pid, path, rate=200, attach_s=1.0):
            time.sleep(1.0)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=60)
    s = pp.summarize(path)
    roles = {r["role"]: r for r in s["roles"]}
    assert {"spin_in_python", "wait_for_stop", "MainThread"} <= {r.split(":")[0] for r in roles}, roles.keys()
    spin = next(r for k, r in roles.items() if k.startswith("spin_in_python"))
    wait = next(r for k, r in roles.items() if k.startswith("wait_for_stop"))
    # the spinning thread's samples end in its own function (or what it calls), the waiter's in a wait
    assert any("spin_in_python" in f for f, _ in spin["leaves"]), spin
    assert wait["leaves"][0][0].startswith("Condition.wait"), wait
    assert s["samples"] == sum(r["samples"] for r in s["roles"]) and 100 < spin["samples"] < 2000, s
    assert "spin_in_python" in pp.format_summary(s)
    assert {r["process"] for r in s["roles"]} == {f"pid {child.pid}"}, s["roles"]


PHASES = textwrap.dedent("""
    import sys, threading, time
    go = threading.Event()
    def spin(s):
        t = time.monotonic()
        while time.monotonic() - t < s:
            sum(range(1000))
    def phase_one():
        spin(0.3)
    def phase_two():
        spin(0.3)
    def worker():
        go.wait(120)
        phase_one()
        phase_two()
    threading.Thread(target=worker).start()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    sys.stdin.readline()
""")


def test_a_chrometrace_gives_when_each_thread_was_inside_each_function(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", PHASES], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        path = str(tmp_path / "p.json")
        with pp.Recorder(child.pid, path, rate=200, attach_s=1.0, fmt="chrometrace"):
            child.stdin.write("\n")
            child.stdin.flush()
            time.sleep(1.5)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=60)
    t = pp.timeline(path, r"^phase_(one|two)$", r"^phase_one$")
    rows = {r["func"]: r for r in t["rows"]}
    one, two = rows["phase_one"], rows["phase_two"]
    # anchored at phase_one's entry; phase_two follows it in the same thread, each entered once
    assert one["start_ms"] == 0 and one["spans"] == 1 and two["spans"] == 1, rows
    assert one["end_ms"] <= two["start_ms"] < two["end_ms"], rows
    assert one["role"] == two["role"] and one["role"].startswith("worker"), rows
    assert {r["process"] for r in t["rows"]} == {f"pid {child.pid}"}, t["rows"]
    assert "phase_two" in pp.format_timeline(t)
    # the same recording summarizes per role, weighted by time
    s = pp.summarize(path)
    assert s["unit"] == "us" and any(r["role"].startswith("worker") for r in s["roles"]), s
    try:
        pp.timeline(path, "phase", r"^no_such_function$")
    except ValueError as e:
        assert "no_such_function" in str(e)
    else:
        raise AssertionError("an anchor that matches nothing must be refused")


def test_descendant_named_finds_a_grandchild_by_its_command_line():
    # a parent whose child starts the marked grandchild (as launch_server's process starts the scheduler)
    inner = "import time; time.sleep(60)"
    middle = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {inner!r}, 'marked-grandchild']); "
              "time.sleep(60)")
    top = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                            f"{middle!r}]).wait()"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        found = None
        while found is None and time.monotonic() < deadline:
            found = pp.descendant_named(top.pid, "marked-grandchild")
            time.sleep(0.1)
        assert found is not None and found != top.pid
        with open(f"/proc/{found}/cmdline", "rb") as f:
            assert b"marked-grandchild" in f.read()
        assert pp.descendant_named(top.pid, "no-such-marker-anywhere") is None
    finally:
        import signal

        os.killpg(top.pid, signal.SIGKILL)  # the whole session: parent, child and grandchild
        top.wait(timeout=30)
