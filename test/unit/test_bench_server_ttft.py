"""bench_server_ttft's accounting, on a result shaped like a real run's: a row counts only
requests whose cache came from the path it names, and the restore rate subtracts the
compute floor of the same prompt."""

import importlib.util
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "bench_server_ttft", os.path.join(HERE, "..", "..", "benchmark", "hicache", "bench_server_ttft.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


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
    from sglang_cp.server_process import GenResult

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
