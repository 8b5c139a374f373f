"""The CP rank testbed (``sglang_cp.cachebench.cp_testbed``, the product's, which ``sglang-cp cachebench``
drives) as the CP tests and ``benchmark.hicache.bench_cp_l3`` use it: the same names, the tests' start
method, and the token ids their prompts are made of.

The tests' ``run_ranks`` starts its ranks as forks of a fork server that imported torch and
upstream's HiCache stack once (``start="forkserver"``): every rank and every restart is still its own
process with its own gloo group, plugin load and store, without 10-15 s of imports each."""

import functools

from sglang_cp.cachebench import cp_testbed
from sglang_cp.cachebench.cp_testbed import (  # noqa: F401
    GLM5_KV_LORA,
    GLM5_ROPE,
    PAGE,
    Rank,
    emit,
    page_bytes_pattern,
)

run_ranks = functools.partial(cp_testbed.run_ranks, start="forkserver")


def tokens_for(n_pages: int, seed: int = 0) -> list[int]:
    """``n_pages`` pages of token ids, the same for the same seed in every process."""
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n_pages * PAGE)]
