"""What the `sglang-cp` tools print besides their answer: help, warnings, commands to copy.

Real processes of the installed entry point on real files. `sglang-cp --help` used to show RST
backticks and list the subcommands twice; every command that imports sglang printed four lines of
AWQ/GGUF UserWarnings on a CPU box; the L3 loader's PLP warning came once per tool (three times in
`make demo`); doctor's table cut a command to copy in the middle of a flag.
"""

import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
from rich.console import Console

from sglang_cp import doctor
from sglang_cp.cli import quiet_sglang_cpu_import_warnings, write_demo_config
from sglang_cp.display import PLP_WARNING_MARK, OncePerBootFilter
from sglang_cp.l3.plp import probe_write_cache

BIN = os.path.join(os.path.dirname(sys.executable), "sglang-cp")


def run(*args, env_extra=None):
    env = dict(os.environ, COLUMNS="200")
    env.pop("PYTHONWARNINGS", None)  # what a user's shell has: no blanket filter
    env.pop("SGLANG_CP_DISABLE", None)
    env.update(env_extra or {})
    return subprocess.run([BIN, *args], capture_output=True, text=True, env=env, timeout=300)


def test_help_lists_each_command_once_without_rst_markup():
    p = run("--help")
    assert p.returncode == 0
    assert "``" not in p.stdout
    lines = p.stdout.splitlines()
    for name in ("doctor", "check-args", "demo", "cachebench", "l3 stats", "l3 fsck"):
        listed = [line for line in lines if line.startswith(f"  {name} ")]
        assert len(listed) == 1, (name, p.stdout)
    assert "{doctor,check-args" not in p.stdout and "positional arguments" not in p.stdout
    assert lines[0] == "usage: sglang-cp [-h] COMMAND ..."


@pytest.mark.xdist_group("hugepages")  # doctor reads every hugetlbfs mount of the host
def test_doctor_prints_no_awq_gguf_import_warnings():
    p = run("doctor")
    assert "upstream targets" in p.stdout, p.stdout + p.stderr  # it did import sglang's hook targets
    assert "support AWQ" not in p.stderr and "support GGUF" not in p.stderr, p.stderr


def test_the_warning_filter_is_by_message_and_module():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_sglang_cpu_import_warnings()
        for module in ("sglang.srt.layers.quantization.awq.awq", "somebody.else"):
            warnings.warn_explicit("Only CUDA, HIP and XPU support AWQ currently.", UserWarning, "awq.py", 53,
                                   module=module)
        warnings.warn_explicit("Only CUDA, MUSA and NPU support GGUF quantization currently.", UserWarning,
                               "gguf.py", 76, module="sglang.srt.layers.quantization.gguf")
        warnings.warn_explicit("something else", UserWarning, "awq.py", 60,
                               module="sglang.srt.layers.quantization.awq.awq")
    assert [(str(w.message), w.filename) for w in seen] == [
        ("Only CUDA, HIP and XPU support AWQ currently.", "awq.py"), ("something else", "awq.py")]


def test_doctor_prints_commands_whole_below_its_table():
    rows = [doctor.Row("hugepages", "hugetlbfs mounts", doctor.FAIL,
                       "none mounted; `echo 8 > /proc/sys/vm/nr_hugepages && mount -t hugetlbfs none "
                       "/dev/hugepages` to use --enable-cp-shared-physical-l2-hicache"),
            doctor.Row("plugin", "entry point", doctor.OK, "ok")]
    console = Console(record=True, width=80)
    doctor.render(rows, console)
    out = console.export_text()
    assert "[1] echo 8 > /proc/sys/vm/nr_hugepages && mount -t hugetlbfs none /dev/hugepages" in out.splitlines()
    assert "command [1] below" in out and "`" not in out


@pytest.mark.xdist_group("hugepages")  # doctor reads every hugetlbfs mount of the host
def test_doctor_on_a_hugepage_request_names_a_command_that_copies_whole(tmp_path):
    p = run("doctor", "--enable-cp-shared-physical-l2-hicache", "--cp-shared-l2-hugetlbfs-dir", str(tmp_path),
            "--hicache-size", "10", env_extra={"COLUMNS": "80"})
    assert p.returncode == 1
    commands = [line for line in p.stdout.splitlines() if re.match(r"\[\d+\] ", line)]
    # the requested directory is not a mount: its command is whole on one line however narrow the terminal
    assert any(c.endswith(f"mkdir -p {tmp_path} && mount -t hugetlbfs none {tmp_path}") and "nr_hugepages" in c
               for c in commands), p.stdout
    if not doctor.hugetlbfs_mounts():  # no hugetlbfs mount on the host: doctor also names the default one
        assert any(c.endswith("mount -t hugetlbfs none /dev/hugepages") and "nr_hugepages" in c for c in commands)


def _volatile_demo_config(root):
    cfg = write_demo_config(str(root), capacity_gb=0.05)
    probe = probe_write_cache(os.path.dirname(cfg))
    if not probe.volatile:
        pytest.skip(f"the test disk does not report a volatile write cache ({probe}): no PLP warning")
    return cfg


def test_plp_warning_is_shown_once_per_boot_by_the_tools(disk_tmp, tmp_path):
    cfg = _volatile_demo_config(disk_tmp / "l3")
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    first = run("l3", "stats", "--cp-l3-config", cfg, env_extra=env)
    again = [run(*cmd, "--cp-l3-config", cfg, env_extra=env) for cmd in (("l3", "fsck"), ("l3", "stats"))]
    assert first.returncode == 0 and all(p.returncode == 0 for p in again)
    assert first.stderr.count(PLP_WARNING_MARK) == 1, first.stderr
    assert "shown once per boot by the sglang-cp tools" in first.stderr
    assert all(PLP_WARNING_MARK not in p.stderr for p in again), [p.stderr for p in again]
    marks = tmp_path / f"sglang-cp-{os.geteuid()}" / "once-per-boot"
    assert oct(marks.stat().st_mode & 0o777) == "0o700" and oct(marks.parent.stat().st_mode & 0o777) == "0o700"
    (mark,) = marks.iterdir()
    assert oct(mark.stat().st_mode & 0o777) == "0o600"


def test_a_server_process_still_warns_at_every_start(disk_tmp, tmp_path, caplog):
    """The filter is the tools' only: the loader as a server runs it warns, markers or not."""
    cfg = _volatile_demo_config(disk_tmp / "l3")
    from sglang_cp.l3 import config as l3config

    f = OncePerBootFilter(PLP_WARNING_MARK, str(tmp_path))
    def rec():
        return logging.LogRecord(l3config.logger.name, logging.WARNING, "x", 1, "L3: %s", (PLP_WARNING_MARK,), None)
    assert f.filter(rec()) and not f.filter(rec())  # the tools' filter: once
    l3config._warned_devices.clear()
    with caplog.at_level(logging.WARNING, logger=l3config.logger.name):
        l3config.load_l3_config(cfg)
    assert any(PLP_WARNING_MARK in r.getMessage() for r in caplog.records)
