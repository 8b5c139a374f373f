"""benchmark.support.pd_pair against two real HTTP processes standing in for the prefill and decode workers (a real
PD pair needs two GPUs and a transfer engine): both halves of a request are in flight at once with one
bootstrap room, the answer is the decode worker's ids with the prefill worker's cache details, and a failed
half names its worker."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmark.support.pd_pair import PdPair, decode_args, pd_generate, sharded_prefill_args
from benchmark.support.server_process import ServerProcess

# A worker stand-in: records each /generate body; the prefill one answers only once the decode half has
# arrived (as a real prefill worker waits for its decode peer's bootstrap), so halves sent one after the
# other would time out instead of passing.
WORKER = r"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
role, d, status = sys.argv[1], sys.argv[2], int(sys.argv[3])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.path.join(d, role + ".json"), "w") as f:
            json.dump(body, f)
        if role == "prefill":
            deadline = time.monotonic() + 5
            while not os.path.exists(os.path.join(d, "decode.json")) and time.monotonic() < deadline:
                time.sleep(0.01)
            paired = os.path.exists(os.path.join(d, "decode.json"))
            out = {"output_ids": [1], "meta_info": {"cached_tokens_details": {"storage": 128 if paired else -1}}}
        else:
            out = {"output_ids": [7, 8], "meta_info": {"completion_tokens": 2}}
        raw = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


@pytest.fixture
def workers(tmp_path):
    procs = []

    def start(role, status=200):
        p = subprocess.Popen([sys.executable, "-c", WORKER, role, str(tmp_path), str(status)], stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        return ServerProcess("unused-model", port=int(p.stdout.readline()))

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


def test_both_halves_in_flight_with_one_room_and_the_pairs_answer(workers, tmp_path):
    pair = PdPair(workers("prefill"), workers("decode"), bootstrap_port=4321)
    r = pair.generate([5, 6, 7], 2, timeout_s=30)
    assert r.output_ids == [7, 8]                                # the decode worker answers the client
    assert r.storage_tokens == 128                               # the prefill worker saw its decode peer
    assert r.meta_info["decode_meta_info"] == {"completion_tokens": 2}
    assert r.meta_info["prefill_latency_s"] > 0 and r.sent_at is not None
    p, d = (json.load(open(tmp_path / f"{k}.json")) for k in ("prefill", "decode"))
    assert p["bootstrap_room"] == d["bootstrap_room"]
    assert (p["bootstrap_host"], p["bootstrap_port"]) == (d["bootstrap_host"], d["bootstrap_port"]) == ("127.0.0.1", 4321)
    assert p["input_ids"] == d["input_ids"] == [5, 6, 7]
    again = pd_generate(pair.prefill, pair.decode, 4321, [5], 1, timeout_s=30)
    assert json.load(open(tmp_path / "prefill.json"))["bootstrap_room"] != p["bootstrap_room"]  # a room per request
    assert [x.output_ids for x in again] == [[1], [7, 8]]


def test_a_failed_half_names_its_worker(workers):
    prefill, decode = workers("prefill"), workers("decode", status=500)
    with pytest.raises(RuntimeError, match=rf"failed on the decode worker \({decode.url}\).*HTTP 500"):
        pd_generate(prefill, decode, 4321, [1, 2], 1, timeout_s=30)


def test_flag_sets_are_upstreams_sharded_prefill_and_decode():
    args = sharded_prefill_args(2, 9000)
    for flag in ("--enable-prefill-cp", "--enable-kv-cache-sharding"):
        assert flag in args
    value = {f: args[args.index(f) + 1] for f in ("--tp", "--attn-cp-size", "--disaggregation-bootstrap-port",
                                                  "--disaggregation-mode", "--disaggregation-transfer-backend")}
    assert value == {"--tp": "2", "--attn-cp-size": "2", "--disaggregation-bootstrap-port": "9000",
                     "--disaggregation-mode": "prefill", "--disaggregation-transfer-backend": "nixl"}
    assert decode_args(2)[-4:] == ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"]
    with pytest.raises(ValueError, match="cp must be >= 2"):
        sharded_prefill_args(1, 9000)
