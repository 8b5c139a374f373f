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
import sys

from conftest import gloo_rendezvous
from suite_helpers import run_all

HERE = os.path.dirname(os.path.abspath(__file__))


def test_writing_check_enters_the_collective_on_every_rank_and_drains_the_min(tmp_path):
    rendezvous = gloo_rendezvous(tmp_path)
    # acks arriving per round on each rank: rank 1 lags, then catches up
    schedule = {0: [1, 0, 2, 0, 0], 1: [0, 0, 1, 2, 0]}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    # both ranks at once (suite_helpers.run_all: fresh interpreters of the rank script, forked from the suite's
    # zygote; gloo is initialised in the rank process only); the timeout is the hang guard only: a
    # rank-divergent collective never returns
    runs = run_all({r: ([sys.executable, os.path.join(HERE, "_writing_check_rank.py"), str(r), "2",
                         rendezvous, json.dumps(schedule[r])], {"env": env}) for r in (0, 1)},
                   workers=2, timeout=240)
    results = {}
    for p in runs.values():
        assert p.returncode == 0, f"rc={p.returncode}\nstdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-3000:]}"
        line = [l for l in p.stdout.splitlines() if l.startswith("RANK_RESULT ")][-1]
        r = json.loads(line.split(" ", 1)[1])
        results[r["rank"]] = r["drained"]
    # queue lengths after each arrival: r0 1,1,3,3,3 ; r1 0,0,1,3,3 -> MIN ready
    assert results[0] == results[1] == [0, 0, 1, 2, 0]
