"""002#41 executed: DSA CP interleave all-gather and reduce-scatter on uneven shards.

The seed fixed DSA/NSA CP collectives that assumed equal shards, so page-aligned
uneven per-rank shards crashed. Upstream 0.5.23 pads every rank to one physical
length. Here 2 and 4 real processes run upstream's own
``InterleaveCPStrategy.shard_hidden_states`` -> ``_gather_interleaved_tensor``
and ``layer_boundary.ops.attn_cp_interleave_reduce_scatter`` over a real sglang
``GroupCoordinator`` on gloo; the parent compares every rank's result with a
single-process reference (the input sequence itself for the gather, the sum of
every rank's slice for the reduce-scatter).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from conftest import gloo_rendezvous
from suite_helpers import run_all

HERE = os.path.dirname(os.path.abspath(__file__))
HIDDEN = 8


def _run_ranks(world: int, cases: list[list[int]], rdv_dir) -> dict:
    """One process per rank, all at once (suite_helpers.run_all: each a fresh interpreter of the rank script,
    forked from the suite's zygote; gloo is initialised in the rank process only). A rank stuck in a
    mismatched collective is killed at the timeout (hang guard)."""
    rendezvous = gloo_rendezvous(rdv_dir)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    runs = run_all({r: ([sys.executable, os.path.join(HERE, "_cp_collective_rank.py"), str(r), str(world),
                         rendezvous, json.dumps(cases), str(HIDDEN)], {"env": env}) for r in range(world)},
                   workers=world, timeout=300)
    results = {}
    for p in runs.values():
        assert p.returncode == 0, f"rc={p.returncode}\nstdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-3000:]}"
        line = [l for l in p.stdout.splitlines() if l.startswith("RANK_RESULT ")][-1]
        r = json.loads(line.split(" ", 1)[1])
        results[r["rank"]] = r
    return results


CASES = [
    [37, 33],  # 70 tokens, uneven per sequence
    [64, 1],  # one page plus one token
    [64, 1, 9],  # three sequences, none a multiple of the CP size
]


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def world_results(request, tmp_path_factory):
    """One launch per CP size runs every case (process start-up dominates)."""
    return request.param, _run_ranks(request.param, CASES, tmp_path_factory.mktemp("rdv"))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c) for c in CASES])
def test_interleave_gather_and_reduce_scatter_match_a_single_process_reference(world_results, case):
    world, per_rank = world_results
    seq_lens = CASES[case]
    results = {rank: r["cases"][case] for rank, r in per_rank.items()}
    total = sum(seq_lens)
    assert sorted(results) == list(range(world))
    rows = {r["shard_rows"] for r in results.values()}
    assert len(rows) == 1, rows  # one physical length on every rank (the all-gather contract)
    for rank, r in results.items():
        assert r["gathered_shape"] == [total, HIDDEN]
        assert r["gathered_equals_input"], f"rank {rank} gathered a different sequence"
    # Reduce-scatter reference: rank r gets sum over ranks q of partial_q's slice r.
    max_len = results[0]["max_rank_len"]
    partials = [
        torch.randn(world * max_len, HIDDEN, generator=torch.Generator().manual_seed(100 + q))
        for q in range(world)
    ]
    reference = torch.stack(partials).sum(0).tensor_split(world)
    for rank, r in results.items():
        got = torch.tensor(r["reduce_scatter"])
        assert got.shape == (max_len, HIDDEN)
        torch.testing.assert_close(got, reference[rank], rtol=1e-5, atol=1e-5)
