"""One real ``python -m sglang.launch_server`` child, driven the way a user drives it.

The GPU tests (``test/gpu/test_server_*.py``) and the TTFT benchmark
(``benchmark/hicache/bench_server_ttft.py``) start servers through this module so that
every wait has a bound and nothing outlives its owner:

- the server runs in its own process group (``start_new_session``), so a stop reaches the
  scheduler and detokenizer children too, and a SIGKILL of the group is a real crash;
- startup waits for ``/health`` or for the process to exit, at most ``startup_timeout_s``;
- every HTTP call has a timeout; ``stop()`` escalates SIGTERM -> SIGKILL within a bound.

Requests send ``input_ids`` (``--skip-tokenizer-init``: the dummy-weight models ship no
tokenizer). Imports no sglang: it talks to the server over HTTP only.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Optional

# What a dummy-weight server needs on any CUDA box with sglang installed normally: no
# tokenizer, no CUDA graphs (capture costs minutes per start and changes nothing we test),
# the portable triton attention backend, page size 64 (the L3 page unit of the seeds).
BASE_ARGS = (
    "--load-format", "dummy", "--skip-tokenizer-init", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--page-size", "64", "--enable-metrics", "--random-seed", "0",
    "--trust-remote-code",
)
ATTENTION_BACKEND_ENV = "SGLANG_CP_TEST_ATTENTION_BACKEND"


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; carries the log's first error and its tail."""


# Lines upstream logs on every healthy start that look like errors (optional imports it skips).
_BENIGN = ("Ignore import error when loading", "disabled: OpenAIServingResponses init failed",
           "UserWarning", "warnings.warn")
_ERROR_MARKS = ("Traceback (most recent call last)", "Error:", "Error(", "ERROR", "Exception:", ": error: ",
                "CUDA error", "out of memory", "Killed")


def first_error(log: str, context: int = 30) -> str:
    """The first error in a server log and the lines after it (a traceback), or ''. A start that
    fails in one of several processes often ends with the launcher's own shutdown noise: the cause
    is the first error, not the last lines."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if any(b in line for b in _BENIGN):
            continue
        if any(m in line for m in _ERROR_MARKS):
            return "\n".join(lines[i:i + context])
    return ""


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL the launcher when the process that started it
    dies (a test runner killed by its own timeout must not leave a server holding a GPU;
    upstream's scheduler processes already die with the launcher)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: stop()/kill() still bound every wait


def proc_stats():
    """(pid, fields) of every process in /proc, ``fields`` being /proc/PID/stat after the command name
    (``fields[0]`` state, ``[1]`` ppid, ``[2]`` pgid); processes gone meanwhile are skipped."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                yield int(name), f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue


