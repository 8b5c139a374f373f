"""``sglang-cp cachebench``: the tiered KV cache end to end on this machine, no GPU, no weights.

N CP ranks as real processes joined by gloo, each with upstream's host pool in GLM-5 shapes,
upstream's HiCache controller and our L3 backend attached through the flags
(``cachebench.cp_testbed``), replay a multi-turn long-context workload with shared
prefixes through warm-up, L2 pressure, reload and a full restart with cold start ``load``.
Design and decisions: docs_internal/cachebench.md.
"""
