"""examples/launch_*.sh: the single-GPU line (README's minimal launch), the PD-disaggregated CP
prefill (with --enable-cp-l3) and decode (without) command lines, each parsed and resolved by
SGLang's own parser with our plugin (``sglang_cp.cli.parse_launch_args``, what check-args runs) in a
fresh process, with the L3 config validated by our loader. Only the model path (hub/local weights)
and machine paths are substituted; the single-GPU line gets a real MLA config.json (no weights)."""

import json
import os
import re
import shlex

import pytest

from sglang_cp.check_args import OFFLINE_ENV
from suite_helpers import REPO, py_job, run_all

EXAMPLES = os.path.join(REPO, "examples")


def launch_argv(script: str, env: dict) -> list[str]:
    """The launch_server arguments of ``script``: its `exec python -m sglang.launch_server`
    line with continuations, variables expanded from ``env`` (every variable must be known)."""
    text = open(os.path.join(EXAMPLES, script)).read()
    m = re.search(r"^exec python -m sglang\.launch_server((?:.*\\\n)*.*)$", text, re.M)
    assert m, f"{script}: no 'exec python -m sglang.launch_server' command"
    cmd = m.group(1).replace("\\\n", " ")
    cmd = cmd.replace(' "$@"', "")  # what the caller appends
    used = set(re.findall(r"\$\{?([A-Z0-9_]+)", cmd))
    assert used <= set(env), f"{script}: unknown variables {used - set(env)}"
    for k, v in env.items():
        cmd = cmd.replace(f'"${k}"', shlex.quote(v)).replace(f"${k}", shlex.quote(v))
    for k in used:  # each has a default in the script
        assert re.search(rf"^{k}=\$\{{{k}:-", text, re.M), f"{script}: {k} has no default"
    return shlex.split(cmd)


def _l3_config(disk_tmp):
    text = open(os.path.join(EXAMPLES, "l3.single-nvme.toml")).read()
    root = disk_tmp / "nvme0"
    (root / "sglang-cp" / "index").mkdir(parents=True, exist_ok=True)
    text = text.replace("/nvme0/", f"{root}/").replace('plp_policy = "warn"', 'plp_policy = "ignore"')
    path = disk_tmp / "l3.toml"
    path.write_text(text)
    return str(path)


# As check-args: parse_launch_args first (it sets OFFLINE_ENV before anything imports sglang), then upstream.
PARSE = """
import json, sys
from sglang_cp.cli import parse_launch_args
sa = parse_launch_args(json.loads(sys.argv[1] if len(sys.argv) > 1 else {argv!r}))
from sglang.srt.arg_groups.overrides import resolved_view
c = resolved_view(sa)
keys = ("tp_size", "attn_cp_size", "enable_prefill_cp", "enable_kv_cache_sharding", "disaggregation_mode",
        "enable_hierarchical_cache", "hicache_storage_backend", "enable_cp_l3", "cp_l3_config",
        "cp_l3_cold_start", "enable_cp_shared_physical_l2_hicache", "page_size", "enable_metrics")
print("RESULT " + json.dumps({{k: getattr(c, k, getattr(sa, k, None)) for k in keys}}))
"""


def _parse_job(argv):
    cmd, kw = py_job(PARSE.format(argv=json.dumps(argv)))
    return cmd, {**kw, "sets_env": OFFLINE_ENV}  # suite_helpers.run_job: parse_launch_args sets them first


def _result(p):
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each example's command line parsed in its own fresh interpreter, all of them at once."""
    disk = tmp_path_factory.mktemp("disk")
    cfg = _l3_config(disk)
    huge = disk / "hugetlbfs"  # the flag only needs the directory at parse time
    huge.mkdir()
    bad = disk / "bad.toml"
    bad.write_text(open(cfg).read().replace("low_watermark = 0.85", "low_watermark = 0.95"))
    model = os.path.join(REPO, "test", "gpu", "models", "tiny-dsv3")  # DeepseekV3 (MLA) config.json
    runs = run_all({
        "prefill": _parse_job(launch_argv("launch_prefill_cp_l3.sh", {"MODEL": "dummy", "L3_CONFIG": cfg,
                                                                     "HUGETLBFS": str(huge)})),
        "decode": _parse_job(launch_argv("launch_decode.sh", {"MODEL": "dummy"})),
        "prefill_bad": _parse_job(launch_argv("launch_prefill_cp_l3.sh", {"MODEL": "dummy", "L3_CONFIG": str(bad),
                                                                         "HUGETLBFS": str(huge)})),
        "single": _parse_job(launch_argv("launch_single_gpu_l3.sh", {"MODEL": model, "L3_CONFIG": cfg})),
    }, timeout=300)
    runs["cfg"] = cfg
    return runs


def test_prefill_cp_l3_example_parses_and_selects_our_l3(runs):
    r = _result(runs["prefill"])
    assert r["disaggregation_mode"] == "prefill"
    assert r["enable_prefill_cp"] and r["enable_kv_cache_sharding"] and r["attn_cp_size"] == r["tp_size"] == 8
    assert r["enable_cp_l3"] and r["cp_l3_config"] == runs["cfg"] and r["cp_l3_cold_start"] == "load"
    assert r["hicache_storage_backend"] == "dynamic"  # ours, selected by --enable-cp-l3
    assert r["enable_cp_shared_physical_l2_hicache"] and r["page_size"] == 64


def test_decode_example_parses_without_l3(runs):
    r = _result(runs["decode"])
    assert r["disaggregation_mode"] == "decode"
    assert not r["enable_cp_l3"] and r["hicache_storage_backend"] is None
    assert r["tp_size"] == 8 and r["page_size"] == 64


def test_prefill_example_with_a_bad_l3_config_is_rejected_naming_the_field(runs):
    p = runs["prefill_bad"]
    assert p.returncode != 0 and "gc.low_watermark" in p.stderr


def test_single_gpu_example_resolves_on_this_cpu_box_as_for_a_gpu(runs):
    r = _result(runs["single"])
    assert r["enable_cp_l3"] and r["cp_l3_config"] == runs["cfg"] and r["cp_l3_cold_start"] == "load"
    assert r["enable_hierarchical_cache"] and r["hicache_storage_backend"] == "dynamic"
    assert r["page_size"] == 64 and r["enable_metrics"] and r["tp_size"] == 1
    assert not r["enable_prefill_cp"] and not r["enable_kv_cache_sharding"]


@pytest.mark.parametrize("script", ["launch_single_gpu_l3.sh", "launch_prefill_cp_l3.sh", "launch_decode.sh"])
def test_scripts_are_valid_bash(script):
    import subprocess

    assert subprocess.run(["bash", "-n", os.path.join(EXAMPLES, script)]).returncode == 0
