"""Checks ported from the seeds, each module named after what it checks (page groups before native copies, CUDA-graph buffer accounting)."""
