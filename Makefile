# The two README commands. Both set up .venv first (idempotent: seconds when done).
PY := .venv/bin/python

.PHONY: setup demo test test-slow test-gpu
setup:
	bash scripts/setup_env.sh

demo: setup
	.venv/bin/sglang-cp demo --out-dir out/demo

# CI's suite (slow-marked tests excluded by pyproject's addopts).
test: setup
	$(PY) -m pytest -q -p no:cacheprovider test

test-slow: setup
	$(PY) -m pytest -q -p no:cacheprovider -m slow test

test-gpu: setup
	$(PY) -m pytest -q -p no:cacheprovider test/gpu
