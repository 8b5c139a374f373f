"""002#17 on CUDA: with ``--enable-profile-cuda-graph`` each decode graph family's
memory snapshot lands in its own ``cuda_graph_mem_<family>.pickle`` when
``SGLANG_CP_LOG_CG_BUFFERS=1`` (upstream writes every family to one
``cuda_graph_runner_memory_usage.pickle`` and the last one wins).

A fresh interpreter (the plugin patches the process) records CUDA memory
history, captures a real CUDA graph per family, and runs upstream's own
``DecodeCudaGraphRunner._post_process_after_profile`` for the decode and the
EAGLE draft family, with torch's real snapshot writer. Skips without CUDA or
sglang; a few seconds of GPU time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _child(workdir: str) -> dict:
    import pickle
    import types

    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp import plugin

    assert plugin.register(), plugin.status()
    HookRegistry.apply_hooks()
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner

    os.chdir(workdir)
    sizes = {}
    for cls, n in ((DecodeCudaGraphRunner, 1 << 20), (EAGLEDraftCudaGraphRunner, 1 << 18)):
        runner = object.__new__(cls)
        runner.model_runner = types.SimpleNamespace(is_draft_worker=False)
        torch.cuda.memory._record_memory_history()
        static = torch.zeros(n, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            with torch.cuda.graph(graph):
                out = static * 2 + 1
        graph.replay()
        torch.cuda.synchronize()
        cls._post_process_after_profile(runner, prof)  # real dump + our move
        sizes[cls.__name__] = int(out.numel())
    found = {}
    for name in sorted(os.listdir(workdir)):
        with open(name, "rb") as f:
            snap = pickle.load(f)
        found[name] = sorted(snap)  # torch 2.14 adds host_segments etc. before 'segments'
    return {"files": found, "sizes": sizes}


def _run(tmp_path, gate: bool) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "python"), env.get("PYTHONPATH", "")])
    env.pop("SGLANG_CP_DISABLE", None)
    if gate:
        env["SGLANG_CP_LOG_CG_BUFFERS"] = "1"
    else:
        env.pop("SGLANG_CP_LOG_CG_BUFFERS", None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=240,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("CG_PICKLES ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("CG_PICKLES "):])


def test_each_family_keeps_its_own_real_memory_snapshot(tmp_path):
    pytest.importorskip("sglang.srt.model_executor.runner.decode_cuda_graph_runner")
    got = _run(tmp_path, gate=True)
    assert sorted(got["files"]) == [
        "cuda_graph_mem_DecodeCudaGraphRunner.pickle",
        "cuda_graph_mem_EAGLEDraftCudaGraphRunner.pickle",
    ], got
    for keys in got["files"].values():
        assert "segments" in keys, keys  # a real torch CUDA memory snapshot


def test_without_the_gate_upstream_keeps_one_file(tmp_path):
    pytest.importorskip("sglang.srt.model_executor.runner.decode_cuda_graph_runner")
    got = _run(tmp_path, gate=False)
    assert sorted(got["files"]) == ["cuda_graph_runner_memory_usage.pickle"], got


if __name__ == "__main__":
    print("CG_PICKLES " + json.dumps(_child(sys.argv[1])))