def proc_cmdline(pid: int) -> str:
    """The command line (or process title) of ``pid``, arguments joined by spaces; OSError if gone."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()


def group_alive(pgid: int) -> bool:
    """Any process of the group that is not a zombie (a zombie counts for killpg(pgid, 0)
    until its new parent reaps it, which can take long on some init processes)."""
    return any(int(fields[2]) == pgid and fields[0] != "Z" for _pid, fields in proc_stats())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GenResult:
    output_ids: list
    meta_info: dict
    latency_s: float
    ttft_s: Optional[float] = None  # streaming requests only
    sent_at: Optional[float] = None  # wall clock (time.time()) when the request was sent: upstream's
    # per-request time stats (meta_info's forward_entry_time, prefill_finished_time) are wall clock too

    @property
    def cached_details(self) -> dict:
        return self.meta_info.get("cached_tokens_details") or {}

    @property
    def storage_tokens(self) -> int:
        return int(self.cached_details.get("storage") or 0)

    @property
    def host_tokens(self) -> int:
        return int(self.cached_details.get("host") or 0)

    @property
    def device_tokens(self) -> int:
        return int(self.cached_details.get("device") or 0)


@dataclass
class ServerProcess:
    model_path: str
    extra_args: list = field(default_factory=list)
    log_path: str = "server.log"
    env: Optional[dict] = None
    startup_timeout_s: float = 600.0
    port: int = 0
    context_length: int = 16384
    max_total_tokens: int = 65536
    mem_fraction_static: float = 0.5
    attention_backend: Optional[str] = None  # default: $SGLANG_CP_TEST_ATTENTION_BACKEND or triton

    def __post_init__(self):
        self.port = self.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    # ---- lifecycle -------------------------------------------------------------------
    def command(self) -> list:
        backend = self.attention_backend or os.environ.get(ATTENTION_BACKEND_ENV, "triton")
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
                *BASE_ARGS, "--attention-backend", backend, "--port", str(self.port),
                "--context-length", str(self.context_length),
                "--max-total-tokens", str(self.max_total_tokens),
                "--mem-fraction-static", str(self.mem_fraction_static), *map(str, self.extra_args)]

    def spawn(self) -> "ServerProcess":
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.log_path, "ab")
        self._log.write(("\n$ " + " ".join(self.command()) + "\n").encode())
        self._log.flush()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        return self

    def start(self) -> "ServerProcess":
        self.spawn()
        deadline = self.t0 + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._wait_group_gone(30)
                self._log.close()
                raise ServerStartError(f"server exited with {self.proc.returncode} after "
                                       f"{time.monotonic() - self.t0:.0f} s:\n{self.failure_report()}")
            try:
                if self._get("/health", timeout=2).status == 200:
                    self.startup_s = time.monotonic() - self.t0
                    return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.kill()
        raise ServerStartError(f"server not healthy within {self.startup_timeout_s:.0f} s:\n{self.failure_report()}")

    def wait_exit(self, timeout_s: float) -> Optional[int]:
        """Exit code of a server expected to stop by itself (a startup error), or None."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group: SIGKILL here is a crash of every server process."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            self._wait_group_gone(30)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (upstream's launcher then tears its children down in about 6 s), SIGKILL
        of the whole group after ``timeout_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # children left behind by a graceful exit, if any
        if not self._log.closed:
            self._log.close()

    def _wait_group_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and group_alive(self.proc.pid):
            time.sleep(0.2)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def failure_report(self, tail: int = 40) -> str:
        text = self.log_text()
        first = first_error(text)
        head = f"first error in {self.log_path}:\n{first}\n" if first else f"no error line in {self.log_path}\n"
        return head + f"--- last {tail} lines:\n" + "\n".join(text.splitlines()[-tail:])

    # ---- HTTP ------------------------------------------------------------------------
    def _get(self, path: str, timeout: float):
        return urllib.request.urlopen(self.url + path, timeout=timeout)

    def _post(self, path: str, body: Optional[dict], timeout: float) -> tuple[int, bytes]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def generate(self, input_ids: list, max_new_tokens: int = 8, timeout_s: float = 600.0,
                 extra: Optional[dict] = None) -> GenResult:
        """Greedy ``/generate``; ``extra`` adds request fields (e.g. PD bootstrap fields)."""
        body = {"input_ids": list(input_ids),
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **(extra or {})}
        sent_at, t = time.time(), time.perf_counter()
        status, raw = self._post("/generate", body, timeout_s)
        dt = time.perf_counter() - t
        if status != 200:
            raise RuntimeError(f"/generate -> HTTP {status}: {raw[:2000]!r}")
        j = json.loads(raw)
        return GenResult(output_ids=j.get("output_ids"), meta_info=j.get("meta_info", {}), latency_s=dt,
                         sent_at=sent_at)

    def generate_stream(self, input_ids: list, max_new_tokens: int = 8, timeout_s: float = 600.0) -> GenResult:
        """Greedy streaming ``/generate``: the result's ``ttft_s`` is the time to the first chunk. A stream
        that ends before upstream's closing ``[DONE]`` raises ConnectionError: a server killed mid-answer
        closes the connection, and urllib then reports a clean end (chunked or not), which would otherwise
        pass the first tokens off as the whole answer."""
        body = {"input_ids": list(input_ids), "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        ttft, last, done, chunks = None, None, False, 0
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t
                last = json.loads(data)
                if "error" in last:
                    raise RuntimeError(f"/generate stream error: {last['error']}")
        if last is None:
            raise RuntimeError("/generate stream ended without a chunk")
        if not done:
            raise ConnectionError(f"/generate stream from {self.url} ended after {chunks} chunk(s) without its "
                                  "[DONE]: the server closed the connection mid-answer")
        res = GenResult(output_ids=last.get("output_ids"), meta_info=last.get("meta_info", {}),
                        latency_s=time.perf_counter() - t)
        res.ttft_s = ttft
        return res

    def flush_cache(self, timeout_s: float = 120.0) -> None:
        status, raw = self._post("/flush_cache", None, timeout_s)
        if status != 200:
            raise RuntimeError(f"/flush_cache -> HTTP {status}: {raw[:500]!r}")

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        with self._get("/metrics", timeout=timeout_s) as r:
            return r.read().decode()

    def metrics(self, timeout_s: float = 10.0) -> dict:
        """``/metrics`` as {name: summed value over all label sets} (counters and gauges)."""
        return parse_metrics(self.metrics_text(timeout_s))

    def metric_by_label(self, name: str, label: str) -> dict:
        """{label value: summed value} of one metric, e.g. per ``cp_rank``."""
        return parse_metrics(self.metrics_text(), by_label=label).get(name, {})

    def wait_metric(self, name: str, ok: Callable[[float], bool], timeout_s: float = 60.0) -> float:
        """Poll until ``ok(value)``; our counters are published by a 1 s thread, so a read
        right after an event can lag. Returns the last value (the caller asserts)."""
        deadline = time.monotonic() + timeout_s
        v = self.metrics().get(name, 0.0)
        while not ok(v) and time.monotonic() < deadline:
            time.sleep(0.25)
            v = self.metrics().get(name, 0.0)
        return v


def parse_metrics(text: str, by_label: Optional[str] = None) -> dict:
    """Prometheus text -> {name: sum over label sets}, or with ``by_label`` ->
    {name: {that label's value: sum}} (series without the label are left out)."""
    out: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        try:
            v = float(value)
        except ValueError:
            continue
        if by_label is None:
            out[name] = out.get(name, 0.0) + v
            continue
        for part in labels.rstrip("}").split(","):
            k, _, lv = part.partition("=")
            if k.strip() == by_label:
                d = out.setdefault(name, {})
                d[lv.strip('"')] = d.get(lv.strip('"'), 0.0) + v
    return out
