"""CP-sharded L3 in a real PD prefill server on two GPUs.

Upstream runs ``--enable-kv-cache-sharding`` only on a PD prefill worker, with a real
transfer backend (mooncake or nixl) and, on sm90 for non-DSA models, the ``fa3`` prefill
backend (``arg_groups/kv_shard_hook.py``). So this test starts what a user would: a
prefill worker with ``--tp 2 --enable-prefill-cp --attn-cp-size 2`` plus KV sharding,
HiCache and our L3 (placement assert on), a decode worker on the same two GPUs, and
sends each request to both with the same bootstrap room (what the PD router does).

It checks that each CP rank's L3 holds only its own stripe (per-rank slot counts), that a
prefill restart with cold start ``load`` serves the prefix from storage with identical
output ids, and that the placement assert never fires; and that when one rank's slab is damaged
between runs, that rank's pages are misses on both ranks (upstream's MIN agreement over the CP
group), the prefix is recomputed with the same ids, and only that rank counts CRC errors. Skips
without two GPUs, nixl or sgl_kernel's fa3 ops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from server_support import MODELS, base_dir, flip_payload_bytes, l3_flags, pages_of, prompt, slab_files, write_l3_config

from benchmark.support.pd_pair import decode_args, pd_generate, sharded_prefill_args
from benchmark.support.server_process import ServerProcess, free_port

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)
pytest.importorskip("nixl._api", reason="needs the nixl transfer engine (PD prefill refuses 'fake')")
pytest.importorskip("sgl_kernel.flash_attn", reason="needs sgl_kernel's fa3 ops (KV sharding on sm90)")

N = 4096


def _prefill(model, cfg, cold, root, tag, bootstrap_port):
    return ServerProcess(
        MODELS[model], log_path=os.path.join(root, f"{tag}.log"), attention_backend="fa3",
        mem_fraction_static=0.35, startup_timeout_s=600,
        extra_args=[*sharded_prefill_args(2, bootstrap_port), *l3_flags(cfg, cold), "--cp-hicache-placement-assert"])


def _decode(model, root):
    return ServerProcess(MODELS[model], log_path=os.path.join(root, "decode.log"), attention_backend="fa3",
                         mem_fraction_static=0.3, startup_timeout_s=600, extra_args=decode_args(2))


def _per_rank_slots(srv, want_total, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    per = {}
    while time.monotonic() < deadline:
        per = srv.metric_by_label("sglang:cp_l3_used_slots", "cp_rank")
        if sum(per.values()) >= want_total:
            break
        time.sleep(0.5)
    return per


# OLMo2 (MHA) cannot run prefill CP in 0.5.23: the CP extend path calls
# model.get_input_embeddings(), which Olmo2ForCausalLM lacks (seen on the H200).
@pytest.mark.parametrize("model", ["mla"])
def test_cp2_sharded_prefill_persists_each_ranks_stripe_and_reloads(model, tmp_path_factory):
    root = base_dir(tmp_path_factory, f"cp2-{model}")
    cfg = write_l3_config(root)
    bport = free_port()
    # A PD prefill worker caches the whole prompt (seen on the H200: 4096 tokens -> 64 pages
    # in L3, 32 per rank); a later request can hit all but its last token's page.
    P, pages, hit_pages = prompt(N, 21), N // 64, pages_of(N)
    decode = _decode(model, root).start()
    try:
        with _prefill(model, cfg, "clear", root, "prefill-clear", bport) as pf:
            p1, d1 = pd_generate(pf, decode, bport, P)
            per = _per_rank_slots(pf, pages)
            stats = subprocess.run([sys.executable, "-m", "sglang_cp.cli", "l3", "stats", "--cp-l3-config", cfg],
                                   capture_output=True, text=True, timeout=120)
            print(stats.stdout[-3000:])
            print("per-rank L3 slots after the first request:", json.dumps(per))
        assert len(d1.output_ids) == 8
        assert set(per) == {"0", "1"}, per
        assert sum(per.values()) == pages, per  # each page once, on exactly one rank
        assert abs(per["0"] - per["1"]) <= 1, per  # the stripes: page h on rank h % 2

        with _prefill(model, cfg, "load", root, "prefill-load", bport) as pf:
            p2, d2 = pd_generate(pf, decode, bport, P)
            time.sleep(1.5)  # one publish of the per-rank counters
            reload = pf.metric_by_label("sglang:cp_l3_reload_pages_total", "cp_rank")
            log = pf.log_text()
        storage = max(p2.storage_tokens, d2.storage_tokens)
        assert storage == hit_pages * 64, (p2.meta_info, d2.meta_info)
        assert d2.output_ids == d1.output_ids
        print("per-rank L3 pages reloaded after the restart:", json.dumps(reload))
        assert set(reload) == {"0", "1"} and sum(reload.values()) == pages, reload
        assert "placement" not in log.lower() or "mismatch" not in log.lower(), "placement assert fired"
    finally:
        decode.stop()


def test_cp2_one_ranks_damaged_slab_is_a_miss_on_both_ranks(tmp_path_factory):
    """Every page CP rank 1 stored is damaged between runs, rank 0's are intact. After ``load`` rank 1's
    reads fail their CRC, and since upstream agrees on the prefix by a MIN over the CP group, rank 0's
    intact pages are not served past it either: at most the first page (rank 0's stripe starts the
    prefix) comes from storage, the rest is recomputed, and the output ids are the first run's."""
    model = "mla"
    root = base_dir(tmp_path_factory, "cp2-damage")
    cfg = write_l3_config(root)
    bport = free_port()
    P, pages = prompt(N, 22), N // 64
    decode = _decode(model, root).start()
    try:
        with _prefill(model, cfg, "clear", root, "prefill-write", bport) as pf:
            _, d1 = pd_generate(pf, decode, bport, P)
            per = _per_rank_slots(pf, pages)
        assert set(per) == {"0", "1"} and sum(per.values()) == pages, per
        damaged = flip_payload_bytes(slab_files(root), select=lambda name: name.startswith("r1."))
        assert damaged == per["1"], (damaged, per, slab_files(root))

        with _prefill(model, cfg, "load", root, "prefill-damaged", bport) as pf:
            p2, d2 = pd_generate(pf, decode, bport, P)
            crc = {}
            deadline = time.monotonic() + 30
            while crc.get("1", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.5)
                crc = pf.metric_by_label("sglang:cp_l3_crc_errors_total", "cp_rank")
            time.sleep(1.5)  # one more publish: rank 0's count is final too
            crc = pf.metric_by_label("sglang:cp_l3_crc_errors_total", "cp_rank")
            p3, d3 = pd_generate(pf, decode, bport, P)  # recomputed and cached again: the server keeps serving
            log = pf.log_text()
        storage = max(p2.storage_tokens, d2.storage_tokens)
        print(f"CP=2 damage: {damaged} rank-1 pages flipped, storage tokens {storage}, crc by rank {crc}")
        assert storage <= 64, (p2.meta_info, d2.meta_info)
        assert crc.get("1", 0) >= 1 and crc.get("0", 0) == 0, crc
        assert d2.output_ids == d1.output_ids and d3.output_ids == d1.output_ids
        assert "placement" not in log.lower() or "mismatch" not in log.lower(), "placement assert fired"
    finally:
        decode.stop()
