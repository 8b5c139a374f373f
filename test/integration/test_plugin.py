"""The plugin against the real pinned sglang: discovery, flags, validation, neutrality.

Processes are real: each scenario starts a fresh interpreter so upstream's one-shot
``load_plugins()`` and hook patching happen exactly as in a server process.
"""

import json
import textwrap

import pytest

from suite_helpers import py_job, run_all, run_py

PARSE = textwrap.dedent(
    """
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    argv = json.loads(sys.argv[1]) if len(sys.argv) > 1 else ARGV
    try:
        a = prepare_server_args(argv)
        a.resolve_once()
    except SystemExit as e:
        print("EXIT", e.code); raise
    except Exception as e:
        print("ERROR", type(e).__name__, e); sys.exit(3)
    names = ["enable_cp_l3", "cp_l3_config", "cp_l3_cold_start",
             "enable_cp_shared_physical_l2_hicache", "cp_shared_l2_hugetlbfs_dir",
             "cp_hicache_max_slab_gb", "cp_hicache_placement_assert"]
    print("FLAGS", json.dumps({n: getattr(a, n, "<absent>") for n in names}))
    """
)


def parse_job(argv, env=None):
    return py_job(PARSE.replace("ARGV", repr(list(argv))), env_extra=env)


def ok(p):
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """Every fresh-interpreter scenario of this module, started together (each is its own process with
    its own load_plugins(); they share nothing), keyed by the test that reads it."""
    tmp = tmp_path_factory.mktemp("plugin")
    script = tmp / "spawn_check.py"
    script.write_text(SPAWN_CHECK.replace("HUGETLBFS_DIR", repr(str(tmp))))
    neutral_env = {"COLUMNS": "100", "PYTHONHASHSEED": "0"}  # upstream builds some choices from sets
    jobs = {
        "parse": parse_job(["--model-path", "dummy", "--enable-hierarchical-cache", "--cp-hicache-max-slab-gb",
                            "100", "--cp-hicache-placement-assert", "--cp-shared-l2-hugetlbfs-dir", str(tmp)]),
        "other_release": py_job(OTHER_SGLANG),
        "engine_path": py_job(ENGINE_PATH),
        "kill_switch": parse_job(["--model-path", "dummy", "--enable-cp-l3"], env={"SGLANG_CP_DISABLE": "1"}),
        "allowlist": parse_job(["--model-path", "dummy", "--enable-cp-l3"], env={"SGLANG_PLUGINS": "some_other_plugin"}),
        "neutral_on": py_job(NEUTRAL, neutral_env),
        "neutral_off": py_job(NEUTRAL, {**neutral_env, "SGLANG_CP_DISABLE": "1"}),
        "pickling": py_job(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"),
        "register": py_job(REGISTER),
    }
    runs = run_all(jobs, timeout=300)
    runs["tmp"] = tmp
    return runs


def test_entry_point_is_discoverable():
    import importlib.metadata as md

    eps = {ep.name: ep.value for ep in md.entry_points(group="sglang.srt.plugins")}
    assert eps.get("sglang_cp") == "sglang_cp.plugin:register"


def test_upstream_load_plugins_picks_us_up_and_flags_parse(procs):
    p = procs["parse"]
    assert p.returncode == 0, p.stdout + p.stderr
    flags = json.loads(p.stdout.split("FLAGS", 1)[1])
    assert flags["cp_hicache_max_slab_gb"] == 100.0
    assert flags["cp_hicache_placement_assert"] is True
    assert flags["enable_cp_l3"] is False  # defaults reach the record too
    assert flags["cp_l3_cold_start"] == "clear"


_L3_EXTRA = ["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", "x.toml",
             "--hicache-storage-backend-extra-config"]
VALIDATION_CASES = [
    (["--enable-cp-l3"], "--enable-cp-l3 needs --enable-hierarchical-cache"),
    (["--enable-hierarchical-cache", "--enable-cp-l3"], "--enable-cp-l3 needs --cp-l3-config"),
    (["--cp-l3-config", "x.toml"], "--cp-l3-config is given but --enable-cp-l3 is not"),
    (["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", "/nonexistent/l3.toml"],
     "--cp-l3-config '/nonexistent/l3.toml': no such file"),
    (["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", "x.toml",
      "--hicache-storage-backend", "file"], "excludes --hicache-storage-backend file"),
    (["--enable-cp-shared-physical-l2-hicache"],
     "--enable-cp-shared-physical-l2-hicache needs --enable-hierarchical-cache"),
    (["--enable-hierarchical-cache", "--enable-cp-shared-physical-l2-hicache",
      "--cp-shared-l2-hugetlbfs-dir", "/nonexistent/huge"], "is not a directory"),
    (["--enable-hierarchical-cache", "--enable-cp-l3", "--cp-l3-config", "x.toml", "--enable-kv-cache-sharding",
      "--hicache-host-memory-mode", "buffer_only"],
     "--hicache-host-memory-mode buffer_only is not supported with --enable-cp-l3 under --enable-kv-cache-sharding"),
    (["--cp-hicache-max-slab-gb", "0"], "--cp-hicache-max-slab-gb must be a finite number of GiB"),
    (["--cp-hicache-max-slab-gb", "inf"], "at least one 2 MiB hugepage (0.00195312); got inf"),
    (["--enable-hierarchical-cache", "--enable-cp-shared-physical-l2-hicache", "--dcp-size", "2"],
     "--enable-cp-shared-physical-l2-hicache does not support --dcp-size 2"),
    (["--enable-hierarchical-cache", "--enable-cp-shared-physical-l2-hicache", "--dp-size", "2"],
     "does not support --dp-size 2 without --enable-dp-attention"),
    (["--cp-hicache-placement-assert"], "--cp-hicache-placement-assert checks HiCache"),
    (["--cp-l3-cold-start", "maybe"], "--cp-l3-cold-start must be one of clear, load, verify; got 'maybe'."),
    # upstream's prefetch settings pass through --hicache-storage-backend-extra-config; nothing else does
    ([*_L3_EXTRA, '{"max_size": 5}'], "--hicache-storage-backend-extra-config: 'max_size' is not used with --enable-cp-l3"),
    ([*_L3_EXTRA, '{"prefetch_threshold": "64"}'],
     "prefetch_threshold must be a whole number of tokens >= 0 (upstream's default 256); got '64'."),
    ([*_L3_EXTRA, '{"prefetch_timeout_base": 0}'], "prefetch_timeout_base must be a number of seconds > 0"),
    ([*_L3_EXTRA, "prefetch_threshold=64"], "--hicache-storage-backend-extra-config: not valid JSON"),
    ([*_L3_EXTRA, "@/nonexistent/tuning.toml"],
     "--hicache-storage-backend-extra-config @/nonexistent/tuning.toml: cannot read it"),
]

# Every case through the real plugin and parser, in one fresh interpreter: each command line is parsed
# and resolved on its own (nothing of one reaches the next), and one sglang import serves all of them.
PARSE_EACH = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    out = []
    for argv in json.loads(ARGVS):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                prepare_server_args(argv).resolve_once()
            out.append(["OK", ""])
        except SystemExit as e:
            out.append(["EXIT", str(e.code) + " " + err.getvalue()])
        except Exception as e:
            out.append([type(e).__name__, str(e) + " " + err.getvalue()])
    print("RESULTS", json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def validation_results():
    argvs = [["--model-path", "dummy", *argv] for argv, _ in VALIDATION_CASES]
    p = run_py(PARSE_EACH.replace("ARGVS", repr(json.dumps(argvs))))
    assert p.returncode == 0 and "RESULTS" in p.stdout, p.stdout + p.stderr
    return json.loads(p.stdout.split("RESULTS", 1)[1])


@pytest.mark.parametrize("case", range(len(VALIDATION_CASES)),
                         ids=[needle[:40] for _, needle in VALIDATION_CASES])
def test_validation_errors_name_flag_and_fix(validation_results, case):
    kind, message = validation_results[case]
    needle = VALIDATION_CASES[case][1]
    assert kind == "CpArgsError" and needle in message, (VALIDATION_CASES[case], kind, message)
    assert "usage:" not in message  # one line, not sglang's whole usage


def test_the_sglang_pin_is_pyprojects():
    import re

    from suite_helpers import REPO
    from sglang_cp.plugin import SGLANG_PIN

    deps = open(f"{REPO}/pyproject.toml").read()
    assert re.findall(r'"sglang==([^"]+)"', deps) == [SGLANG_PIN]


OTHER_SGLANG = textwrap.dedent(
    """
    import sglang.version
    sglang.version.__version__ = "0.5.99"   # the real sglang, as another release would announce itself
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import sglang_cp.plugin as plugin
    print("STATUS", plugin.status())
    from sglang.srt.server_args import prepare_server_args
    a = prepare_server_args(["--model-path", "dummy"])   # a command line without our flags: upstream's
    print("PLAIN OK", a.model_path)
    prepare_server_args(["--model-path", "dummy", "--enable-cp-l3"])
    """
)


def test_another_sglang_release_is_refused_naming_the_pin(procs):
    p = procs["other_release"]
    assert "'registered': False" in p.stdout and "pinned to sglang==0.5.23" in p.stdout, p.stdout + p.stderr
    assert "PLAIN OK dummy" in p.stdout
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "usage:" not in p.stderr, p.stderr
    assert errors[0].startswith("sglang serve: error: --enable-cp-l3: the sglang-cp plugin is installed but not "
                                "loaded (sglang 0.5.99 is installed, but sglang-cp is pinned to sglang==0.5.23")
    # the refusal is said once, at plugin load, even with no sglang-cp flag on the command line
    assert "sglang-cp plugin not loaded, SGLang runs without it: sglang 0.5.99 is installed" in p.stderr


ENGINE_PATH = textwrap.dedent(
    """
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    a = prepare_server_args(["--model-path", "dummy"])
    a.enable_cp_l3 = True   # set by hand, as an Engine user would
    try:
        a.resolve_once()
    except Exception as e:
        print("ERROR", type(e).__name__, e)
    """
)


def test_engine_path_validates_in_resolution(procs):
    """A record built without the CLI is validated by our resolution hook."""
    p = procs["engine_path"]
    assert "CpArgsError --enable-cp-l3 needs --enable-hierarchical-cache" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("which", ["kill_switch", "allowlist"])
def test_kill_switch_and_allowlist_leave_sglang_untouched(procs, which):
    p = procs[which]  # SGLANG_CP_DISABLE=1, or SGLANG_PLUGINS naming another plugin
    assert p.returncode == 2 and "unrecognized arguments: --enable-cp-l3" in p.stderr


NEUTRAL = textwrap.dedent(
    """
    import argparse, io, json, contextlib
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs, prepare_server_args
    a = prepare_server_args(["--model-path", "dummy", "--enable-hierarchical-cache",
                             "--hicache-ratio", "2", "--page-size", "64"])
    a.resolve_once()
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        parser.print_help()
    # Every prefix of one of our flags that names exactly one of upstream's options (``--enable-cp`` for
    # ``--enable-cp-decode-attn-tp``) resolves to that option, as it does without the plugin.
    from sglang_cp.args import arg_specs
    FLAGS = [flag for flag, _ in arg_specs()]
    theirs = [o for a in parser._actions for o in a.option_strings if o not in FLAGS]
    abbrevs = {}
    for flag in FLAGS:
        for k in range(3, len(flag)):
            prefix = flag[:k]
            if prefix not in abbrevs and len([o for o in theirs if o.startswith(prefix)]) == 1:
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        ns, rest = parser.parse_known_args(["--model-path", "dummy", prefix, "1"])
                    abbrevs[prefix] = [k for k, v in vars(ns).items() if v != parser.get_default(k)]
                except SystemExit:
                    abbrevs[prefix] = "refused"
    print(json.dumps({"resolved": a.resolved_dict(), "help": buf.getvalue(), "abbrevs": abbrevs}, default=repr))
    """
)


def test_flags_off_is_behaviour_neutral(procs):
    # Upstream builds some choices from sets: both runs pin the hash seed so they order them alike.
    on, off = ok(procs["neutral_on"]), ok(procs["neutral_off"])
    on_d, off_d = json.loads(on.stdout.splitlines()[-1]), json.loads(off.stdout.splitlines()[-1])
    assert on_d["resolved"] == off_d["resolved"]
    assert on_d["abbrevs"] and on_d["abbrevs"] == off_d["abbrevs"]
    assert on_d["abbrevs"]["--enable-cp"] != "refused"  # upstream's --enable-cp-decode-attn-tp
    help_on, help_off = on_d["help"], off_d["help"]
    assert "sglang-cp (context-parallel tiered KV cache)" in help_on
    assert "sglang-cp" not in help_off
    # argparse's usage block lists every option, ours included: compare what follows it.
    help_on, help_off = help_on.split("\n\n", 1)[1], help_off.split("\n\n", 1)[1]
    # Remove our group (its title line up to the next group or the end); the rest is identical.
    start = help_on.index("sglang-cp (context-parallel tiered KV cache):")
    rest = help_on[start:]
    nxt = rest.find("\n\n", rest.find("--cp-hicache-placement-assert"))
    stripped = help_on[:start] + (rest[nxt + 2:] if nxt != -1 else "")
    assert stripped.rstrip() == help_off.rstrip()


SPAWN_CHECK = textwrap.dedent(
    """
    import multiprocessing as mp
    def child(sa, q):
        q.put((sa.enable_cp_shared_physical_l2_hicache, sa.cp_hicache_max_slab_gb,
               sa.cp_shared_l2_hugetlbfs_dir, sa.cp_l3_cold_start, sa.cp_hicache_placement_assert))
    if __name__ == "__main__":
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        a = prepare_server_args(["--model-path", "dummy", "--enable-hierarchical-cache",
            "--enable-cp-shared-physical-l2-hicache", "--cp-shared-l2-hugetlbfs-dir", HUGETLBFS_DIR,
            "--cp-hicache-max-slab-gb", "7.5", "--cp-l3-cold-start", "verify",
            "--cp-hicache-placement-assert"])
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(a, q)); p.start()
        print("CHILD", q.get(timeout=120)); p.join(60)
    """
)


def test_flags_survive_pickling_into_a_spawned_process(procs):
    """The scheduler/detokenizer/DP controller get ServerArgs by pickling into spawned processes."""
    p = ok(procs["pickling"])
    assert f"CHILD (True, 7.5, {str(procs['tmp'])!r}, 'verify', True)" in p.stdout, p.stdout


REGISTER = textwrap.dedent(
    """
    from sglang.srt.plugins.hook_registry import HookRegistry
    import sglang_cp.plugin as plugin
    import sglang_cp.integration as integ
    assert plugin.register() is True
    n = sum(len(v) for v in HookRegistry._hooks.values())
    assert plugin.register() is True
    assert sum(len(v) for v in HookRegistry._hooks.values()) == n, "second call re-registered"
    # a failing registration is logged and swallowed, and registers nothing functional: only the
    # parser notice that answers our flags with the cause (test_launcher_errors.py)
    plugin._state["registered"] = False
    HookRegistry.reset()
    def boom():
        raise RuntimeError("hook module import failed")
    integ.all_hooks = boom
    assert plugin.register() is False
    hooks = {t: [(ht.name, h.__name__) for ht, h, _ in v] for t, v in HookRegistry._hooks.items() if v}
    assert hooks == {"sglang.srt.server_args.ServerArgs.add_cli_args": [("AROUND", "add_cli_args_around")]}, hooks
    print("OK", plugin.status()["disabled_reason"])
    """
)


def test_register_is_idempotent_and_never_raises(procs):
    p = ok(procs["register"])
    assert "OK registration failed: RuntimeError('hook module import failed')" in p.stdout


CONFIG_MERGE = textwrap.dedent(
    """
    import json, os, sys, tempfile
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    assert "--config" not in sys.argv  # a program's own argv list, not the process's command line
    d = tempfile.mkdtemp()
    yaml = os.path.join(d, "server.yaml")
    with open(yaml, "w") as f:
        f.write("cp-hicache-max-slab-gb: 200\\ncp-l3-cold-start: load\\n")
    out = {}
    a = prepare_server_args(["--model-path", "dummy", "--config", yaml, "--cp-hicache-max-slab-gb", "100"])
    out["overridden"] = [a.cp_hicache_max_slab_gb, a.cp_l3_cold_start]
    a = prepare_server_args(["--model-path", "dummy", "--config", yaml])
    out["yaml_only"] = [a.cp_hicache_max_slab_gb, a.cp_l3_cold_start]
    try:
        prepare_server_args(["--model-path", "dummy", "--config", yaml, "--cp-hicache-max-slab-gb", "100",
                             "--cp-hicache-max-slab-gb", "50"])
        out["twice"] = "parsed"
    except Exception as e:
        out["twice"] = str(e)
    print("MERGE", json.dumps(out))
    """
)


def test_a_config_yaml_given_to_prepare_server_args_is_overridden_by_the_list(procs):
    """Upstream's --config merge through a program's own argv list (not sys.argv): the list's value of one
    of our flags overrides the YAML's, the YAML's stands alone, and a flag repeated in the list itself is
    still refused as given twice."""
    p = run_py(CONFIG_MERGE)
    assert p.returncode == 0 and "MERGE" in p.stdout, p.stdout + p.stderr[-2000:]
    out = json.loads(p.stdout.split("MERGE", 1)[1])
    assert out["overridden"] == [100.0, "load"] and out["yaml_only"] == [200.0, "load"]
    assert "--cp-hicache-max-slab-gb is given twice (100.0, then 50.0)" in out["twice"]
