"""The README's GPU section as a user runs it: its minimal launch line, its L3 config recipe and its
"How to confirm it works" steps, with the values the README quotes.

The server command is the README's own code block (the `python -m sglang.launch_server` form for the
first start, the `sglang serve` form for the restart), with `$MODEL` = the tiny DeepseekV3 (MLA) model and
`$L3_CONFIG` = `examples/l3.single-nvme.toml` with its paths pointed at this test's directory, as the README
tells the user to do. Appended, because a test box is not a user's node: dummy weights and no tokenizer
(the model directory has only its config), a bounded KV pool and host pool (a tiny model would otherwise
take the whole GPU for KV and twice that in host memory), a free port, and PyTorch sampling without CUDA
graphs (a box without FlashInfer). The attention backend is upstream's own choice for an MLA model on the
GPU (fa3 on Hopper), as in the README's line, unless SGLANG_CP_TEST_ATTENTION_BACKEND names one (a box
without FA3's kernels).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time

from server_support import MODELS, TestServer, base_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(REPO, "README.md")).read()
BOX_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--max-total-tokens", "65536",
            "--mem-fraction-static", "0.5", "--hicache-size", "4", "--sampling-backend", "pytorch",
            "--disable-cuda-graph"]


def readme_command(first: str) -> list:
    """argv of the README code block that starts with `first`."""
    for block in re.findall(r"```\n(.*?)```", README, re.S):
        if block.startswith(first):
            return shlex.split(block.replace("\\\n", " "))
    raise AssertionError(f"README has no code block starting with {first!r}")


def readme_l3_config(root: str) -> str:
    """examples/l3.single-nvme.toml with index.dir and disks[0].path under `root` and a capacity that fits."""
    with open(os.path.join(REPO, "examples", "l3.single-nvme.toml")) as f:
        text = f.read()
    index, data = os.path.join(root, "index"), os.path.join(root, "nvme0")
    for d in (index, data):
        os.makedirs(d, mode=0o700)
    text, n1 = re.subn(r'^dir = "[^"]*"', f'dir = "{index}"', text, flags=re.M)
    text, n2 = re.subn(r'^path = "[^"]*"', f'path = "{data}"', text, flags=re.M)
    text, n3 = re.subn(r"^capacity_gb = [0-9.]+", "capacity_gb = 4.0", text, flags=re.M)
    assert (n1, n2, n3) == (1, 1, 1), "examples/l3.single-nvme.toml changed shape"
    path = os.path.join(root, "l3.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


class ReadmeServer(TestServer):  # a start slot and the start ledger like every test server
    def __init__(self, argv: list, **kw):
        super().__init__(MODELS["mla"], **kw)
        self.argv = argv

    def command(self) -> list:
        backend = os.environ.get("SGLANG_CP_TEST_ATTENTION_BACKEND")
        return [*self.argv, *BOX_ARGS, *(["--attention-backend", backend] if backend else []), "--port", str(self.port)]


# `sglang` is a console script (sglang.cli.main:main); where it is not on PATH (an install by path), the
# same entry point through this interpreter.
SGLANG_CLI = "import sys; from sglang.cli.main import main; sys.argv[0] = 'sglang'; sys.exit(main())"


def _executable(argv: list) -> list:
    head = {"python": [sys.executable], "sglang": [sys.executable, "-c", SGLANG_CLI]}[argv[0]]
    return head + argv[1:]


def test_readme_launch_and_confirm_steps(tmp_path_factory):
    root = base_dir(tmp_path_factory, "readme")
    config = readme_l3_config(os.path.join(root, "l3"))
    subst = {"$MODEL": MODELS["mla"], "$L3_CONFIG": config}
    launch = [subst.get(a, a) for a in readme_command("python -m sglang.launch_server")]
    serve = [subst.get(a, a) for a in readme_command("sglang serve")]
    assert launch[1:3] == ["-m", "sglang.launch_server"] and launch[3:] == serve[2:], "the two README lines differ"

    # The README's "How to confirm": 2000 token ids, 8 new tokens; 31 full pages spilled; after
    # /flush_cache the same prompt comes back from storage: 1984 tokens from CpL3Storage.
    ids = list(range(1000, 3000))
    want = {"device": 0, "host": 0, "storage": 1984, "storage_backend": "CpL3Storage"}
    assert str(want) in README and "31.0" in README and "sglang:cp_l3_reload_pages_total` 31" in README

    env = dict(os.environ)
    env.pop("SGLANG_CP_DISABLE", None)
    srv = ReadmeServer(_executable(launch), log_path=os.path.join(root, "first.log"), env=env)
    with srv:
        ready = [ln for ln in srv.log_text().splitlines() if "sglang-cp L3 backend ready: L3 rank 0 of 1 on node 0:" in ln]
        assert ready and "payloads {'kv': " in ready[0] and "backup ack durable" in ready[0], srv.log_tail()
        first = srv.generate(ids, max_new_tokens=8)
        srv.wait_metric("sglang:cp_l3_spill_pages_total", lambda v: v >= 31, timeout_s=120)
        assert srv.metrics()["sglang:cp_l3_spill_pages_total"] == 31.0
        srv.flush_cache()
        again = srv.generate(ids, max_new_tokens=8)
        assert again.cached_details == want, again.meta_info
        assert again.output_ids == first.output_ids
        srv.wait_metric("sglang:cp_l3_reload_pages_total", lambda v: v >= 31, timeout_s=30)
        m = srv.metrics()
        assert m["sglang:cp_l3_reload_pages_total"] == 31.0 and m.get("sglang:cp_l3_crc_errors_total", 0) == 0.0
        stats = subprocess.run([sys.executable, "-m", "sglang_cp.cli", "l3", "stats", "--cp-l3-config", config,
                                "--json"], capture_output=True, text=True, timeout=120)
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)  # the README's `sglang-cp l3 stats` answers on the live directory

    # "After a restart (same line, --cp-l3-cold-start load) the request is served from storage again":
    # the `sglang serve` form of the line.
    srv2 = ReadmeServer(_executable(serve), log_path=os.path.join(root, "restart.log"), env=env)
    with srv2:
        t0 = time.monotonic()
        after = srv2.generate(ids, max_new_tokens=8)
        assert after.cached_details == want, after.meta_info
        assert after.output_ids == first.output_ids
        assert time.monotonic() - t0 < 120
