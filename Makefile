# The two README commands. Both set up .venv first (idempotent: seconds when done).
PY := .venv/bin/python

.PHONY: setup demo test test-slow test-gpu
setup:
	bash scripts/setup_env.sh

# The main job: CP ranks with upstream's HiCache and our L3 through warm-up, L2 pressure,
# reload and a full restart (table, out/cachebench/cachebench.{json,png}); then the operator
# tools on the L3 directory it left behind.
demo: setup
	.venv/bin/sglang-cp cachebench --out-dir out/cachebench
	.venv/bin/sglang-cp l3 stats --cp-l3-config out/cachebench/l3/l3.toml
	.venv/bin/sglang-cp l3 fsck --cp-l3-config out/cachebench/l3/l3.toml
	.venv/bin/sglang-cp doctor --cp-l3-config out/cachebench/l3/l3.toml

# CI's suite (slow-marked tests excluded by pyproject's addopts), on pytest-xdist workers: twice CI's 2
# cores, as many tests wait on their rank processes and subprocesses, and a long xdist_group then holds
# one worker of four instead of one of three (pytest 810 -> 718 s on the 2-core VM, both CPU-bound).
# --dist loadgroup keeps each xdist_group on one worker (test/conftest.py: host-wide resources, shared
# module fixtures).
TEST_WORKERS ?= 4
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --durations=15 test

test-slow: setup
	$(PY) -m pytest -q -p no:cacheprovider -m slow test

test-gpu: setup
	$(PY) -m pytest -q -p no:cacheprovider test/gpu
