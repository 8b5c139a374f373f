"""Benchmarks, and the support code they share with the tests (``benchmark.support``).

Not part of the installed package: run from the repository root, as modules
(``python -m benchmark.hicache.bench_cp_l3 ...``); pytest puts the repository root on ``sys.path``
(``pythonpath`` in pyproject.toml). See docs_internal/package_boundary.md.
"""
