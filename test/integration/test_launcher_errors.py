"""Config and flag errors through the real launcher: one line naming the field, non-zero exit.

``python -m sglang.launch_server`` with the plugin loaded used to print two chained tracebacks
(~40 lines) around the message; and when the plugin failed to register, our flags were only
"unrecognized arguments". Both are real launcher processes on CPU (no model is touched: the
errors come while parsing the command line).
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The launcher as a module, with one hook module made unimportable first (as a broken install is).
BROKEN = """
import runpy, sys
sys.modules["sglang_cp.integration.l3_storage_backend"] = None
sys.argv = ["sglang.launch_server"] + sys.argv[1:]
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
"""


def launch(args, broken=False):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("SGLANG_CP_DISABLE", None)
    env.pop("SGLANG_PLUGINS", None)
    cmd = [sys.executable, "-c", BROKEN] if broken else [sys.executable, "-m", "sglang.launch_server"]
    return subprocess.run(cmd + ["--model-path", "dummy", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=240)


def error_lines(p):
    return [line for line in p.stderr.splitlines() if "error:" in line]


def test_bad_config_is_one_line_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[index]\ndir = "{tmp_path}"\n[[disks]]\nname = "d0"\npath = "{tmp_path}"\n'
                   "capacity_gb = nan\n")
    p = launch(["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", str(bad)])
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    lines = error_lines(p)
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("sglang serve: error: --cp-l3-config") and "disks[0].capacity_gb" in lines[0]


def test_flag_error_is_one_line_naming_the_flag():
    p = launch(["--enable-cp-l3"])
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    assert error_lines(p) == ["sglang serve: error: --enable-cp-l3 needs --enable-hierarchical-cache: the L3 "
                              "tier persists pages of the HiCache host pool. Add --enable-hierarchical-cache."]


def test_failed_registration_names_the_cause_not_unrecognized_arguments():
    p = launch(["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", "x.toml"], broken=True)
    assert p.returncode == 2, p.stderr
    assert "unrecognized arguments" not in p.stderr
    line = error_lines(p)[-1]
    assert line.startswith("sglang serve: error: --enable-cp-l3: the sglang-cp plugin is installed but failed "
                           "to register") and "sglang_cp.integration.l3_storage_backend" in line, p.stderr


def test_failed_registration_leaves_a_command_line_without_our_flags_alone():
    p = launch(["--definitely-not-a-flag"], broken=True)
    assert p.returncode == 2 and "unrecognized arguments: --definitely-not-a-flag" in p.stderr


def test_bad_choice_is_one_line_naming_the_choices_not_sglangs_usage():
    p = launch(["--cp-l3-cold-start", "loadd"])
    assert p.returncode != 0
    assert "usage:" not in p.stderr and "Traceback" not in p.stderr, p.stderr[:2000]
    assert error_lines(p) == ["sglang serve: error: --cp-l3-cold-start must be one of clear, load, verify; "
                              "got 'loadd'."]


def test_a_number_flag_given_a_word_is_one_line():
    p = launch(["--cp-hicache-max-slab-gb", "lots"])
    assert p.returncode != 0 and "usage:" not in p.stderr, p.stderr[:2000]
    assert error_lines(p) == ["sglang serve: error: --cp-hicache-max-slab-gb: 'lots' is not a number; give it "
                              "in GB, e.g. --cp-hicache-max-slab-gb 480.0."]


def test_cp_l3_config_given_twice_is_refused_naming_the_flag():
    p = launch(["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", "a.toml",
                "--cp-l3-config", "b.toml"])
    assert p.returncode != 0 and "usage:" not in p.stderr, p.stderr[:2000]
    assert error_lines(p) == ["sglang serve: error: --cp-l3-config is given twice ('a.toml', then 'b.toml'): "
                              "give it once, with the value you mean."]


def test_upstreams_yaml_config_may_be_overridden_on_the_command_line(tmp_path):
    """--config puts the YAML's values first and the command line's after them, which override them
    (upstream's documented merge): our flags there are not "given twice"."""
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("cp-l3-cold-start: verify\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("SGLANG_CP_DISABLE", None)
    code = ("import sys; from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.server_args import prepare_server_args; "
            "print('COLD', prepare_server_args(sys.argv[1:]).cp_l3_cold_start)")
    p = subprocess.run([sys.executable, "-c", code, "--config", str(yaml), "--model-path", "dummy",
                        "--cp-l3-cold-start", "load"], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=240)
    assert "COLD load" in p.stdout, p.stdout + p.stderr[-2000:]


def _sglang_serve(args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("SGLANG_CP_DISABLE", None)
    env.pop("SGLANG_PLUGINS", None)
    model = os.path.join(REPO, "test", "gpu", "models", "tiny-dsv3")  # local: no hub lookup to pick a backend
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "sglang"), "serve", "--model-path", model,
                           *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=240)


def test_our_flags_parse_through_sglang_serve():
    """Upstream's recommended entry point loads plugins before it parses: a value error and a
    cross-flag check of ours come back as through launch_server, one line each."""
    p = _sglang_serve(["--cp-l3-cold-start", "loadd"])
    assert error_lines(p) == ["sglang serve: error: --cp-l3-cold-start must be one of clear, load, verify; "
                              "got 'loadd'."], p.stderr[-3000:]
    p = _sglang_serve(["--enable-cp-l3", "--cp-l3-config", "x.toml"])
    assert p.returncode != 0 and "usage:" not in p.stderr
    assert error_lines(p)[-1].startswith("sglang serve: error: --enable-cp-l3 needs --enable-hierarchical-cache")


def test_sglang_serve_help_lists_no_plugin_flags_launch_server_help_does():
    """What the README says: 0.5.23's `sglang serve --help` prints before plugins load."""
    serve = _sglang_serve(["--help"])
    assert serve.returncode == 0 and "--model-path" in serve.stdout and "--enable-cp-l3" not in serve.stdout
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("SGLANG_CP_DISABLE", None)
    p = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=240)
    assert p.returncode == 0 and "sglang-cp (context-parallel tiered KV cache)" in p.stdout
    assert "--cp-l3-cold-start {clear,load,verify}" in p.stdout
