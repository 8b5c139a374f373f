"""The suite's job runner (``suite_helpers.run_job``): a job forked from the preloaded forkserver must
behave as the fresh interpreter ``subprocess.run`` would start, exit status, streams, argv, environment,
working directory, sys.path and finalization included. Each case runs both ways and compares."""

import os
import sys

import pytest

import suite_helpers
from suite_helpers import run_job

CODE = r"""
import atexit, json, os, sys, threading, time, warnings
atexit.register(lambda: print("atexit ran"))
def late():
    time.sleep(0.2)
    print("thread finished")
threading.Thread(target=late).start()  # non-daemon: the interpreter waits for it at exit
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": os.environ.get("JOB_VAR"),
                  "ours_loaded": [m for m in ("sglang", "sglang_cp") if m in sys.modules], "warn": [f[0] for f in warnings.filters[:1]],
                  "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def both(argv, **kw):
    forked = run_job(argv, text=True, timeout=120, **kw)
    fresh = run_job(argv, text=True, timeout=120, input="", **kw)  # input= forces a plain subprocess
    return forked, fresh


@pytest.mark.parametrize("status", [0, 3])
def test_a_forked_job_is_the_fresh_interpreter(tmp_path, status):
    env = dict(os.environ, JOB_VAR="v1", PYTHONWARNINGS="ignore")
    assert suite_helpers._entry([sys.executable, "-c", CODE]) is not None
    forked, fresh = both([sys.executable, "-c", CODE, str(status), "x y"], env=env, cwd=str(tmp_path))
    assert forked.returncode == fresh.returncode == status
    assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr == "to stderr\n"
    lines = forked.stdout.splitlines()
    assert lines[1:] == ["thread finished", "atexit ran"]
    assert '"argv": ["-c", "' + str(status) + '", "x y"]' in lines[0] and '"env": "v1"' in lines[0]
    assert '"ours_loaded": []' in lines[0]  # sglang and the plugin are imported by the job itself


def test_module_script_exceptions_and_exit_messages(tmp_path):
    pkg = tmp_path / "jobmod.py"
    pkg.write_text("import sys\nif sys.argv[1] == 'raise':\n    raise ValueError('boom')\nsys.exit('a message')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for arg, status, tail in (("raise", 1, "ValueError: boom\n"), ("exit", 1, "a message\n")):
        forked, fresh = both([sys.executable, "-m", "jobmod", arg], env=env, cwd=str(tmp_path))
        assert forked.returncode == fresh.returncode == status
        assert forked.stderr.endswith(tail) and fresh.stderr.endswith(tail)
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text("import sys\nsys.stderr.write('sitecustomize ran\\n')\n")
    env = dict(os.environ, PYTHONPATH=str(site_dir))
    forked, fresh = both([sys.executable, "-c", "pass"], env=env)
    assert forked.stderr == fresh.stderr == "sitecustomize ran\n"
    script = os.path.join(os.path.dirname(sys.executable), "sglang-cp")
    forked, fresh = both([script, "--help"], env=dict(os.environ))
    assert forked.returncode == fresh.returncode == 0 and forked.stdout == fresh.stdout


def test_a_job_past_its_timeout_is_killed():
    import subprocess

    with pytest.raises(subprocess.TimeoutExpired):
        run_job([sys.executable, "-c", "import time; time.sleep(60)"], timeout=2)
