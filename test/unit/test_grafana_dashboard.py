"""docs/grafana/sglang-cp.json queries only metrics that exist, and shows all of ours.

"Exist" means: one of ours (``sglang_cp.metrics.metric_names()``, and present in the real
exposition of a collector fed by a real L3 store's stats, with the ``cp_rank`` label the
panels group by), or one that the pinned sglang registers (found in its source).
"""

import json
import os
import re

import sglang
from prometheus_client import CollectorRegistry, generate_latest

from sglang_cp.metrics import CpL3MetricsCollector, metric_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASH = os.path.join(REPO, "docs", "grafana", "sglang-cp.json")
METRIC = re.compile(r"sglang:[A-Za-z0-9_]+")


def _queries(dash):
    for p in dash["panels"]:
        for t in p.get("targets", []):
            yield p["title"], t["expr"]
    for v in dash.get("templating", {}).get("list", []):
        if isinstance(v.get("query"), str) and "sglang:" in v["query"]:
            yield "variable " + v["name"], v["query"]


def _upstream_metric_names():
    root = os.path.dirname(sglang.__file__)
    names = set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), errors="ignore") as fh:
                    names |= set(re.findall(r'name="(sglang:[A-Za-z0-9_]+)"', fh.read()))
    return names


def _exposed_by_a_real_store(tmp_path):
    from sglang_cp.cli import write_demo_config
    from sglang_cp.l3 import L3Store, load_l3_config

    cfg = load_l3_config(write_demo_config(str(tmp_path / "l3"), capacity_gb=0.05))
    with L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": 8192}) as s:
        s.write_pages("kv", [b"a"], [bytes(8192)], timeout=60)
        stats = s.stats()
    stats["prefetch_outcomes"] = {"issued": 0.0}  # what the backend adds from upstream's snapshot (prefetch_outcomes.py)
    reg = CollectorRegistry()
    CpL3MetricsCollector({"cp_rank": "0", "tp_rank": "0", "pp_rank": "0"}, registry=reg).update(stats)
    text = generate_latest(reg).decode()
    return {m.split("{")[0].removesuffix("_created") for m in text.splitlines()
            if m.startswith("sglang:") and 'cp_rank="0"' in m}


def test_dashboard_is_valid_grafana_json():
    with open(DASH) as f:
        dash = json.load(f)
    assert dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["targets"], p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])


def test_every_queried_metric_is_exported_and_all_of_ours_are_shown(disk_tmp):
    with open(DASH) as f:
        dash = json.load(f)
    queried = {}
    for where, expr in _queries(dash):
        for name in METRIC.findall(expr):
            queried.setdefault(name, where)
    ours = set(metric_names())
    upstream = _upstream_metric_names()
    unknown = {n: w for n, w in queried.items() if n not in ours and n not in upstream}
    assert not unknown, f"dashboard queries metrics nobody exports: {unknown}"
    assert ours <= set(queried), f"our metrics missing from the dashboard: {sorted(ours - set(queried))}"
    exposed = _exposed_by_a_real_store(disk_tmp)
    # Counters appear with their _total suffix in the exposition; names are the full names.
    missing = {n for n in queried if n in ours and n not in exposed}
    assert not missing, f"not in a real collector's exposition with cp_rank: {missing}"
