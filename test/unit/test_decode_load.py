"""DecodeLoad (benchmark/support/decode_load.py): the load runs throughout the block, dies loud, and every
wait is bounded. The server is a function that answers like ServerProcess.generate after a delay (the real
one needs a GPU; bench_server_ttft's GPU runs use it against a real server)."""

import threading
import time
from types import SimpleNamespace

import pytest

from benchmark.support.decode_load import DecodeLoad, DecodeLoadError


def server(delay=0.01, fail_after=None):
    calls = {"n": 0, "inflight": 0, "max_inflight": 0}
    lock = threading.Lock()

    def generate(ids, n, timeout_s):
        with lock:
            calls["n"] += 1
            k = calls["n"]
            calls["inflight"] += 1
            calls["max_inflight"] = max(calls["max_inflight"], calls["inflight"])
        try:
            if fail_after is not None and k > fail_after:
                raise RuntimeError("/generate -> HTTP 500: out of memory")
            time.sleep(delay)
            return SimpleNamespace(output_ids=[7] * n)
        finally:
            with lock:
                calls["inflight"] -= 1
    return generate, calls


def test_the_load_runs_throughout_the_block_and_stops_after_it():
    generate, calls = server()
    with DecodeLoad(generate, 4, [1, 2, 3], 16, timeout_s=10) as load:
        assert calls["n"] >= 4  # every client answered before the timed requests
        time.sleep(0.2)
    assert calls["max_inflight"] == 4
    assert load.during["requests"] >= 4 and load.during["tokens"] == 16 * load.during["requests"]
    assert load.during["tokens_per_s"] > 0 and load.during["clients"] == 4
    n = calls["n"]
    time.sleep(0.1)
    assert calls["n"] == n, "a client kept sending after the block"


def test_a_client_error_during_the_block_is_raised_at_its_end():
    generate, _ = server(fail_after=6)
    with pytest.raises(DecodeLoadError, match="during the timed requests.*out of memory"):
        with DecodeLoad(generate, 2, [1], 4, timeout_s=10):
            time.sleep(0.3)


def test_a_load_that_never_answers_fails_within_its_bound():
    t = time.monotonic()
    generate, _ = server(delay=5)
    with pytest.raises(DecodeLoadError, match="within 0.3 s"):
        DecodeLoad(generate, 2, [1], 4, timeout_s=0.3).__enter__()
    assert time.monotonic() - t < 3


def test_a_load_that_fails_at_once_fails_before_the_timed_requests():
    generate, _ = server(fail_after=0)
    with pytest.raises(DecodeLoadError, match="before the timed requests"):
        with DecodeLoad(generate, 2, [1], 4, timeout_s=5):
            pytest.fail("the block ran without its load")


@pytest.mark.parametrize("clients,tokens,msg", [(0, 4, "clients"), (2, 0, "new_tokens")])
def test_bad_sizes_are_refused(clients, tokens, msg):
    with pytest.raises(ValueError, match=msg):
        DecodeLoad(lambda *a: None, clients, [1], tokens)
