"""002#16 / 002#40 (replicated backup-pending marker): in the fork, CP ranks
skipped the writing_check MIN all-reduce when their LOCAL ack queue was empty,
so a strict subset of ranks entered the collective and the next broadcast on the
same group deadlocked. Upstream 0.5.23's UnifiedRadixCache.writing_check enters
the all-reduce on every call and drains min(ready) acks on every rank. Two real
processes over gloo, with ack queues of different lengths per round, must both
finish every round and drain identical counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import gloo_rendezvous

HERE = os.path.dirname(os.path.abspath(__file__))


def test_writing_check_enters_the_collective_on_every_rank_and_drains_the_min(tmp_path):
    rendezvous = gloo_rendezvous(tmp_path)
    # acks arriving per round on each rank: rank 1 lags, then catches up
    schedule = {0: [1, 0, 2, 0, 0], 1: [0, 0, 1, 2, 0]}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_writing_check_rank.py"), str(r), "2",
             rendezvous, json.dumps(schedule[r])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for r in (0, 1)
    ]
    results = {}
    try:
        for p in procs:
            # hang guard only: a rank-divergent collective never returns
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, f"rc={p.returncode}\nstdout: {out[-2000:]}\nstderr: {err[-3000:]}"
            line = [l for l in out.splitlines() if l.startswith("RANK_RESULT ")][-1]
            r = json.loads(line.split(" ", 1)[1])
            results[r["rank"]] = r["drained"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    # queue lengths after each arrival: r0 1,1,3,3,3 ; r1 0,0,1,3,3 -> MIN ready
    assert results[0] == results[1] == [0, 0, 1, 2, 0]
