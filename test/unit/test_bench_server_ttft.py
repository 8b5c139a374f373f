"""bench_server_ttft's accounting, on a result shaped like a real run's: a row counts only
requests whose cache came from the path it names, and the restore rate subtracts the
compute floor of the same prompt."""

import json

from benchmark.hicache import bench_server_ttft as bench


def _run():
    L, cached = 8192, 8128
    rows = {"recompute": [], "l2": [], "l3": [], "device": []}
    for i, t in enumerate((0.40, 0.39, 0.41)):
        rows["recompute"].append({"tokens": L, "ttft_s": t, "first_token": 7, "device": 0, "host": 0, "storage": 0})
    rows["l2"] += [{"tokens": L, "ttft_s": 0.10, "first_token": 7, "device": 0, "host": cached, "storage": 0},
                   {"tokens": L, "ttft_s": 0.05, "first_token": 7, "device": cached, "host": 0, "storage": 0}]
    for t in (0.22, 0.23, 0.25):
        rows["l3"].append({"tokens": L, "ttft_s": t, "first_token": 7, "device": 0, "host": 0,
                           "storage": cached, "reload_bytes": 0.3e9, "read_s": 0.1, "hitq_s": 0.01})
        rows["device"].append({"tokens": L, "ttft_s": 0.07, "first_token": 7, "device": cached, "host": 0,
                               "storage": 0})
    return {"model": "m", "lengths": [L], "reps": 3, "rows": rows,
            "raw": [{"read_gbps": 2.0, "write_gbps": 2.0}, {"read_gbps": 1.0, "write_gbps": 1.0}]}


def test_summary_counts_only_requests_served_from_the_named_path():
    (row,) = bench.summarize(_run())
    assert row["l2"]["n"] == 1 and row["l2"]["median"] == 0.10  # the device hit is not an L2 hit
    assert row["recompute"]["median"] == 0.40 and row["l3"]["median"] == 0.23
    assert abs(row["restore_gbps"]["median"] - 0.3 / 0.16) < 1e-9  # bytes / (restore - device floor)
    assert abs(row["restore_x_raw"] - (0.3 / 0.16) / 1.5) < 1e-9  # raw = mean of the two probes
    assert row["same_first_token"] is True
    # the store's own share: its read rate, and what is left of (restore - device hit) outside it
    assert abs(row["store_read_gbps"]["median"] - 3.0) < 1e-9 and abs(row["store_x_raw"] - 2.0) < 1e-9
    assert abs(row["outside_store_s"]["median"] - (0.23 - 0.07 - 0.1 - 0.01)) < 1e-9


def test_report_merges_runs_into_table_json_and_plot(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"runs": [_run()]}))
    assert bench.main(["report", str(a), "--out-dir", str(tmp_path / "out")]) == 0
    out = json.loads((tmp_path / "out" / "ttft.json").read_text())
    assert out["summary"][0]["tokens"] == 8192
    assert (tmp_path / "out" / "ttft.png").stat().st_size > 10_000
    assert "| m | 8,192 |" in (tmp_path / "out" / "ttft.md").read_text()


def test_dsa_models_count_the_indexer_row_and_get_dsa_flags():
    glm5, dsa = bench.MODELS["glm5"], bench.MODELS["glm5-dsa"]
    assert bench.kv_bytes_per_token(glm5) == 78 * 2 * (512 + 64)
    assert bench.kv_bytes_per_token(dsa) == 78 * (2 * (512 + 64) + 128 + 4)
    assert bench.is_dsa(dsa) and not bench.is_dsa(glm5)
    args = bench.main.__globals__["argparse"].Namespace(dsa_prefill_backend="fa3", dsa_decode_backend="fa3")
    flags, env = bench.dsa_server(args)
    assert flags == ["--dsa-prefill-backend", "fa3", "--dsa-decode-backend", "fa3"]
    assert env.get("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH") == "1"  # no DeepGEMM on a CPU box


