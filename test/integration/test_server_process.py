"""benchmark.support.server_process against the real launcher, on CPU: a server that cannot start
is reported with its own error, promptly, and leaves no process behind."""

from __future__ import annotations

import os
import re
import time

import pytest

from benchmark.support.server_process import ServerProcess, ServerStartError, parse_metrics

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "models", "tiny-dsv3")


def test_a_server_that_exits_at_startup_raises_with_its_error(tmp_path):
    srv = ServerProcess(MODEL, ["--cp-l3-cold-start", "sometimes"], log_path=str(tmp_path / "s.log"),
                        startup_timeout_s=300)
    t = time.monotonic()
    with pytest.raises(ServerStartError) as e:
        srv.start()
    assert time.monotonic() - t < 300
    # our flag's own one-line error (args.py), not argparse's usage dump
    assert "--cp-l3-cold-start must be one of clear, load, verify; got 'sometimes'" in str(e.value)
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


def test_server_dies_with_the_process_that_started_it(tmp_path):
    """A test runner killed by its own timeout must not leave a server behind (on a GPU box
    it would hold the GPU and the next server fails its memory-balance check)."""
    import signal
    import subprocess
    import sys

    from benchmark.support.server_process import group_alive

    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from benchmark.support.server_process import ServerProcess\n"
        f"s = ServerProcess({MODEL!r}, log_path={str(tmp_path / 's.log')!r}).spawn()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert group_alive(pid)  # the launcher is still importing sglang (seconds)
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 10
        while group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = group_alive(pid)
    finally:
        parent.kill()
    if alive:
        os.killpg(pid, signal.SIGKILL)
    assert not alive, "the launcher outlived the process that started it"


def test_a_start_failure_reports_the_first_error_not_only_the_shutdown_noise(tmp_path):
    """A scheduler that dies at startup is followed by the launcher's own teardown lines: the report
    must carry the cause (the first traceback), which the log's last lines no longer show."""
    from benchmark.support.server_process import first_error

    log = tmp_path / "s.log"
    cause = ["[2026-12-01 10:00:01] Scheduler hit an exception: Traceback (most recent call last):",
             '  File "scheduler.py", line 12, in run', "torch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB"]
    noise = [f"[2026-12-01 10:00:02] Ignore import error when loading sglang.srt.models.m{i}: No module"
             for i in range(3)] + [f"[2026-12-01 10:00:03] shutting down child {i}" for i in range(80)]
    log.write_text("\n".join(noise[:3] + ["server_args=..."] + cause + noise[3:]) + "\n")
    srv = ServerProcess(MODEL, log_path=str(log))
    report = srv.failure_report()
    assert "CUDA out of memory" in report and "Traceback" in report
    assert "Ignore import error" not in first_error(log.read_text())
    assert "CUDA out of memory" not in srv.log_tail(40)  # what the old report showed


def _one_stream(body: bytes, chunked: bool) -> int:
    """A one-request HTTP server that answers with ``body`` as an event stream, then closes the socket
    (chunked: one chunk and no terminating zero chunk, as when the server process is killed)."""
    import socket
    import threading

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)

    def answer():
        c, _ = s.accept()
        req = b""
        while b"\r\n\r\n" not in req:  # the whole request first: unread bytes at close would reset it
            req += c.recv(1 << 16)
        head, rest = req.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
        while len(rest) < length:
            rest += c.recv(1 << 16)
        if chunked:
            c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                      + b"%x\r\n%s\r\n" % (len(body), body))
        else:
            c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nConnection: close\r\n\r\n" + body)
        c.close()
        s.close()

    threading.Thread(target=answer, daemon=True).start()
    return s.getsockname()[1]


CHUNK = b'data: {"output_ids": [1567], "meta_info": {"finish_reason": null}}\n\n'


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "close-delimited"])
def test_a_stream_cut_before_done_is_an_error_not_an_answer(chunked):
    # urllib ends a cut stream cleanly in both framings; a killed server's first token must not count as its answer
    srv = ServerProcess(MODEL, port=_one_stream(CHUNK, chunked))
    with pytest.raises(ConnectionError, match=r"ended after 1 chunk\(s\) without its \[DONE\]"):
        srv.generate_stream([1, 2, 3], max_new_tokens=16, timeout_s=10)


def test_a_stream_with_done_is_the_answer():
    done = b'data: {"output_ids": [1567, 1567], "meta_info": {"finish_reason": {"type": "length"}}}\n\ndata: [DONE]\n\n'
    srv = ServerProcess(MODEL, port=_one_stream(CHUNK + done, chunked=False))
    res = srv.generate_stream([1, 2, 3], max_new_tokens=2, timeout_s=10)
    assert res.output_ids == [1567, 1567] and res.ttft_s is not None


def test_generate_stamps_its_send_time_in_the_clock_of_upstreams_time_stats():
    # upstream's meta_info times (forward_entry_time, prefill_finished_time) are wall clock; so is sent_at
    body = b'{"output_ids": [5], "meta_info": {"forward_entry_time": 1.0}}'
    srv = ServerProcess(MODEL, port=_one_stream(body, chunked=False))
    before = time.time()
    res = srv.generate([1, 2, 3], max_new_tokens=1, timeout_s=10)
    assert before <= res.sent_at <= time.time() and res.output_ids == [5]
    assert res.meta_info["forward_entry_time"] == 1.0
