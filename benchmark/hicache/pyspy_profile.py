"""py-spy around one timed section of a running server: where each thread of each process spent it.

Used by ``bench_server_ttft.py --profile`` to see where a restore's time goes behind a real server
(upstream's prefetch threads, the scheduler's polls, our ``batch_get_v1``, the read engine), and usable
on its own:

    python -m benchmark.hicache.pyspy_profile summarize profile.txt [--top 20]

A recording samples every thread of the process and its children (``--subprocesses --threads --idle``),
so a thread that waits shows where it waits, in py-spy's "raw" (collapsed stacks) format: one line per
distinct stack, ``frame;frame;...;leaf COUNT``. The summary names each thread by the first function of
its stack below Python's thread and process bootstrap frames (its role: ``prefetch_io_aux_func``,
``event_loop_overlap``...), and lists per role the samples and where they ended (leaf frames).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

if not __package__:  # run as a file: the repository root is not on sys.path, so benchmark.* is not importable
    sys.exit("pyspy_profile: run it from the repository root as a module: python -m benchmark.hicache.pyspy_profile")

# Frames that start every thread or process and say nothing about its role.
_BOOTSTRAP = re.compile(r"^(_bootstrap|_bootstrap_inner|run|_run|<module>|_main|main|spawn_main|__call__|"
                        r"run_module|_run_module_as_main|_run_code|_worker|_entry|wrapper|inner)$")
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^:()]*)(?::\d+)?\)$")


# A restore behind a real server (sglang 0.5.23 names): the scheduler's receipt and admission of the
# request, the storage threads' hit query, agreement and transfer, our backend, the load-back and forward.
# The anchor is the earliest sampled of the request's first steps (a step shorter than the sampling period
# can go unsampled; the next one is then at most its duration late).
RESTORE_ANCHOR = r"(handle_generate_request|_prefetch_kvcache|prefetch_from_storage|_storage_hit_query)$"
RESTORE_FUNCS = (r"^(\w+\.)?(handle_generate_request|_prefetch_kvcache|prefetch_from_storage|"
                 r"drain_storage_control_queues|check_prefetch_progress|get_new_batch_prefill|init_load_back|"
                 r"run_batch|process_batch_result|_storage_hit_query|_sync_prefetch_hit_query|_page_transfer|"
                 r"_reduce_prefetch_ack|batch_exists\w*|batch_get\w*|read_pages|load_to_device_per_layer|"
                 r"stream_output\w*|send_to_detokenizer|_all_reduce)$|^ModelRunner\.forward$")


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
                 idle: bool = True, fmt: str = "raw", subprocesses: bool = True):
        # idle: sample waiting threads too (where each thread waits). py-spy's sampling takes about a core
        # at 1 kHz over a server's ~15 threads: on a host with few cores lower the rate, or it perturbs
        # what it measures (threads shown at a line they are only runnable at).
        self.pid, self.path, self.rate, self.attach_s, self.stop_s = pid, path, rate, attach_s, stop_s
        # fmt "chrometrace": every stack change with its time, for timeline() (when each thread entered
        # and left each function); "raw": collapsed stacks and counts. summarize() reads both.
        # subprocesses=False: this process only. py-spy visits every thread of every process in turn, so
        # the fewer it follows the finer its clock (a whole server's ~45 threads: one sample per 3-20 ms)
        self.idle, self.fmt, self.subprocesses = idle, fmt, subprocesses
        self.proc = None
        self.log = path + ".log"

    def __enter__(self) -> "Recorder":
        cmd = [pyspy_binary(), "record", "--pid", str(self.pid), *(["--subprocesses"] if self.subprocesses else []),
               "--threads",
               *(["--idle"] if self.idle else []),
               "--rate", str(self.rate), "--format", self.fmt, "--output", self.path, "--nonblocking"]
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


def descendant_named(pid: int, marker: str) -> int | None:
    """The first process below ``pid`` whose command line (or process title) holds ``marker``, e.g. a
    server's ``sglang::scheduler``; None if there is none. Reads /proc only."""
    from benchmark.support.server_process import proc_cmdline, proc_stats

    children = collections.defaultdict(list)
    for p, fields in proc_stats():
        children[int(fields[1])].append(p)
    todo = list(children.get(pid, []))
    while todo:
        c = todo.pop(0)
        try:
            if marker in proc_cmdline(c):
                return c
        except OSError:
            continue
        todo += children.get(c, [])
    return None


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


def _chrome_events(path: str):
    """py-spy's chrometrace: per thread, "B"/"E" events of each frame in time order (ts in microseconds)."""
    with open(path) as f:
        events = json.load(f)
    per_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") in ("B", "E"):
            per_thread[(e["pid"], e["tid"])].append(e)
    return per_thread


def _chrome_frame(e: dict) -> str:
    """A chrometrace event's frame in raw's spelling: 'func (file:line)'; process and thread frames as named."""
    name = e["name"]
    if name.startswith(("process ", "thread ")):
        return name
    a = e.get("args") or {}
    return f"{name} ({a.get('filename', '')}:{a.get('line', 0)})"