def test_restore_stages_from_upstreams_time_stats():
    """Upstream's per-request time stats (meta_info under --enable-metrics, wall clock) split a request:
    arrival -> forward start (of it the prefetch wait), the forward, the rest; the summary sets the
    restore's stages beside the device hit's, and the report prints them under the main table."""
    from benchmark.support.server_process import GenResult

    meta = {"request_received_ts": 100.010, "forward_entry_time": 100.090, "prefill_finished_time": 100.200,
            "storage_prefetch_wait": 0.055, "queue_time": 0.07}
    st = bench.request_stages(GenResult(output_ids=[7], meta_info=meta, latency_s=0.230, sent_at=100.000))
    assert abs(st["to_forward_s"] - 0.080) < 1e-9 and abs(st["forward_s"] - 0.110) < 1e-9
    assert st["prefetch_wait_s"] == 0.055 and abs(st["after_forward_s"] - 0.030) < 1e-9
    # no time stats (a server without --enable-metrics): no stages, and no table
    assert bench.request_stages(GenResult(output_ids=[7], meta_info={}, latency_s=0.2, sent_at=1.0)) == {}
    run = _run()
    assert bench.stages_table(bench.summarize(run)) == ""
    for r in run["rows"]["l3"]:
        r.update(to_forward_s=0.12, prefetch_wait_s=0.09, forward_s=0.09, after_forward_s=0.01)
    for r in run["rows"]["device"]:
        r.update(to_forward_s=0.01, prefetch_wait_s=None, forward_s=0.05, after_forward_s=0.01)
    (row,) = bench.summarize(run)
    assert row["stages"]["l3"]["to_forward_s"]["median"] == 0.12 and row["stages"]["device"]["prefetch_wait_s"] is None
    table = bench.stages_table([row])
    assert "| m | 8,192 | L3 restore | 0.120 (0.120-0.120) | 0.090 (0.090-0.090) | 0.100 (0.100-0.100) |" in table
    assert "| m | 8,192 | device hit | 0.010 (0.010-0.010) | - | - | 0.050 (0.050-0.050) |" in table
    # and the run's log line per restore
    assert bench.stage_line(run["rows"]["l3"][0]) == ("to forward 120.0 (prefetch wait 90.0, store reads 100.0), "
                                                      "forward 90.0, after 10.0 ms")


def _metrics(**per_rank):
    """/metrics text with the store's counters per CP rank: rank=(bytes, read_s, calls, hitq_s)."""
    names = ("reload_bytes_total", "read_seconds_total", "read_calls_total", "hit_query_seconds_total")
    return "".join(f'sglang:cp_l3_{n}{{cp_rank="{rank[1:]}",pp_rank="0",tp_rank="{rank[1:]}"}} {v}\n'
                   for rank, vals in per_rank.items() for n, v in zip(names, vals))


def test_store_deltas_sum_bytes_over_ranks_and_take_the_slowest_ranks_seconds():
    before = _metrics(r0=(1e9, 1.0, 10, 0.1), r1=(1e9, 2.0, 10, 0.1))
    after = _metrics(r0=(1.5e9, 1.2, 12, 0.11), r1=(1.4e9, 2.5, 13, 0.13))
    d = bench.store_deltas(before, after)
    assert abs(d["reload_bytes"] - 0.9e9) < 1 and d["read_calls"] == 5  # both ranks' pages, both ranks' calls
    assert abs(d["read_s"] - 0.5) < 1e-9 and abs(d["hitq_s"] - 0.03) < 1e-9  # rank 1: the ranks read side by side
    one = bench.store_deltas(_metrics(r0=(0, 0, 0, 0)), _metrics(r0=(2e9, 0.4, 3, 0.02)))
    assert (one["reload_bytes"], one["read_s"], one["read_calls"]) == (2e9, 0.4, 3)  # one rank: plain deltas


