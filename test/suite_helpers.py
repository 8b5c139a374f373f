"""Helpers of the whole suite (uniquely named: tests import it, never ``conftest``, whose name several
directories' conftest.py files share)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh_env(env_extra: dict | None = None) -> dict:
    """This environment for a fresh interpreter of the suite: the plugin enabled and allowed (no
    SGLANG_CP_DISABLE, no SGLANG_PLUGINS allowlist left by the caller), warnings quiet, then ``env_extra``."""
    env = dict(os.environ)
    env.pop("SGLANG_CP_DISABLE", None)
    env.pop("SGLANG_PLUGINS", None)
    env["PYTHONWARNINGS"] = "ignore"
    env.update(env_extra or {})
    return env


def py_job(code: str, env_extra: dict | None = None):
    """``code`` in a fresh interpreter with ``fresh_env``, as a ``run_all`` job."""
    return [sys.executable, "-c", code], {"env": fresh_env(env_extra)}


def run_py(code: str, env_extra: dict | None = None, timeout: float = 300, check: bool = False):
    """Run ``code`` in a fresh interpreter of this venv (real processes, real sglang)."""
    proc = run_job([sys.executable, "-c", code], text=True, env=fresh_env(env_extra), timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


# ---- fresh interpreters without re-importing upstream each time ------------------------------------
# Every job of run_job / run_all / run_py is a real process running the real entry point (`python -m
# sglang.launch_server`, `python -c ...`, a script, a console script such as `sglang-cp` or `sglang`). Most of
# such a process's life on a CPU box is importing upstream (sglang's launcher modules, torch, transformers,
# triton...: ~10 of its ~15 s), the same in every job. So a job is forked from a zygote (scenario_zygote.py)
# that imported those modules once (per pytest worker and environment), and the child then runs the entry
# point as the interpreter would: its own environment, argv, working directory, sys.path[0] and
# stdout/stderr files, SystemExit and tracebacks turned into the exit status as Python does. sglang_cp is
# never imported there and upstream's load_plugins() never ran: each job discovers, registers and configures
# the plugin exactly as a fresh interpreter. test/unit/test_suite_helpers.py runs jobs both ways and compares
# them; test/unit/test_scenario_zygote.py checks the zygote; SGLANG_CP_TEST_FRESH_INTERPRETERS=1 runs every
# job as a new interpreter.

def _entry(argv: list):
    """(kind, target, sys.argv of the job) of a job a zygote can run, or None for a plain subprocess: this
    interpreter with -c CODE, -m MODULE or a script path, or a Python console script of this venv."""
    if argv and argv[0] == sys.executable and len(argv) >= 3 and argv[1] in ("-c", "-m"):
        return ("code", argv[2], ["-c", *argv[3:]]) if argv[1] == "-c" else ("module", argv[2], [argv[2], *argv[3:]])
    if argv and argv[0] == sys.executable and len(argv) >= 2 and not argv[1].startswith("-") \
            and os.path.isfile(argv[1]):
        return ("path", argv[1], list(argv[1:]))
    if argv and os.path.dirname(argv[0]) == os.path.dirname(sys.executable) and os.path.isfile(argv[0]):
        with open(argv[0], "rb") as f:
            first = f.readline()
        if first.startswith(b"#!") and b"python" in first:  # a console script of this venv
            return ("path", argv[0], list(argv))
    return None


def run_job(argv: list, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, **kw)``, forked from a zygote where ``argv`` is this
    interpreter with -c / -m / a script, or a console script of this venv, and nothing else is asked of the
    process (no stdin input, no other streams). A program that sets, before importing upstream, a variable
    upstream reads at import (the zygote stops such a job loudly) says so: ``sets_env={name: value}`` (it
    uses os.environ.setdefault: it then forks from a zygote that imported under those values, and must set
    them), or ``fresh_interpreter=True`` (a new interpreter, always)."""
    entry = _entry(argv)
    sets = kw.pop("sets_env", None)
    if kw.pop("fresh_interpreter", False) or os.environ.get("SGLANG_CP_TEST_FRESH_INTERPRETERS") == "1":
        return _fresh(argv, kw, "asked for")
    plain = set(kw) - {"capture_output", "text", "cwd", "timeout", "env", "check"}
    if entry is None or plain:
        return _fresh(argv, kw, "not a zygote job")
    import scenario_zygote

    env = dict(kw.get("env") or os.environ)
    zygote, why = scenario_zygote.zygote_for(scenario_zygote.importing_env(env, sets))
    if zygote is None:
        return _fresh(argv, kw, why)
    try:
        res = zygote.run(*entry, env, kw.get("cwd") or os.getcwd(), kw.get("timeout"), sets)
    finally:
        scenario_zygote.release(zygote)
    if res[0] == "fresh":
        return _fresh(argv, kw, res[1])
    code, stdout, stderr = res
    if kw.get("text"):
        stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    _log(argv, "forked", "")
    proc = subprocess.CompletedProcess(argv, code, stdout, stderr)  # a signal: -N, as subprocess says
    if kw.get("check") and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
    return proc


def _fresh(argv, kw, why):
    _log(argv, "fresh", why)
    return subprocess.run(argv, capture_output=True, **{k: v for k, v in kw.items() if k != "capture_output"})


def _log(argv, how, why):
    """With SGLANG_CP_TEST_JOB_LOG=<file>: one line per job, how it ran and why (for tuning the suite)."""
    path = os.environ.get("SGLANG_CP_TEST_JOB_LOG")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), "how": how, "why": why,
                                "argv": [str(a)[:80] for a in argv[:4]]}) + "\n")


def run_all(jobs: dict, workers: int | None = None, timeout: float = 300) -> dict:
    """Run independent commands at once, as many as this machine has cores: {name: argv} or {name: (argv,
    subprocess.run kwargs)} -> {name: CompletedProcess}. For modules whose tests each start one interpreter
    that only imports sglang and answers (10-15 s of one core each): serially they leave the other
    cores idle."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job):
        argv, kw = job if isinstance(job, tuple) else (job, {})
        return run_job(argv, **{"text": True, "cwd": REPO, "timeout": timeout, **kw})

    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as ex:
        futs = {name: ex.submit(one, job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futs.items()}


def gil_releases_seen(fn, *args):
    """(fn(*args), how often a second thread ran meanwhile). That thread counts while it holds the GIL,
    and the switch interval is raised so far that within a short call only a release of the GIL lets it
    in: 0 means ``fn`` kept the GIL throughout. Why it matters: beside a server's busy scheduler thread,
    each release costs the releasing thread up to CPython's 5 ms switch interval."""
    import threading
    import time

    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    spinner = threading.Thread(target=spin, name="gil-probe", daemon=True)
    try:
        spinner.start()
        while count[0] == 0:
            time.sleep(0.001)  # the spinner runs; this thread is back once the spinner was made to yield
        before = count[0]
        result = fn(*args)
        ran = count[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(old)
        spinner.join(timeout=10)
    return result, ran


def answer_sse(handler, chunk: dict) -> None:
    """Answer an HTTP request (a ``BaseHTTPRequestHandler``) as a streaming ``/generate`` does: one
    server-sent chunk, then ``[DONE]``. Stand-ins for sglang's server in the benchmark tests use it."""
    import json

    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    handler.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())


def answer_generate(handler, chunk: dict, stream: bool) -> None:
    """Answer ``/generate`` as sglang's server does: streamed (``answer_sse``), or one JSON body (a tier's
    non-streaming warm request)."""
    import json

    if stream:
        answer_sse(handler, chunk)
        return
    data = json.dumps(chunk).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
