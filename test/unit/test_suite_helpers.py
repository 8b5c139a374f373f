"""The suite's job runner (``suite_helpers.run_job``): a job forked from a zygote (scenario_zygote.py) must
behave as the fresh interpreter ``subprocess.run`` would start, exit status, streams, argv, environment,
working directory, sys.path and finalization included. Each case runs both ways and compares. Most cases
use a zygote that imports one small module (what the child does is the same whatever the zygote imported);
the first goes through ``run_job`` and the suite's own zygote. A job that imports nothing of upstream would
start with upstream's import-time settings (warnings filters): such jobs gain nothing from a zygote and run
as plain subprocesses in the suite."""

import os
import subprocess
import sys

import pytest

import scenario_zygote
import suite_helpers
from suite_helpers import fresh_env, run_job

CODE = r"""
import atexit, json, os, sys, threading, time, warnings
atexit.register(lambda: print("atexit ran"))
def late():
    time.sleep(0.2)
    print("thread finished")
threading.Thread(target=late).start()  # non-daemon: the interpreter waits for it at exit
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": os.environ.get("JOB_VAR"),
                  "ours_loaded": [m for m in sys.modules if m.split(".")[0] == "sglang_cp"],
                  "main": sorted(k for k in vars(sys.modules["__main__"]) if not k.startswith("__")),
                  "warn": [f[0] for f in warnings.filters[:1]], "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def fresh(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture
def zygote():
    """zygote(env) -> a small zygote started with ``env`` (closed after the test)."""
    made = []

    def make(env):
        made.append(scenario_zygote.Zygote(env, preload=("json",)))
        return made[-1]
    yield make
    for z in made:
        z.close()


def forked(zygote, argv, env, cwd=None):
    """``argv`` forked from a small zygote started with ``env``: a CompletedProcess as subprocess.run's."""
    kind, target, job_argv = suite_helpers._entry(argv)
    res = zygote(env).run(kind, target, job_argv, env, cwd or os.getcwd(), 120)
    assert res[0] != "fresh", res
    return subprocess.CompletedProcess(argv, res[0], res[1].decode(), res[2].decode())


def test_a_forked_job_is_the_fresh_interpreter(tmp_path, monkeypatch):
    """Through run_job and the suite's zygote, a job that imports upstream first, as the suite's jobs do:
    everything it prints, warnings filters included, is what a new interpreter prints."""
    env = fresh_env({"JOB_VAR": "v1"})
    argv = [sys.executable, "-c", "import sglang.srt.server_args\n" + CODE, "3", "x y"]
    log = tmp_path / "jobs.log"
    monkeypatch.setenv("SGLANG_CP_TEST_JOB_LOG", str(log))
    forked = run_job(argv, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert '"how": "forked"' in log.read_text()  # from the suite's zygote, not a new interpreter
    fresh_run = fresh(argv, env=env, cwd=str(tmp_path))
    assert forked.returncode == fresh_run.returncode == 3
    assert forked.stdout == fresh_run.stdout and forked.stderr == fresh_run.stderr == "to stderr\n"
    lines = forked.stdout.splitlines()
    assert lines[1:] == ["thread finished", "atexit ran"]
    assert '"argv": ["-c", "3", "x y"]' in lines[0] and '"env": "v1"' in lines[0]
    assert '"ours_loaded": []' in lines[0] and '"main": ["atexit", "json"' in lines[0]


def test_exit_status_streams_and_finalization(tmp_path, zygote):
    env = fresh_env({"JOB_VAR": "v2"})
    argv = [sys.executable, "-c", CODE, "0"]
    f, p = forked(zygote, argv, env, cwd=str(tmp_path)), fresh(argv, env=env, cwd=str(tmp_path))
    assert (f.returncode, f.stdout, f.stderr) == (p.returncode, p.stdout, p.stderr)
    assert f.returncode == 0 and f.stdout.splitlines()[1:] == ["thread finished", "atexit ran"]


def test_module_script_exceptions_and_exit_messages(tmp_path, zygote):
    pkg = tmp_path / "jobmod.py"
    pkg.write_text("import sys\nif sys.argv[1] == 'raise':\n    raise ValueError('boom')\nsys.exit('a message')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for arg, status, tail in (("raise", 1, "ValueError: boom\n"), ("exit", 1, "a message\n")):
        argv = [sys.executable, "-m", "jobmod", arg]
        f, p = forked(zygote, argv, env, cwd=str(tmp_path)), fresh(argv, env=env, cwd=str(tmp_path))
        assert f.returncode == p.returncode == status
        assert f.stderr.endswith(tail) and p.stderr.endswith(tail)
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(sys.argv, sys.path[0] == sys.argv[0].rsplit('/', 1)[0])\n")
    argv = [sys.executable, str(script), "a"]
    assert forked(zygote, argv, dict(os.environ)).stdout == fresh(argv, env=dict(os.environ)).stdout
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text("import sys\nsys.stderr.write('sitecustomize ran\\n')\n")
    env = dict(os.environ, PYTHONPATH=str(site_dir))
    argv = [sys.executable, "-c", "pass"]
    assert forked(zygote, argv, env).stderr == fresh(argv, env=env).stderr == "sitecustomize ran\n"
    argv = [os.path.join(os.path.dirname(sys.executable), "sglang-cp"), "--help"]
    f, p = forked(zygote, argv, dict(os.environ)), fresh(argv, env=dict(os.environ))
    assert f.returncode == p.returncode == 0 and f.stdout == p.stdout


def test_a_job_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        run_job([sys.executable, "-c", "import time; time.sleep(60)"], env=fresh_env(), timeout=2)
