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
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=fresh_env(env_extra),
        timeout=timeout, cwd=REPO,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def run_all(jobs: dict, workers: int | None = None, timeout: float = 300) -> dict:
    """Run independent commands at once, as many as this machine has cores: {name: argv} or {name: (argv,
    subprocess.run kwargs)} -> {name: CompletedProcess}. For modules whose tests each start one interpreter
    that only imports sglang and answers (10-15 s of one core each): serially they leave the other
    cores idle."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job):
        argv, kw = job if isinstance(job, tuple) else (job, {})
        kw = {"capture_output": True, "text": True, "cwd": REPO, "timeout": timeout, **kw}
        return subprocess.run(argv, **kw)

    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as ex:
        futs = {name: ex.submit(one, job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futs.items()}