def _chrome_records(path: str):
    """(frames, microseconds) per stack: the time each thread's stack stayed as it was."""
    for evs in _chrome_events(path).values():
        stack, last = [], None
        for e in evs:
            if stack and last is not None and e["ts"] > last:
                yield list(stack), e["ts"] - last
            last = e["ts"]
            if e["ph"] == "B":
                stack.append(_chrome_frame(e))
            elif stack:
                stack.pop()


def summarize(path: str, top: int = 8) -> dict:
    """{"samples": N, "unit", "roles": [{"process", "role", "samples", "share", "leaves": [(func, samples)]}]}
    From a chrometrace (``.json``) the "samples" are microseconds of the thread's time in that stack."""
    per_role = collections.defaultdict(collections.Counter)
    total = 0
    chrome = path.endswith(".json")
    with contextlib.ExitStack() as stack:
        records = _chrome_records(path) if chrome else _records(stack.enter_context(open(path)))
        for frames, n in records:
            total += n
            # a child's stacks begin with its parents' process frames: the last one is its own
            process = next((fr for fr in reversed(frames) if fr.startswith("process ")), "process ?")
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
    return {"samples": total, "unit": "us" if chrome else "samples", "roles": roles}


def timeline(path: str, funcs: str, anchor: str, window_ms: float | None = None) -> dict:
    """When each thread entered and left the functions matching ``funcs`` (a regex on the function name),
    in ms after the first entry into a function matching ``anchor`` (e.g. the scheduler's receipt of the
    request), up to ``window_ms`` after it. Spans come from consecutive samples: a call shorter than the
    sampling period may be missed, and a span's ends are known to a period.

    {"anchor_ms": t0 from the recording's start, "rows": [{"process", "role", "func", "start_ms",
    "end_ms", "inside_ms", "spans"}] sorted by start}"""
    want, anc = re.compile(funcs), re.compile(anchor)
    per_thread = _chrome_events(path)
    t0 = None
    for evs in per_thread.values():
        for e in evs:
            if e["ph"] == "B" and anc.search(e["name"]) and (t0 is None or e["ts"] < t0):
                t0 = e["ts"]
                break
    if t0 is None:
        raise ValueError(f"timeline: no frame matches the anchor {anchor!r} in {path}")
    end = None if window_ms is None else t0 + window_ms * 1000
    rows = []
    for (pid, tid), evs in per_thread.items():
        stack, opened, role = [], [], None
        spans = collections.defaultdict(list)
        for e in evs:
            ts = e["ts"]
            if e["ph"] == "B":
                stack.append(e)
                opened.append(ts)
                if role is None and not e["name"].startswith(("process ", "thread ")) and \
                        not _BOOTSTRAP.match(e["name"].rsplit(".", 1)[-1]):
                    thread = next((x["name"] for x in stack if x["name"].startswith("thread ")), "")
                    role = _thread_name(thread) or e["name"]
                    if e["name"].rsplit(".", 1)[-1] not in role:
                        role = f"{role}: {e['name']}"
            elif stack:
                b, start = stack.pop(), opened.pop()
                if want.search(b["name"]) and ts >= t0 and (end is None or start <= end):
                    spans[b["name"]].append((max(start, t0), ts if end is None else min(ts, end)))
        # py-spy prefixes a child's stacks with its parents' process frames: the thread's own names its pid
        process = next((x["name"] for x in evs if x["name"].startswith(f"process {pid}:")), f"process {pid}")
        for func, ss in spans.items():
            # nested calls of the same function (recursion) are counted once: merge overlapping spans
            ss.sort()
            merged = [list(ss[0])]
            for a, b in ss[1:]:
                if a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            rows.append({"process": _short_process(process), "role": role or "?", "func": func,
                         "start_ms": (merged[0][0] - t0) / 1000, "end_ms": (merged[-1][1] - t0) / 1000,
                         "inside_ms": sum(b - a for a, b in merged) / 1000, "spans": len(merged)})
    rows.sort(key=lambda r: r["start_ms"])
    return {"anchor_ms": t0 / 1000, "rows": rows}


def format_timeline(t: dict, min_ms: float = 0.5) -> str:
    lines = ["  start ms    end ms  inside ms  spans  thread: function"]
    for r in t["rows"]:
        if r["inside_ms"] >= min_ms:
            lines.append(f"  {r['start_ms']:8.1f}  {r['end_ms']:8.1f}  {r['inside_ms']:9.1f}  {r['spans']:5d}  "
                         f"{r['process']} {r['role']}: {r['func']}")
    return "\n".join(lines)


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
    unit = "us of thread time" if s.get("unit") == "us" else "samples"
    lines = [f"{s['samples']} {unit} (share of all threads'; with idle sampling, waits included)"]
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
    t = sub.add_parser("timeline", help="from a chrometrace: when each thread was inside which function")
    t.add_argument("path")
    t.add_argument("--funcs", default=RESTORE_FUNCS)
    t.add_argument("--anchor", default=RESTORE_ANCHOR)
    t.add_argument("--window-ms", type=float, default=None)
    t.add_argument("--min-ms", type=float, default=0.5)
    args = p.parse_args()
    if args.cmd == "timeline":
        print(format_timeline(timeline(args.path, args.funcs, args.anchor, args.window_ms), args.min_ms))
    else:
        print(format_summary(summarize(args.path, args.top), args.min_share))


if __name__ == "__main__":
    main()