def test_pd_cp_servers_are_pairs_with_the_sharded_prefill_flags_and_refusals(tmp_path):
    import argparse

    import pytest

    from benchmark.support.pd_pair import PdPair
    from benchmark.support.server_process import ServerProcess

    def ns(**kw):
        base = dict(pd_cp=2, profile=False, mem_fraction=None, pd_decode_mem_fraction=0.3,
                    pd_transfer_backend="nixl", out_dir=str(tmp_path), decode_load=0, decode_load_tokens=256)
        return argparse.Namespace(**{**base, **kw})

    args = ns()
    bench.check_pd_args(args)
    assert args.mem_fraction == 0.5  # the PD default: both workers share the GPUs
    common = dict(mem_fraction_static=0.5, context_length=9000, max_total_tokens=12000)
    l3 = ["--enable-cp-l3", "--cp-l3-config", "l3.toml"]
    pair = bench.make_server("m", "m-A", ["--kv-cache-dtype", "bf16", *l3], ["--kv-cache-dtype", "bf16"],
                             common, args, ServerProcess)
    assert isinstance(pair, PdPair)
    pf, dc = pair.prefill.command(), pair.decode.command()
    assert "--enable-kv-cache-sharding" in pf and "--enable-cp-l3" in pf
    assert pf[pf.index("--disaggregation-bootstrap-port") + 1] == str(pair.bootstrap_port)
    assert "--enable-cp-l3" not in dc and dc[dc.index("--disaggregation-mode") + 1] == "decode"
    assert dc[dc.index("--mem-fraction-static") + 1] == "0.3" and "--kv-cache-dtype" in dc
    plain = bench.make_server("m", "m-A", l3, [], common, ns(pd_cp=0), ServerProcess)
    assert type(plain) is ServerProcess and "--enable-kv-cache-sharding" not in plain.command()

    for bad, fix in ((dict(pd_cp=1), "at least 2 GPUs"), (dict(profile=True), "not available with --pd-cp"),
                     (dict(mem_fraction=0.7), "lower one of them"), (dict(decode_load=-1), "--decode-load -1"),
                     (dict(decode_load=2, decode_load_tokens=0), "--decode-load-tokens 0")):
        with pytest.raises(SystemExit, match=fix):
            bench.check_pd_args(ns(**bad))
    off = ns(pd_cp=0)
    bench.check_pd_args(off)
    assert off.mem_fraction == 0.8


def test_a_run_under_decode_load_is_labelled_with_it():
    run = _run()
    run["decode_load"] = {"clients": 8, "new_tokens": 256, "requests": 40, "tokens": 10240, "seconds": 9.5,
                          "tokens_per_s": 1077.9}
    (row,) = bench.summarize(run)
    assert row["model"] == "m (decode load 8)" and row["decode_load"]["tokens_per_s"] == 1077.9
    (idle,) = bench.summarize(_run())
    assert idle["model"] == "m" and idle["decode_load"] is None


def test_a_run_with_a_switch_interval_is_labelled_with_it():
    run = _run()
    run["gil_switch_interval_ms"] = 0.5
    (row,) = bench.summarize(run)
    assert row["model"] == "m (switch 0.5 ms)"


def test_the_l3_toml_carries_the_switch_interval_only_when_given(tmp_path):
    from benchmark.hicache.bench_server_ttft import write_l3_toml
    from sglang_cp.l3 import load_l3_config

    assert load_l3_config(write_l3_toml(str(tmp_path / "a"), 4.0, 8, "uring")).io.gil_switch_interval_ms == 0.0
    cfg = load_l3_config(write_l3_toml(str(tmp_path / "b"), 4.0, 8, "uring", 0.5))
    assert (cfg.io.gil_switch_interval_ms, cfg.io.read_engine) == (0.5, "uring")


