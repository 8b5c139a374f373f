"""Shared pieces of the real-server GPU tests: models, L3 configs, prompts, L3 flags.

The servers are real ``sys.executable -m sglang.launch_server`` processes
(``sglang_cp.server_process``), so these tests run unchanged on any CUDA box where sglang
and this plugin are installed. Without CUDA (CI) every module skips at collection.

Environment knobs (all optional):
- ``SGLANG_CP_GPU_TEST_DIR``: where L3 slabs and indexes go (default: pytest's tmp dir;
  it must be a real disk filesystem, since L3 opens its slabs with O_DIRECT);
- ``SGLANG_CP_TEST_ATTENTION_BACKEND``: attention backend (default ``triton``).
Under pytest-xdist each worker takes its own GPU (``gw<N>`` -> GPU N modulo the count).
"""

from __future__ import annotations

import glob
import os
import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (real-server tests)", allow_module_level=True)

from sglang_cp.demo_config import write_demo_config  # noqa: E402
from sglang_cp.server_process import ServerProcess  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {
    "mla": os.path.join(HERE, "models", "tiny-dsv3"),   # DeepseekV3 architecture, MLA KV
    "mha": os.path.join(HERE, "models", "tiny-olmo2"),  # OLMo2, plain multi-head KV
}
PAGE = 64


def worker_env() -> dict:
    """This process's environment with the xdist worker's own GPU selected."""
    env = dict(os.environ)
    env.pop("SGLANG_CP_DISABLE", None)
    wid = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if "CUDA_VISIBLE_DEVICES" not in os.environ and wid.startswith("gw"):
        env["CUDA_VISIBLE_DEVICES"] = str(int(wid[2:]) % max(1, torch.cuda.device_count()))
    return env


def base_dir(tmp_path_factory, name: str) -> str:
    root = os.environ.get("SGLANG_CP_GPU_TEST_DIR")
    if root:
        d = os.path.join(root, f"{name}-{os.getpid()}-{random.randrange(1 << 30)}")
        os.makedirs(d, mode=0o700)
        return d
    return str(tmp_path_factory.mktemp(name))


def write_l3_config(root: str, capacity_gb: float = 2.0, backup_ack: str | None = None) -> str:
    """The embedded default L3 config (``sglang-cp demo``'s) with its directories under ``root/l3``,
    and ``durability.backup_ack`` when given."""
    return write_demo_config(os.path.join(root, "l3"), capacity_gb=capacity_gb, backup_ack=backup_ack)


def l3_flags(config: str, cold_start: str) -> list:
    return ["--enable-hierarchical-cache", "--hicache-size", "4",
            "--hicache-write-policy", "write_through",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--enable-cp-l3", "--cp-l3-config", config, "--cp-l3-cold-start", cold_start]


def slab_files(config_root: str) -> list:
    return sorted(glob.glob(os.path.join(config_root, "l3", "disk0", "**", "*.slab"), recursive=True))


def prompt(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


def pages_of(n_tokens: int) -> int:
    """Full pages a prompt leaves in the radix tree (the last token is never cached)."""
    return (n_tokens - 1) // PAGE


def server(model: str, extra: list, log_dir: str, tag: str, **kw) -> ServerProcess:
    # 0.3 of the GPU each: two test servers share one GPU under pytest-xdist -n 2x#GPUs.
    kw.setdefault("mem_fraction_static", 0.3)
    return ServerProcess(MODELS[model], extra_args=extra, env=worker_env(),
                         log_path=os.path.join(log_dir, f"{tag}.log"), **kw)


METRIC = "sglang:cp_l3_{}".format
