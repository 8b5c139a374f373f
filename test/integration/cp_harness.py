"""Re-export of the CP testbed, which moved into the package
(``sglang_cp.cachebench.cp_testbed``) so that ``sglang-cp cachebench`` can use it;
existing tests and ``benchmark/hicache/bench_cp_l3.py`` import it from here.

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