class _ScriptedServer:
    """Answers like a real server would for run_model's sequence: server A recomputes a prompt, then
    serves it from its host pool; a server B started with ``--cp-l3-cold-start load`` serves a prompt's
    first send from storage and the second from the device. Spill counters report every page spilled.
    It records each server's L3 config so the test can read what that server was given."""

    started: list = []

    def __init__(self, model, flags, log_path=None, **common):
        self.flags, self.seen, self.startup_s = list(flags), set(), 1.0
        self.restoring = flags[flags.index("--cp-l3-cold-start") + 1] == "load"
        from sglang_cp.l3 import load_l3_config

        self.l3 = load_l3_config(flags[flags.index("--cp-l3-config") + 1])  # run_model removes it at the end
        self.proc = type("P", (), {"pid": __import__("os").getpid()})()

    def start(self):
        _ScriptedServer.started.append(self)
        return self

    def stop(self):
        pass

    def generate(self, ids, n, timeout_s=None):
        from benchmark.support.server_process import GenResult

        cached = (len(ids) - 1) // 64 * 64
        key, first = tuple(ids), tuple(ids) not in self.seen
        self.seen.add(key)
        where = ("storage" if first else "device") if self.restoring else (None if first else "host")
        return GenResult(output_ids=[7], latency_s=0.3 if first else 0.1,
                         meta_info={"cached_tokens_details": {where: cached} if where else {}})

    def metric_by_label(self, name, label):
        return {"kv": 1e9}

    def metrics(self):
        return {"sglang:cp_l3_reload_bytes_total": 0.0}

    def metrics_text(self):
        return ""


def test_several_switch_intervals_restore_one_servers_pages_in_one_run(tmp_path, monkeypatch):
    """--gil-switch-interval-ms 0,0.5: one server A spills, then one server B per value restores its pages
    with an L3 config carrying that value (same data directory); every value gets its own rows, labelled,
    beside server A's shared recompute and L2 rows, and one raw probe pair."""
    from sglang_cp.cachebench import rawdisk

    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    _ScriptedServer.started = []
    args = bench.main.__globals__["argparse"].Namespace(
        reps=1, work_dir=str(tmp_path / "w"), out_dir=str(tmp_path / "o"), hicache_size=4, mem_layout="page_first",
        mem_fraction=0.8, attention_backend="triton", kv_cache_dtype="", server_arg=None, io_threads=2,
        read_engine="uring", gil_switch_interval_ms=bench.switch_interval_list("0,0.5"), raw_gib=0.01, startup_timeout=5,
        spill_timeout=5, decode_load=0, decode_load_tokens=256, profile=False, pd_cp=0)
    (tmp_path / "w").mkdir()
    runs = bench.run_model("glm5", [256], args, _ScriptedServer, rawdisk)
    a, *bs = _ScriptedServer.started
    assert not a.restoring and [b.restoring for b in bs] == [True, True]
    cfgs = [s.l3 for s in _ScriptedServer.started]
    assert [c.io.gil_switch_interval_ms for c in cfgs] == [0.0, 0.0, 0.5]
    assert len({c.disks[0].path for c in cfgs}) == 1  # every B restores A's pages
    assert [r["gil_switch_interval_ms"] for r in runs] == [None, 0.5]
    assert runs[0]["rows"]["recompute"] is runs[1]["rows"]["recompute"] and runs[0]["raw"] == runs[1]["raw"]
    rows = [bench.summarize(r)[0] for r in runs]
    assert [r["model"] for r in rows] == ["glm5-shaped-78l (switch 5 ms, CPython's)", "glm5-shaped-78l (switch 0.5 ms)"]
    assert all(r["l3"]["n"] == 1 and r["device_floor"]["n"] == 1 for r in rows)


def test_the_switch_interval_list_is_checked_where_it_is_given():
    import argparse

    import pytest

    assert bench.switch_interval_list("0") == [0.0] and bench.switch_interval_list("0,0.5") == [0.0, 0.5]
    for bad in ("x", "0,0", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="e.g. 0,0.5"):
            bench.switch_interval_list(bad)
