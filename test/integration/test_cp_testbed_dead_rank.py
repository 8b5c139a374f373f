"""run_ranks notices a rank process that dies without a result, instead of waiting out its timeout.

A killed rank (SIGKILL, the OOM killer, a crash in native code) never puts its result on the queue
and never enters the next collective: its peers block there. Before, the parent waited for the
full timeout (cachebench: 1800 s) and then reported a hang; now it reports the dead rank and stops
the others. Real spawned processes; the dying rank SIGKILLs itself.
"""

import os
import signal
import time

import pytest

from sglang_cp.cachebench.cp_testbed import RankDied, run_ranks


def _one_rank_dies(rank, world, rendezvous):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # as a peer blocked in a collective the dead rank never enters
    return {"rank": rank}


def _all_finish(rank, world, rendezvous):
    return {"rank": rank}


def test_a_rank_killed_mid_run_is_reported_and_the_others_stopped():
    with pytest.raises(RankDied, match=r"rank 1 exited with code -9 without a result; ranks \[0\] were stopped"):
        run_ranks(2, _one_rank_dies, timeout=120)


def test_ranks_that_finish_are_not_mistaken_for_dead_ones():
    assert run_ranks(3, _all_finish, timeout=120) == [{"rank": 0}, {"rank": 1}, {"rank": 2}]


def test_forkserver_ranks_are_spawned_where_a_gpu_is_visible(monkeypatch):
    """On a GPU host the fork server's imports initialize CUDA and its forks cannot use CUDA again
    ("Cannot re-initialize CUDA in forked subprocess", seen on an H200 host): there run_ranks spawns. This
    box has no GPU, so only the visibility is faked; the ranks are real spawned processes."""
    import torch

    from sglang_cp.cachebench import cp_testbed

    native = "spawn" if torch.cuda.is_available() else "forkserver"
    assert cp_testbed._context("forkserver").get_start_method() == native
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cp_testbed._context("forkserver").get_start_method() == "spawn"
    assert run_ranks(2, _all_finish, timeout=120, start="forkserver") == [{"rank": 0}, {"rank": 1}]
