"""sglang_cp.server_process against the real launcher, on CPU: a server that cannot start
is reported with its own error, promptly, and leaves no process behind."""

from __future__ import annotations

import os
import time

import pytest

from sglang_cp.server_process import ServerProcess, ServerStartError, parse_metrics

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "models", "tiny-dsv3")


def test_a_server_that_exits_at_startup_raises_with_its_error(tmp_path):
    srv = ServerProcess(MODEL, ["--cp-l3-cold-start", "sometimes"], log_path=str(tmp_path / "s.log"),
                        startup_timeout_s=300)
    t = time.monotonic()
    with pytest.raises(ServerStartError) as e:
        srv.start()
    assert time.monotonic() - t < 300
    assert "--cp-l3-cold-start" in str(e.value) and "invalid choice" in str(e.value)
    assert srv.proc.returncode not in (None, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.proc.pid, 0)  # the whole process group is gone


def test_parse_metrics_sums_label_sets_and_skips_comments():
    text = ('# HELP sglang:cp_l3_spill_pages_total x\n# TYPE sglang:cp_l3_spill_pages_total counter\n'
            'sglang:cp_l3_spill_pages_total{cp_rank="0",tp_rank="0"} 40.0\n'
            'sglang:cp_l3_spill_pages_total{cp_rank="1",tp_rank="0"} 23.0\n'
            'sglang:cp_l3_used_slots{payload="kv"} 7\n')
    m = parse_metrics(text)
    assert m["sglang:cp_l3_spill_pages_total"] == 63.0 and m["sglang:cp_l3_used_slots"] == 7.0


def test_parse_metrics_by_label():
    text = ('sglang:cp_l3_used_slots{cp_rank="0",payload="kv"} 32\n'
            'sglang:cp_l3_used_slots{cp_rank="1",payload="kv"} 31\n'
            'sglang:cp_l3_used_slots{cp_rank="1",payload="ix"} 1\n'
            'sglang:num_requests_total 5\n')
    m = parse_metrics(text, by_label="cp_rank")
    assert m == {"sglang:cp_l3_used_slots": {"0": 32.0, "1": 32.0}}
