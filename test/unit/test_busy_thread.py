"""The benchmarks' stand-in for a GPU server's scheduler thread (benchmark/support/busy_thread.py)."""

import argparse
import time

import pytest

from benchmark.support.busy_thread import BusyScheduler, quantile, scheduler_steps


def test_scheduler_steps_are_parsed_and_bad_ones_named():
    assert scheduler_steps("2,8") == (0.002, 0.008)
    assert scheduler_steps("0.5,0") == (0.0005, 0.0)
    for bad in ("2", "x,8", "0,8", "2,-1", "1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError, match="e.g. 2,8"):
            scheduler_steps(bad)


def test_a_stepping_scheduler_records_each_step_and_a_spinning_one_none():
    """Each step is its bytecode then a sleep with the GIL released, so none is shorter than the two;
    the quantiles are of the recorded steps. The spinning thread counts turns and records no steps."""
    with BusyScheduler((0.001, 0.002)) as steps:
        time.sleep(0.2)
    assert steps.turns == len(steps.steps_ms) >= 5
    assert min(steps.steps_ms) >= 2.999  # (float rounding of the two clock differences)
    p50, p99 = steps.step_quantiles()
    assert p50 == quantile(steps.steps_ms, 0.5) and p50 <= p99 == quantile(steps.steps_ms, 0.99)
    with BusyScheduler() as spin:
        time.sleep(0.05)
    assert spin.turns > 0 and spin.steps_ms == [] and spin.step_quantiles() is None
    assert quantile([], 0.5) == 0.0 and quantile([3.0, 1.0, 2.0], 0.5) == 2.0
