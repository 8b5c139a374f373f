"""Engine-independent helpers behind the compute-path seed ports.

Nothing here imports sglang: the integration hooks call into these functions, and
tests and benchmarks can use them on their own.
"""
