"""Re-export of the CP testbed, which moved into the package
(``sglang_cp.cachebench.cp_testbed``) so that ``sglang-cp cachebench`` can use it;
existing tests and ``benchmark/hicache/bench_cp_l3.py`` import it from here."""

from sglang_cp.cachebench.cp_testbed import (  # noqa: F401
    GLM5_KV_LORA,
    GLM5_ROPE,
    PAGE,
    Rank,
    emit,
    page_bytes_pattern,
    run_ranks,
)
