"""`sglang-cp check-args` on a CPU box for a GPU server's command line (real processes, real sglang).

It used to crash with `RuntimeError: No accelerator ...` unless `--device cpu` was added; with a
Hugging Face model id and no network it retried for ~50 s and ended in an 87-line OSError
traceback; it accepted a capacity_gb beyond the disk's free space; an upstream argparse error
printed SGLang's whole usage. Each is one line now, or accepted with what it defaulted.

Wall-time bounds are generous (a loaded 2-core machine imports sglang in 10-20 s): what proves
"no download, no retries" is the stand-in endpoint below, which counts the connections it gets.
"""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from suite_helpers import REPO, run_all
from sglang_cp.check_args import OFFLINE_ENV
from sglang_cp.cli import write_demo_config

BIN = os.path.join(os.path.dirname(sys.executable), "sglang-cp")
TINY_MLA = os.path.join(REPO, "test", "gpu", "models", "tiny-dsv3")  # a DeepseekV3 config.json, no weights
HUB_ID = "sglang-cp-test/not-a-real-model"


def job(*argv, env_extra=None, drop=()):
    """A check-args run as a run_all job. check-args sets OFFLINE_ENV (setdefault) before it imports
    sglang: a job forked from the suite's zygote says so (suite_helpers.run_job's sets_env)."""
    env = dict(os.environ, COLUMNS="200", PYTHONWARNINGS="ignore")
    for k in ("SGLANG_CP_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *drop):
        env.pop(k, None)
    env.update(env_extra or {})
    return [BIN, "check-args", "--", *argv], {"env": env, "sets_env": OFFLINE_ENV}


def check_args(*argv, env_extra=None, drop=()):
    """One run now, timed (the hub tests bound its wall time, so it runs alone), in a new interpreter: what
    the hub tests prove is check-args' own offline setting at start-up."""
    cmd, kw = job(*argv, env_extra=env_extra, drop=drop)
    kw.pop("sets_env")
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    return p, time.monotonic() - t0


PARSE_ERRORS = [
    (["--tp", "abc"], "rejected: argument --tp-size/--tensor-parallel-size: invalid int value: 'abc'"),
    (["--cp-l3-cold-start", "loadd"], "rejected: --cp-l3-cold-start must be one of clear, load, verify; got 'loadd'."),
    (["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", "a.toml", "--cp-l3-config", "b.toml"],
     "rejected: --cp-l3-config is given twice ('a.toml', then 'b.toml'): give it once, with the value you mean."),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs that bound no wall time, started together (independent processes and files)."""
    cfg = write_demo_config(str(tmp_path_factory.mktemp("disk") / "l3"), capacity_gb=0.05)
    big = write_demo_config(str(tmp_path_factory.mktemp("disk") / "l3"), capacity_gb=0.05)
    st = os.statvfs(os.path.dirname(big))
    too_big = (st.f_bavail * st.f_frsize + 1000e9) / 1e9
    with open(big) as f:
        text = f.read()
    with open(big, "w") as f:
        f.write(text.replace("capacity_gb = 0.05", f"capacity_gb = {too_big:.0f}"))
    jobs = {
        "gpu_line": job("--model-path", TINY_MLA, "--trust-remote-code", "--page-size", "64",
                        "--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", cfg),
        "missing_model": job("--model-path", "/nonexistent/models/GLM-5"),
        "too_big": job("--model-path", "dummy", "--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", big),
    }
    jobs.update({f"parse{i}": job("--model-path", "dummy", *argv) for i, (argv, _) in enumerate(PARSE_ERRORS)})
    runs = run_all(jobs, timeout=300)
    runs["too_big_gb"] = too_big
    return runs


def rejected_line(p):
    lines = [line for line in p.stdout.splitlines() if line.startswith("rejected")]
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "usage:" not in p.stdout + p.stderr, p.stderr[-3000:]
    return lines[0]


class SilentEndpoint:
    """An HTTP endpoint on the loopback that accepts connections and never answers: a client that
    tries the hub waits out its timeouts and retries here; one that never tries leaves count at 0."""

    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.count, self.stop, self.held = 0, False, []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        return self

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.count += 1
            self.held.append(conn)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join(5)
        for c in self.held:
            c.close()
        self.sock.close()


def test_no_accelerator_checks_a_gpu_line_as_for_cuda(runs):
    p = runs["gpu_line"]
    assert p.returncode == 0 and "accepted" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "No accelerator" not in p.stdout + p.stderr
    assert "note: no accelerator on this machine: checked as for --device cuda" in p.stdout
    assert "--device (upstream, resolved)" in p.stdout and "'cuda'" in p.stdout


def test_a_hub_id_offline_fails_fast_in_one_line_naming_config_json():
    p, wall = check_args("--model-path", HUB_ID, env_extra={"HF_HUB_OFFLINE": "1"})
    line = rejected_line(p)
    assert line.startswith(f"rejected: --model-path '{HUB_ID}': not a local directory") and "config.json" in line
    assert f"hf download {HUB_ID} config.json" in line
    assert wall < 30, wall


def test_a_hub_id_with_an_unreachable_endpoint_never_contacts_it():
    with SilentEndpoint() as hub:
        p, wall = check_args("--model-path", HUB_ID, env_extra={"HF_ENDPOINT": hub.url})
    line = rejected_line(p)
    assert "not a local directory" in line and "config.json" in line
    assert hub.count == 0 and wall < 30, (hub.count, wall)


def test_a_hub_id_in_the_local_cache_is_read_there_offline(tmp_path):
    snap = tmp_path / "hub" / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(open(os.path.join(TINY_MLA, "config.json")).read())
    refs = snap.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    with SilentEndpoint() as hub:
        p, _ = check_args("--model-path", HUB_ID, "--trust-remote-code",
                          env_extra={"HF_HOME": str(tmp_path), "HF_ENDPOINT": hub.url}, drop=("HF_HUB_CACHE",))
    assert p.returncode == 0 and "accepted" in p.stdout, p.stdout + p.stderr[-3000:]
    assert hub.count == 0


def test_a_missing_local_model_directory_is_one_line(runs):
    p = runs["missing_model"]
    line = rejected_line(p)
    assert "--model-path '/nonexistent/models/GLM-5': no such file or directory here" in line


def test_capacity_beyond_free_space_is_refused_as_doctor_does(runs):
    too_big = runs["too_big_gb"]
    line = rejected_line(runs["too_big"])
    assert f"disks[0].capacity_gb = {too_big:.0f} does not fit on" in line and "GB free" in line
    assert "lower capacity_gb or free space" in line


@pytest.mark.parametrize("case", range(len(PARSE_ERRORS)), ids=["tp-word", "cold-start-choice", "config-twice"])
def test_parse_errors_are_one_line_without_sglangs_usage(runs, case):
    assert rejected_line(runs[f"parse{case}"]) == PARSE_ERRORS[case][1]
