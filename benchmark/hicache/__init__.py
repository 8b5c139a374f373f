"""Benchmarks of the tiered cache: each module is a command, run from the repository root as
``python -m benchmark.hicache.<name> --help``."""
