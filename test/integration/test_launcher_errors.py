"""Config and flag errors through the real launcher: one line naming the field, non-zero exit.

``python -m sglang.launch_server`` with the plugin loaded used to print two chained tracebacks
(~40 lines) around the message; and when the plugin failed to register, our flags were only
"unrecognized arguments". Both are real launcher processes on CPU (no model is touched: the
errors come while parsing the command line).
"""

import os
import sys

import pytest

from suite_helpers import fresh_env, run_all

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The launcher as a module, with one hook module made unimportable first (as a broken install is).
BROKEN = """
import runpy, sys
sys.modules["sglang_cp.integration.cp_l3.backend"] = None
sys.argv = ["sglang.launch_server"] + sys.argv[1:]
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
"""


def launch_argv(args, broken=False):
    cmd = [sys.executable, "-c", BROKEN] if broken else [sys.executable, "-m", "sglang.launch_server"]
    return (cmd + ["--model-path", "dummy", *args], {"env": fresh_env()})


def serve_argv(args):
    model = os.path.join(REPO, "test", "gpu", "models", "tiny-dsv3")  # local: no hub lookup to pick a backend
    return ([os.path.join(os.path.dirname(sys.executable), "sglang"), "serve", "--model-path", model, *args],
            {"env": fresh_env()})


YAML_CHECK = ("import sys; from sglang.srt.plugins import load_plugins; load_plugins(); "
              "from sglang.srt.server_args import prepare_server_args; "
              "print('COLD', prepare_server_args(sys.argv[1:]).cp_l3_cold_start)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every launcher process of this module, started together (each is one interpreter importing sglang
    and answering from its parser; they share nothing), keyed by the test that reads it."""
    tmp = tmp_path_factory.mktemp("launcher")
    bad = tmp / "bad.toml"
    bad.write_text(f'[index]\ndir = "{tmp}"\n[[disks]]\nname = "d0"\npath = "{tmp}"\n'
                   "capacity_gb = nan\n")
    yaml = tmp / "serve.yaml"
    yaml.write_text("cp-l3-cold-start: verify\n")
    return run_all({
        "bad_config": launch_argv(["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", str(bad)]),
        "flag_error": launch_argv(["--enable-cp-l3"]),
        "broken_ours": launch_argv(["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", "x.toml"],
                                   broken=True),
        "broken_plain": launch_argv(["--definitely-not-a-flag"], broken=True),
        "bad_choice": launch_argv(["--cp-l3-cold-start", "loadd"]),
        "number_word": launch_argv(["--cp-hicache-max-slab-gb", "lots"]),
        "config_twice": launch_argv(["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", "a.toml",
                                     "--cp-l3-config", "b.toml"]),
        "yaml": ([sys.executable, "-c", YAML_CHECK, "--config", str(yaml), "--model-path", "dummy",
                  "--cp-l3-cold-start", "load"], {"env": fresh_env()}),
        "serve_choice": serve_argv(["--cp-l3-cold-start", "loadd"]),
        "serve_cross": serve_argv(["--enable-cp-l3", "--cp-l3-config", "x.toml"]),
        "serve_help": serve_argv(["--help"]),
        "launch_help": ([sys.executable, "-m", "sglang.launch_server", "--help"], {"env": fresh_env()}),
    }, timeout=240)


def error_lines(p):
    return [line for line in p.stderr.splitlines() if "error:" in line]


def test_bad_config_is_one_line_naming_the_field(runs):
    p = runs["bad_config"]
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    lines = error_lines(p)
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("sglang serve: error: --cp-l3-config") and "disks[0].capacity_gb" in lines[0]


def test_flag_error_is_one_line_naming_the_flag(runs):
    p = runs["flag_error"]
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    assert error_lines(p) == ["sglang serve: error: --enable-cp-l3 needs --enable-hierarchical-cache: the L3 "
                              "tier persists pages of the HiCache host pool. Add --enable-hierarchical-cache."]


def test_failed_registration_names_the_cause_not_unrecognized_arguments(runs):
    p = runs["broken_ours"]
    assert p.returncode == 2, p.stderr
    assert "unrecognized arguments" not in p.stderr
    line = error_lines(p)[-1]
    assert line.startswith("sglang serve: error: --enable-cp-l3: the sglang-cp plugin is installed but failed "
                           "to register") and "sglang_cp.integration.cp_l3.backend" in line, p.stderr


def test_failed_registration_leaves_a_command_line_without_our_flags_alone(runs):
    p = runs["broken_plain"]
    assert p.returncode == 2 and "unrecognized arguments: --definitely-not-a-flag" in p.stderr


def test_bad_choice_is_one_line_naming_the_choices_not_sglangs_usage(runs):
    p = runs["bad_choice"]
    assert p.returncode != 0
    assert "usage:" not in p.stderr and "Traceback" not in p.stderr, p.stderr[:2000]
    assert error_lines(p) == ["sglang serve: error: --cp-l3-cold-start must be one of clear, load, verify; "
                              "got 'loadd'."]


def test_a_number_flag_given_a_word_is_one_line(runs):
    p = runs["number_word"]
    assert p.returncode != 0 and "usage:" not in p.stderr, p.stderr[:2000]
    assert error_lines(p) == ["sglang serve: error: --cp-hicache-max-slab-gb: 'lots' is not a number; give it "
                              "in GB, e.g. --cp-hicache-max-slab-gb 480.0."]


def test_cp_l3_config_given_twice_is_refused_naming_the_flag(runs):
    p = runs["config_twice"]
    assert p.returncode != 0 and "usage:" not in p.stderr, p.stderr[:2000]
    assert error_lines(p) == ["sglang serve: error: --cp-l3-config is given twice ('a.toml', then 'b.toml'): "
                              "give it once, with the value you mean."]


def test_upstreams_yaml_config_may_be_overridden_on_the_command_line(runs):
    """--config puts the YAML's values first and the command line's after them, which override them
    (upstream's documented merge): our flags there are not "given twice"."""
    p = runs["yaml"]
    assert "COLD load" in p.stdout, p.stdout + p.stderr[-2000:]


def test_our_flags_parse_through_sglang_serve(runs):
    """Upstream's recommended entry point loads plugins before it parses: a value error and a
    cross-flag check of ours come back as through launch_server, one line each."""
    p = runs["serve_choice"]
    assert error_lines(p) == ["sglang serve: error: --cp-l3-cold-start must be one of clear, load, verify; "
                              "got 'loadd'."], p.stderr[-3000:]
    p = runs["serve_cross"]
    assert p.returncode != 0 and "usage:" not in p.stderr
    assert error_lines(p)[-1].startswith("sglang serve: error: --enable-cp-l3 needs --enable-hierarchical-cache")


def test_sglang_serve_help_lists_no_plugin_flags_launch_server_help_does(runs):
    """What the README says: 0.5.23's `sglang serve --help` prints before plugins load."""
    serve = runs["serve_help"]
    assert serve.returncode == 0 and "--model-path" in serve.stdout and "--enable-cp-l3" not in serve.stdout
    p = runs["launch_help"]
    assert p.returncode == 0 and "sglang-cp (context-parallel tiered KV cache)" in p.stdout
    assert "--cp-l3-cold-start {clear,load,verify}" in p.stdout
