"""The scenario zygote (test/scenario_zygote.py) that the suite's jobs fork from: it has imported upstream's
launcher modules, never our plugin, and never run upstream's plugin loading; it forks only a job whose
environment agrees with what its imports read; what those imports printed or set reaches every job."""

import ast
import json
import os
import sys

import pytest

import scenario_zygote
from scenario_zygote import Zygote, ZygoteError
from suite_helpers import fresh_env, run_job

INHERITED = r"""
import json, sys
state = {"ours": sorted(m for m in sys.modules if m.split(".")[0] == "sglang_cp"),
         "upstream": [m for m in ("sglang.srt.server_args", "torch") if m in sys.modules]}
plugins = sys.modules.get("sglang.srt.plugins")
state["plugins_loaded"] = getattr(plugins, "_plugins_loaded", None)
from sglang.srt.plugins.hook_registry import HookRegistry
state["hooks"] = sum(len(v) for v in HookRegistry._hooks.values()) + len(HookRegistry._patched)
from sglang.srt.plugins import load_plugins
load_plugins()  # the job loads the plugin itself
import sglang_cp.plugin
state["registered"] = sglang_cp.plugin.status()["registered"]
print("STATE", json.dumps(state))
"""


def test_a_job_starts_with_upstream_imported_and_neither_our_plugin_nor_plugin_loading():
    """What every forked job inherits: upstream's launcher modules, and not sglang_cp, not a run of
    upstream's load_plugins(), no hook registered; the job then loads and registers the plugin itself."""
    p = run_job([sys.executable, "-c", INHERITED], text=True, env=fresh_env(), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    state = json.loads(p.stdout.split("STATE", 1)[1])
    assert state["upstream"] == ["sglang.srt.server_args", "torch"]  # it came from the zygote
    assert state["ours"] == [] and state["plugins_loaded"] is False and state["hooks"] == 0, state
    assert state["registered"] is True


def test_the_suites_zygote_reads_only_what_it_names():
    """The suite's zygote knows which variables its imports read (no reader of the whole environment, no
    sys.argv at import), so that jobs of other tests (PYTEST_CURRENT_TEST differs) fork from it."""
    z, why = scenario_zygote.zygote_for(fresh_env())
    assert z is not None, why
    scenario_zygote.release(z)
    assert z.info["native_trace"] and not z.info["all_read"], z.info["unknown_readers"]
    assert z.info["argv_reads"] == [] and z.info["threads"] == 1 and z.info["refusal"] is None
    assert "PYTEST_CURRENT_TEST" not in z.info["read"] and "HF_HUB_OFFLINE" in z.info["read"]


def test_preload_is_what_launch_server_imports_before_load_plugins():
    import sglang.launch_server as ls  # noqa: F401  (its source, not its state)

    tree = ast.parse(open(sys.modules["sglang.launch_server"].__file__).read())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    assert {m for m in imported if m.startswith("sglang")} == set(scenario_zygote.PRELOAD)


@pytest.fixture
def mods(tmp_path):
    """A directory of small modules for a zygote's preload, and an environment that finds them."""
    (tmp_path / "zy_reads.py").write_text(
        "import ctypes, os, sys\n"
        "READ = os.environ.get('ZY_PY')\n"
        "NATIVE = ctypes.CDLL(None).getenv(b'ZY_C')\n"
        "print('imported zy_reads', file=sys.stderr)\n"
        "os.environ['ZY_SET'] = 'set at import'\n")
    (tmp_path / "zy_ours.py").write_text(
        "import sys, types\nsys.modules['sglang_cp'] = types.ModuleType('sglang_cp')\n")
    (tmp_path / "zy_loaded.py").write_text(
        "import sys, types\nm = types.ModuleType('sglang.srt.plugins')\nm._plugins_loaded = True\n"
        "sys.modules['sglang.srt.plugins'] = m\n")
    (tmp_path / "zy_thread.py").write_text("import threading, time\n"
                                           "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    return tmp_path, dict(os.environ, PYTHONPATH=str(tmp_path), ZY_PY="a", ZY_C="b", ZY_OTHER="c")


def run(z, code, env, cwd):
    return z.run("code", code, ["-c"], env, str(cwd), 60)


def test_a_job_forks_only_where_the_imports_read_the_same_environment(mods):
    where, env = mods
    z = Zygote(env, preload=("zy_reads",))
    try:
        assert {"ZY_PY", "ZY_C", "PYTHONPATH", "PYTHONHASHSEED"} <= set(z.info["read"])  # Python, native, start-up
        assert "ZY_OTHER" not in z.info["read"] and not z.info["all_read"]
        job = "import os, zy_reads; print(os.environ['ZY_SET'], zy_reads.READ)"
        code, out, err = run(z, job, dict(env, ZY_OTHER="changed"), where)
        assert (code, out, err) == (0, b"set at import a\n", b"imported zy_reads\n")  # as a fresh run prints
        for changed in ({"ZY_PY": "x"}, {"ZY_C": "x"}, {"PYTHONHASHSEED": "1"}, {"LC_ALL": "C"}):
            how, why = run(z, job, dict(env, **changed), where)
            assert how == "fresh" and next(iter(changed)) in why, (changed, why)
        assert run(z, "import os; os.environ['ZY_OTHER'] = 'x'; os.environ['ZY_PY'] = 'a'", env, where)[0] == 0
        with pytest.raises(ZygoteError, match="the job sets ZY_PY='changed', which upstream's modules read"):
            run(z, "import os; os.environ['ZY_PY'] = 'changed'", env, where)  # as if before importing them
        shadow = where / "shadow"
        (shadow / "zy_reads").mkdir(parents=True)
        (shadow / "zy_reads" / "__init__.py").write_text("")
        how, why = run(z, job, env, shadow)  # a -c job imports from its working directory first
        assert how == "fresh" and "shadow" in why
    finally:
        z.close()


def test_a_program_that_sets_a_variable_before_its_imports_says_so_and_must_set_it(mods):
    """sets_env: the job's program sets ZY_PY (os.environ.setdefault) before importing what reads it: it may
    fork from a zygote that imported under that value, and the child checks that the program set it."""
    where, env = mods
    z = Zygote(env, preload=("zy_reads",))
    try:
        bare = {k: v for k, v in env.items() if k != "ZY_PY"}
        job = "import os; os.environ.setdefault('ZY_PY', 'a'); import zy_reads; print(zy_reads.READ)"
        assert z.run("code", job, ["-c"], bare, str(where), 60)[0] == "fresh"  # undeclared: another value
        assert z.run("code", job, ["-c"], bare, str(where), 60, sets={"ZY_PY": "a"})[:2] == (0, b"a\n")
        with pytest.raises(ZygoteError, match="declared to set {'ZY_PY': 'a'}"):
            z.run("code", "pass", ["-c"], bare, str(where), 60, sets={"ZY_PY": "a"})
    finally:
        z.close()


def test_a_reader_of_the_whole_environment_makes_every_variable_count(mods):
    where, env = mods
    (where / "zy_all.py").write_text("import os\nSNAPSHOT = dict(os.environ)\n")
    z = Zygote(env, preload=("zy_all",))
    try:
        assert z.info["all_read"] and "zy_all.py" in z.info["unknown_readers"][0]
        assert run(z, "pass", env, where) == (0, b"", b"")
        how, why = run(z, "pass", dict(env, ZY_OTHER="changed"), where)
        assert how == "fresh" and "ZY_OTHER" in why
    finally:
        z.close()


@pytest.mark.parametrize("module, refusal", [("zy_ours", "sglang_cp is imported in the zygote"),
                                             ("zy_loaded", "load_plugins() has run in the zygote"),
                                             ("zy_thread", "runs 2 Python threads")])
def test_the_zygote_refuses_to_fork_after_our_plugin_plugin_loading_or_a_thread(mods, module, refusal):
    where, env = mods
    z = Zygote(env, preload=(module,))
    try:
        assert refusal in z.info["refusal"]
        with pytest.raises(ZygoteError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
            run(z, "pass", env, where)
    finally:
        z.close()


def test_a_hung_job_is_killed_and_reported(mods):
    import subprocess

    where, env = mods
    z = Zygote(env, preload=("json",))
    try:
        with pytest.raises(subprocess.TimeoutExpired) as e:
            z.run("code", "import sys, time; print('started', flush=True); time.sleep(600)", ["-c"], env, str(where), 3)
        assert e.value.output == b"started\n"
        assert run(z, "print('next')", env, where) == (0, b"next\n", b"")  # the zygote serves on
    finally:
        z.close()


@pytest.mark.parametrize("plant", ["open mode", "a link"])
def test_the_getenv_tracer_is_built_only_in_a_private_directory(tmp_path, monkeypatch, plant):
    """Every zygote LD_PRELOADs the tracer: a directory under the shared temp directory that another user could
    have made (group/other-writable) or pointed elsewhere (a link) is refused, never built into or loaded from."""
    home = tmp_path / f"sglang-cp-test-{os.getuid()}"
    if plant == "open mode":
        home.mkdir()
        home.chmod(0o777)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        home.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(scenario_zygote.tempfile, "gettempdir", lambda: str(tmp_path))
    with pytest.raises(ZygoteError, match="not a private directory of this user"):
        scenario_zygote._shim()
    assert not list(tmp_path.rglob("*.so"))  # nothing built there either
