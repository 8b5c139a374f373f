"""Helpers of the whole suite (uniquely named: tests import it, never ``conftest``, whose name several
directories' conftest.py files share)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(code: str, env_extra: dict | None = None, timeout: float = 300, check: bool = False):
    """Run ``code`` in a fresh interpreter of this venv (real processes, real sglang)."""
    env = dict(os.environ)
    env.pop("SGLANG_CP_DISABLE", None)
    env.pop("SGLANG_PLUGINS", None)
    env["PYTHONWARNINGS"] = "ignore"
    if env_extra:
        env.update(env_extra)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env,
        timeout=timeout, cwd=REPO,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc
