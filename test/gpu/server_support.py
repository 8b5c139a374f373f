"""Shared pieces of the real-server GPU tests: models, L3 configs, prompts, L3 flags.

The servers are real ``sys.executable -m sglang.launch_server`` processes
(``benchmark.support.server_process``), so these tests run unchanged on any CUDA box where sglang
and this plugin are installed. Without CUDA (CI) every module skips at collection.

Environment knobs (all optional):
- ``SGLANG_CP_GPU_TEST_DIR``: where L3 slabs and indexes go (default: pytest's tmp dir;
  it must be a real disk filesystem, since L3 opens its slabs with O_DIRECT);
- ``SGLANG_CP_TEST_ATTENTION_BACKEND``: attention backend (default ``triton``);
- ``SGLANG_CP_GPU_START_SLOTS``: how many servers may be starting at once on one GPU (default 2; see
  ``start_slot``), ``SGLANG_CP_GPU_START_WAIT_S``: the bound on waiting for a slot (default 1800 s);
- ``SGLANG_CP_GPU_FIRST_START_GATE``: 1 (default) lets the first start of a model on a GPU build its
  kernels before the other starts of that model (``start_slots.first_start_gate``); 0 turns that off;
- ``SGLANG_CP_TEST_READ_ENGINE``: ``io.read_engine`` of every L3 config the tests write (default: the
  config's own default, ``python``), to run the suite on the other read engine.
Under pytest-xdist each worker takes its own GPU (``gw<N>`` -> GPU N modulo the count).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (real-server tests)", allow_module_level=True)

from sglang_cp.demo_config import write_demo_config  # noqa: E402
from benchmark.support.server_process import ServerProcess  # noqa: E402
from slab_damage import flip_payload_bytes  # noqa: E402,F401  (the damage tests' one way to hurt a slab)
from start_slots import kernels_key, ledgered_start  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {
    "mla": os.path.join(HERE, "models", "tiny-dsv3"),   # DeepseekV3 architecture, MLA KV
    "mha": os.path.join(HERE, "models", "tiny-olmo2"),  # OLMo2, plain multi-head KV
    # GLM-5's architecture (GlmMoeDsaForCausalLM): MLA KV + DSA indexer-K, one NextN draft layer
    "dsa": os.path.join(HERE, "models", "tiny-glm5-dsa"),
}
PAGE = 64
# Test-only weight shaping (kv_sensitive/sitecustomize.py): outputs that depend on the prefix KV and
# an MTP draft that agrees with its target, so "same ids" and "same accept length" can fail.
KV_SENSITIVE_DIR = os.path.join(HERE, "kv_sensitive")


def worker_env() -> dict:
    """This process's environment with the xdist worker's own GPU selected."""
    env = dict(os.environ)
    env.pop("SGLANG_CP_DISABLE", None)
    wid = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if "CUDA_VISIBLE_DEVICES" not in os.environ and wid.startswith("gw"):
        env["CUDA_VISIBLE_DEVICES"] = str(int(wid[2:]) % max(1, torch.cuda.device_count()))
    return env


def kv_env(**extra: str) -> dict:
    """The worker's environment with the KV-sensitive weight shaping on (DeepSeek-family models: MLA, DSA)."""
    env = worker_env()
    env["SGLANG_CP_TEST_KV_SENSITIVE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (KV_SENSITIVE_DIR, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def dsa_env(kv_sensitive: bool = True, **extra: str) -> dict:
    """The worker's environment for a DSA server. Without DeepGEMM (this workplace's kit has none)
    the indexer's logits run in upstream's torch implementation; a box with sglang's own
    ``sgl-deep-gemm`` keeps the real kernels."""
    env = kv_env() if kv_sensitive else worker_env()
    if importlib.util.find_spec("deep_gemm") is None:
        env["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] = "1"
    env.update(extra)
    return env


def dsa_args(mtp: bool) -> list:
    """DSA on sm90 through FA3 on both sides (upstream's default prefill, flashmla_sparse, needs the
    separate flash_mla package; ``SGLANG_CP_TEST_DSA_PREFILL`` picks another), bf16 KV (upstream's
    sm90 default), and with ``mtp`` the NextN draft of the same checkpoint (spec v2, chain of 3)."""
    args = ["--dsa-prefill-backend", os.environ.get("SGLANG_CP_TEST_DSA_PREFILL", "fa3"),
            "--dsa-decode-backend", os.environ.get("SGLANG_CP_TEST_DSA_DECODE", "fa3"),
            "--kv-cache-dtype", "bfloat16"]
    if mtp:
        args += ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    return args


def base_dir(tmp_path_factory, name: str) -> str:
    root = os.environ.get("SGLANG_CP_GPU_TEST_DIR")
    if root:
        d = os.path.join(root, f"{name}-{os.getpid()}-{random.randrange(1 << 30)}")
        os.makedirs(d, mode=0o700)
        return d
    return str(tmp_path_factory.mktemp(name))


def write_l3_config(root: str, capacity_gb: float = 2.0, backup_ack: str | None = None) -> str:
    """The embedded default L3 config (``sglang-cp demo``'s) with its directories under ``root/l3``,
    ``durability.backup_ack`` when given, and ``io.read_engine`` from SGLANG_CP_TEST_READ_ENGINE."""
    path = write_demo_config(os.path.join(root, "l3"), capacity_gb=capacity_gb, backup_ack=backup_ack)
    engine = os.environ.get("SGLANG_CP_TEST_READ_ENGINE")
    if engine:
        with open(path, "a") as f:
            f.write(f'\n[io]\nread_engine = "{engine}"\n')
    return path


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


class TestServer(ServerProcess):
    """ServerProcess whose start waits for the first start of its model on its GPU
    (``start_slots.first_start_gate``) and a start slot (``start_slots.start_slot``), and goes into the
    run's start ledger (``start_slots.ledgered_start``)."""

    __test__ = False  # not a pytest class
    start_priority = False  # True: a call's long pole, first to a free start slot (``start_slot``)

    def start(self) -> "TestServer":
        tag = os.path.splitext(os.path.basename(self.log_path))[0]
        with ledgered_start(self.env or os.environ, tag, kernels=self.kernels(), priority=self.start_priority):
            super().start()
        return self

    def kernels(self) -> str:
        return kernels_key(self.model_path, self.command())


def server(model: str, extra: list, log_dir: str, tag: str, env: dict | None = None,
           start_priority: bool = False, **kw) -> TestServer:
    # 0.3 of the GPU each: two test servers share one GPU under pytest-xdist -n 2x#GPUs.
    kw.setdefault("mem_fraction_static", 0.3)
    if model == "dsa":
        kw.setdefault("attention_backend", "dsa")
    srv = TestServer(MODELS[model], extra_args=extra, env=env if env is not None else worker_env(),
                     log_path=os.path.join(log_dir, f"{tag}.log"), **kw)
    srv.start_priority = start_priority
    return srv


METRIC = "sglang:cp_l3_{}".format


def payload_metric(srv: ServerProcess, name: str) -> dict:
    """{payload: value} of a ``sglang:cp_l3_payload_*`` counter."""
    return srv.metric_by_label(METRIC(f"payload_{name}"), "payload")
