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


# ---- fresh interpreters without re-importing torch each time ---------------------------------------
# Every job of run_all / run_py is a real process running the real entry point (`python -m
# sglang.launch_server`, `python -c ...`, a console script such as `sglang-cp` or `sglang`). Most of
# such a process's life on a CPU box is importing the third-party stack under sglang (torch,
# transformers, triton...: ~8 of its ~11 s), the same in every job. So jobs are forked from a
# multiprocessing forkserver that imported those modules once (per pytest worker), and each child
# then runs the entry point as the interpreter would: its own environment, argv, working directory and
# stdout/stderr files, SystemExit and tracebacks turned into the exit status as Python does. sglang and
# sglang_cp are never preloaded: the plugin is discovered, registered and configured in each job exactly
# as in a fresh interpreter. The one difference a job could see: the PRELOAD modules are already in
# sys.modules (no test asks). test/unit/test_suite_helpers.py runs jobs both ways and compares them;
# SGLANG_CP_TEST_FRESH_INTERPRETERS=1 runs every job as a new interpreter.
PRELOAD = ("torch", "torch.distributed.tensor", "torch._dynamo", "transformers", "transformers.activations",
           "triton", "numpy", "aiohttp", "requests", "httpx", "IPython")
_ctx = None


def _forkserver():
    global _ctx
    if _ctx is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _ctx = ctx
    return _ctx


def _entry(argv: list):
    """(kind, target, argv for sys.argv) of a job the forkserver can run, or None for a plain subprocess."""
    if argv and argv[0] == sys.executable and len(argv) >= 3 and argv[1] in ("-c", "-m"):
        return ("code", argv[2], ["-c", *argv[3:]]) if argv[1] == "-c" else ("module", argv[2], [argv[2], *argv[3:]])
    if argv and os.path.dirname(argv[0]) == os.path.dirname(sys.executable) and os.path.isfile(argv[0]):
        with open(argv[0], "rb") as f:
            first = f.readline()
        if first.startswith(b"#!") and b"python" in first:  # a console script of this venv
            return ("path", argv[0], list(argv))
    return None


_base_path = None


def _fresh_sys_path() -> list:
    """sys.path of a new interpreter of this venv, without its first entry and without PYTHONPATH."""
    global _base_path
    if _base_path is None:
        import json

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                             capture_output=True, text=True, env=env, check=True, timeout=60).stdout
        _base_path = json.loads(out)[1:]
    return list(_base_path)


def _child(kind: str, target: str, argv: list, env: dict, cwd: str, out: str, err: str, base: list) -> None:
    """In the forked process: become the interpreter that `argv` would have started, then exit."""
    import atexit
    import runpy
    import threading
    import traceback
    import warnings

    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    warnings.resetwarnings()
    for opt in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(opt)  # what the interpreter does with PYTHONWARNINGS at startup
    first = {"code": "", "module": os.getcwd(), "path": os.path.dirname(os.path.abspath(target))}[kind]
    pythonpath = [os.path.abspath(x) for x in env.get("PYTHONPATH", "").split(os.pathsep) if x]
    sys.path[:] = [first] + pythonpath + base
    sys.argv = list(argv)
    code = 0
    sys.modules.pop("sitecustomize", None)  # site's startup step: the job's own sitecustomize, if its path has one
    try:
        import sitecustomize  # noqa: F401
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:  # as the interpreter: None -> 0, an int -> itself, anything else printed -> 1
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the interpreter's report of an uncaught exception (a hook may own it)
        code = 1
    try:  # as the interpreter's finalization: wait for non-daemon threads, then run atexit handlers
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code & 0xFF)


def _run_forked(argv: list, entry: tuple, kw: dict) -> subprocess.CompletedProcess:
    import tempfile

    env = dict(kw.get("env") or os.environ)
    with tempfile.TemporaryDirectory(prefix="sglang-cp-job-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        p = _forkserver().Process(target=_child, args=(*entry, env, kw.get("cwd") or os.getcwd(), out, err,
                                                       _fresh_sys_path()))
        p.start()
        p.join(kw.get("timeout"))
        if p.exitcode is None:
            p.kill()
            p.join(10)
            raise subprocess.TimeoutExpired(argv, kw.get("timeout"))
        with open(out, "rb") as f:
            stdout = f.read()
        with open(err, "rb") as f:
            stderr = f.read()
    if kw.get("text"):
        stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    return subprocess.CompletedProcess(argv, p.exitcode, stdout, stderr)  # a signal: -N, as subprocess says


def run_job(argv: list, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, **kw)``, forked from the preloaded forkserver where
    ``argv`` is this interpreter with -c / -m or a console script of this venv and nothing else is asked
    of the process (no stdin input)."""
    entry = _entry(argv)
    plain = set(kw) - {"capture_output", "text", "cwd", "timeout", "env", "check"}
    if entry is None or plain or os.environ.get("SGLANG_CP_TEST_FRESH_INTERPRETERS") == "1":
        return subprocess.run(argv, capture_output=True, **{k: v for k, v in kw.items() if k != "capture_output"})
    proc = _run_forked(argv, entry, kw)
    if kw.get("check") and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
    return proc


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
