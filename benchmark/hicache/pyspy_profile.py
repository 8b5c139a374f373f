"""py-spy around one timed section of a running server: where each thread of each process spent it.

Used by ``bench_server_ttft.py --profile`` to see where a restore's time goes behind a real server
(upstream's prefetch threads, the scheduler's polls, our ``batch_get_v1``, the read engine), and usable
on its own:

    python benchmark/hicache/pyspy_profile.py summarize profile.txt [--top 20]

A recording samples every thread of the process and its children (``--subprocesses --threads --idle``),
so a thread that waits shows where it waits, in py-spy's "raw" (collapsed stacks) format: one line per
distinct stack, ``frame;frame;...;leaf COUNT``. The summary names each thread by the first function of
its stack below Python's thread and process bootstrap frames (its role: ``prefetch_io_aux_func``,
``event_loop_overlap``...), and lists per role the samples and where they ended (leaf frames).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time

# Frames that start every thread or process and say nothing about its role.
_BOOTSTRAP = re.compile(r"^(_bootstrap|_bootstrap_inner|run|_run|<module>|_main|main|spawn_main|__call__|"
                        r"run_module|_run_module_as_main|_run_code|_worker|_entry|wrapper|inner)$")
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^:()]*)(?::\d+)?\)$")


def pyspy_binary() -> str:
    """py-spy next to this interpreter, else on PATH; a clear error when neither."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    found = here if os.access(here, os.X_OK) else shutil.which("py-spy")
    if not found:
        raise SystemExit("--profile needs py-spy (a sampling profiler): pip install py-spy")
    return found


class Recorder:
    """``with Recorder(pid, path):`` records the section inside the block (after an attach delay)."""

    def __init__(self, pid: int, path: str, rate: int = 997, attach_s: float = 1.0, stop_s: float = 60.0,
                 idle: bool = True):
        # idle: sample waiting threads too (where each thread waits). py-spy's sampling takes about a core
        # at 1 kHz over a server's ~15 threads: on a host with few cores lower the rate, or it perturbs
        # what it measures (threads shown at a line they are only runnable at).
        self.pid, self.path, self.rate, self.attach_s, self.stop_s = pid, path, rate, attach_s, stop_s
        self.idle = idle
        self.proc = None
        self.log = path + ".log"

    def __enter__(self) -> "Recorder":
        cmd = [pyspy_binary(), "record", "--pid", str(self.pid), "--subprocesses", "--threads",
               *(["--idle"] if self.idle else []),
               "--rate", str(self.rate), "--format", "raw", "--output", self.path, "--nonblocking"]
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        time.sleep(self.attach_s)  # py-spy finds the children and starts sampling
        if self.proc.poll() is not None:
            self._log.close()
            raise RuntimeError(f"py-spy exited at once ({self.proc.returncode}): {open(self.log).read()[-2000:]}")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            self.proc.wait(timeout=self.stop_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def _records(f):
    """(frames, count) per stack. A record ends with " COUNT"; a process's command line may hold newlines."""
    buf = ""
    for line in f:
        buf += line
        m = re.search(r" (\d+)\n?$", buf)
        if m:
            stack = buf[:m.start()].replace("\n", " ")
            head = []
            p = re.match(r'process \d+:".*?";(?=thread \()', stack)  # its command line may hold ';'
            if p:
                head, stack = [p[0][:-1]], stack[p.end():]
            yield head + stack.split(";"), int(m[1])
            buf = ""


def _func(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m['func']} ({os.path.basename(m['file'])})"


def summarize(path: str, top: int = 8) -> dict:
    """{"samples": N, "roles": [{"process", "role", "samples", "share", "leaves": [(func, samples)]}]}"""
    per_role = collections.defaultdict(collections.Counter)
    total = 0
    with open(path) as f:
        for frames, n in _records(f):
            total += n
            process = next((fr for fr in frames if fr.startswith("process ")), "process ?")
            thread = next((fr for fr in frames if fr.startswith("thread ")), "")
            body = [fr for fr in frames if not fr.startswith(("process ", "thread "))]
            role = _thread_name(thread)
            first = next((_func(fr) for fr in body if not _is_bootstrap(fr)), None)
            if first and first.split(" (")[0] not in role:
                role = f"{role}: {first}" if role else first
            role = role or (_func(body[0]) if body else "?")
            leaf = _func(body[-1]) if body else "?"
            per_role[(_short_process(process), role)][leaf] += n
    roles = []
    for (process, role), leaves in per_role.items():
        s = sum(leaves.values())
        roles.append({"process": process, "role": role, "samples": s, "share": s / total if total else 0.0,
                      "leaves": leaves.most_common(top)})
    roles.sort(key=lambda r: -r["samples"])
    return {"samples": total, "roles": roles}


def _is_bootstrap(frame: str) -> bool:
    m = _FRAME.match(frame)
    func = m["func"] if m else frame
    return bool(_BOOTSTRAP.match(func.rsplit(".", 1)[-1]))


def _thread_name(frame: str) -> str:
    """'thread (123): Thread-4 (prefetch_io_aux_func)' -> 'prefetch_io_aux_func'; 'MainThread' stays."""
    name = frame.partition(": ")[2]
    m = re.match(r"Thread-\d+ \((.*)\)$", name)
    return m[1] if m else name


def _short_process(frame: str) -> str:
    """'process 123:"python -m sglang.launch_server ..."' -> 'pid 123 (sglang.launch_server)'; py-spy
    names sglang's children by their process titles (sglang::scheduler...); others by pid alone."""
    m = re.match(r'process (\d+):"(.*)"', frame, re.S)
    if not m:
        return frame
    name = next((w for w in m[2].split() if w.startswith("sglang")), None)
    return f"pid {m[1]} ({name})" if name else f"pid {m[1]}"


def format_summary(s: dict, min_share: float = 0.02) -> str:
    lines = [f"{s['samples']} samples (share of all threads' samples; with idle sampling, waits included)"]
    for r in s["roles"]:
        if r["share"] < min_share:
            continue
        leaves = ", ".join(f"{func} {n}" for func, n in r["leaves"][:4])
        lines.append(f"  {r['share']:6.1%}  {r['process']}  {r['role']}: {leaves}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize", help="per thread role: samples and where they ended")
    s.add_argument("path")
    s.add_argument("--top", type=int, default=8)
    s.add_argument("--min-share", type=float, default=0.02)
    args = p.parse_args()
    print(format_summary(summarize(args.path, args.top), args.min_share))


if __name__ == "__main__":
    main()
