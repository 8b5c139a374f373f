"""`--enable-cp-l3` on the model class the project exists for: DSA (GLM-5's ``GlmMoeDsaForCausalLM``),
alone and with its NextN/MTP draft, on a real server.

A DSA page has two payloads in L3: the target's MLA latent KV and the DSA indexer-K cache
(upstream's ``PoolName.INDEXER`` sidecar). With MTP, upstream packs the draft layer into both host
pools ("PACKED" HiCache draft plan), so each payload's page carries one more layer. The tests check
that both payloads are spilled for every page, restored together after ``/flush_cache`` and after
restarts with ``load`` and ``verify``, that a page whose indexer blob is damaged is recomputed and
never served from its KV alone, and that the draft's accept length survives a restart, with a RED
case that proves the accept-length check can fail.

The models' weights are shaped (``kv_sensitive/sitecustomize.py``) so that the next token is read
from the prefix KV and the draft agrees with the target only when its own prefix KV is right:
with plain dummy weights neither "same ids" nor "same accept length" could fail.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time

import pytest
from server_support import (METRIC, base_dir, dsa_args, dsa_env, flip_payload_bytes, l3_flags, pages_of,
                            payload_metric, server, slab_files, write_l3_config)

pytestmark = pytest.mark.gpu
N = 4096            # > index_topk (2048): prefill runs the sparse path (indexer logits + top-k)
NEW = 16            # decode steps: several MTP verify rounds
LAYERS = 4          # tiny-glm5-dsa
KV_ROW_B = 2 * (512 + 64)   # bf16 latent + rope per token per layer
INDEXER_ROW_B = 128 + 4     # fp8 index K + fp32 scale per token per layer
PAYLOADS = ("kv", "indexer")


def mode_prompt(n: int, seed: int, mode: int, density: float = 0.2, tail: int = 256) -> list:
    """Random ids with ``mode`` planted at ``density`` before the last ``tail`` tokens: the shaped model
    answers with the mode, which only the prefix KV holds (a restore's uncached tail has none)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i < n - tail and rng.random() < density:
            out.append(mode)
        else:
            t = rng.randrange(3, 30000)
            out.append(t if t != mode else t + 1)
    return out


def verify_ct(r) -> int:
    return int(r.meta_info.get("spec_verify_ct") or 0)


def _settled_by_payload(srv, name: str, want: int, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    got = payload_metric(srv, name)
    while any(got.get(p, 0) < want for p in PAYLOADS) and time.monotonic() < deadline:
        time.sleep(0.25)
        got = payload_metric(srv, name)
    time.sleep(1.5)  # one more publish: the exact count, not a lower bound
    return payload_metric(srv, name)


def _l3_stats(cfg: str) -> dict:
    code = "import sys; from sglang_cp.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "l3", "stats", "--cp-l3-config", cfg, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _used_by_payload(cfg: str) -> dict:
    used: dict = {}
    for row in _l3_stats(cfg)["slabs"]:
        used[row["payload"]] = used.get(row["payload"], 0) + row["used"]
    return used


def _backend_payloads(srv) -> dict:
    """The page bytes per payload the backend's ready line names (``payloads {'kv': N, ...}``)."""
    m = re.findall(r"sglang-cp L3 backend ready: .*?payloads (\{[^}]*\})", srv.log_text())
    assert m, "no 'sglang-cp L3 backend ready' line in the server log"
    return eval(m[-1], {"__builtins__": {}})  # a dict literal of str -> int


def _expect_hit(r, pages: int, ref, mtp: bool, what: str) -> None:
    assert r.storage_tokens == pages * 64, (what, r.meta_info)
    assert r.cached_details.get("storage_backend") == "CpL3Storage", (what, r.meta_info)
    assert r.output_ids == ref.output_ids, (what, r.output_ids, ref.output_ids)
    if mtp:  # the same accept length: the draft's prefix KV came back with the target's
        assert verify_ct(r) == verify_ct(ref), (what, r.meta_info, ref.meta_info)


@pytest.mark.parametrize("mtp", [False, True], ids=["dsa", "dsa-mtp"])
def test_dsa_l3_flush_and_cold_starts(mtp, tmp_path_factory):
    root = base_dir(tmp_path_factory, "dsa-mtp" if mtp else "dsa")
    cfg = write_l3_config(root)
    mode = 777
    P, pages = mode_prompt(N, 5, mode), pages_of(N)
    args, env = dsa_args(mtp), dsa_env()
    layers = LAYERS + (1 if mtp else 0)

    # 1. clear: compute (the reference), spill both payloads, flush, the same prompt from storage.
    with server("dsa", args + l3_flags(cfg, "clear"), root, "clear", env=env) as s:
        ref = s.generate(P, NEW)
        assert ref.storage_tokens == 0 and ref.device_tokens == 0, ref.meta_info
        spilled = _settled_by_payload(s, "spill_pages_total", pages)
        assert all(pages <= spilled.get(p, 0) <= pages_of(N + NEW) for p in PAYLOADS), spilled
        # The draft layer rides in both payloads' pages under MTP (upstream's packed plan).
        assert _backend_payloads(s) == {"kv": layers * 64 * KV_ROW_B, "indexer": layers * 64 * INDEXER_ROW_B}
        s.flush_cache()
        second = s.generate(P, NEW)
        _expect_hit(second, pages, ref, mtp, "after /flush_cache")
        reloaded = _settled_by_payload(s, "reload_pages_total", pages)
        assert all(reloaded.get(p) == pages for p in PAYLOADS), reloaded
        m = s.metrics()
        assert m.get(METRIC("read_misses_total"), 0) == 0 and m.get(METRIC("crc_errors_total"), 0) == 0
    used = _used_by_payload(cfg)
    assert all(used.get(p, 0) == spilled[p] for p in PAYLOADS), (used, spilled)

    # 2. restart with load: every page of both payloads from storage; same ids (and accept length).
    with server("dsa", args + l3_flags(cfg, "load"), root, "load", env=env) as s:
        third = s.generate(P, NEW)
        _expect_hit(third, pages, ref, mtp, "after restart with load")
        reloaded = _settled_by_payload(s, "reload_pages_total", pages)
        assert all(reloaded.get(p) == pages for p in PAYLOADS), reloaded

    # 3. restart with verify (full CRC scan of both payloads' slabs at startup): the same.
    with server("dsa", args + l3_flags(cfg, "verify"), root, "verify", env=env) as s:
        fourth = s.generate(P, NEW)
        _expect_hit(fourth, pages, ref, mtp, "after restart with verify")
        assert s.metrics().get(METRIC("crc_errors_total"), 0) == 0
    print(f"DSA{' + MTP' if mtp else ''}: {pages} pages x {PAYLOADS}, ids {ref.output_ids[:6]}..., "
          f"verify_ct ref {verify_ct(ref)} / flush {verify_ct(second)} / load {verify_ct(third)} / "
          f"verify {verify_ct(fourth)}, accept length {ref.meta_info.get('spec_accept_length')}")


def test_dsa_indexer_damage_is_recomputed_never_served_from_kv_alone(tmp_path_factory):
    """Every indexer-K blob is damaged and every target-KV blob is intact: no page may be served (a
    KV page without its indexer page would decode with a stale index cache), the prompt is recomputed
    with the same ids, and the CRC counter names the indexer. The shaped model's premise is checked
    here too: two prompts that differ only in their planted token answer with that token."""
    root = base_dir(tmp_path_factory, "dsa-damage")
    cfg = write_l3_config(root)
    P, pages = mode_prompt(N, 6, 4242), pages_of(N)
    Q = [9999 if t == 4242 else t for t in P]
    args, env = dsa_args(False), dsa_env()
    with server("dsa", args + l3_flags(cfg, "clear"), root, "write", env=env) as s:
        ref = s.generate(P, NEW)
        other = s.generate(Q, NEW)
        assert _settled_by_payload(s, "spill_pages_total", pages)
    damaged = flip_payload_bytes(slab_files(root), select=lambda name: ".indexer.s" in name)
    assert damaged >= pages, f"expected to damage every indexer page in {slab_files(root)}"

    with server("dsa", args + l3_flags(cfg, "load"), root, "damaged", env=env) as s:
        got = s.generate(P, NEW)
        assert got.storage_tokens == 0, got.meta_info
        assert got.output_ids == ref.output_ids
        crc = s.wait_metric(METRIC("payload_crc_errors_total"), lambda x: x >= 1, 30)
        assert crc >= 1, s.metrics()
        by_payload = payload_metric(s, "crc_errors_total")
        assert by_payload.get("indexer", 0) >= 1 and by_payload.get("kv", 0) == 0, by_payload
        # Recomputed and spilled anew: the next request is a device hit, the server keeps serving.
        again = s.generate(P, NEW)
        assert again.output_ids == ref.output_ids
    print(f"DSA indexer damage: {damaged} indexer blobs flipped, storage tokens {got.storage_tokens}, "
          f"crc by payload {by_payload}; planted 4242 -> {ref.output_ids}, planted 9999 -> {other.output_ids}")
    # The premise of every ids comparison in this file: the output is read from the prefix KV.
    assert ref.output_ids.count(4242) > NEW // 2 and other.output_ids.count(9999) > NEW // 2, \
        (ref.output_ids, other.output_ids)


def test_mtp_accept_length_check_catches_an_unpersisted_draft(tmp_path_factory):
    """RED seam made a test: with upstream's HiCache draft plan forced to "none" the draft layer's KV is
    neither spilled nor restored. After a restart the target's pages are served (same ids), but the
    draft runs over an empty prefix and its proposals miss: more verify rounds for the same tokens.
    This is the failure the accept-length assertion of the MTP lifecycle test exists to catch."""
    root = base_dir(tmp_path_factory, "dsa-mtp-red")
    cfg = write_l3_config(root)
    P, pages = mode_prompt(N, 7, 1313), pages_of(N)
    args, env = dsa_args(True), dsa_env(SGLANG_CP_TEST_DRAFT_HICACHE="off")
    with server("dsa", args + l3_flags(cfg, "clear"), root, "write", env=env) as s:
        ref = s.generate(P, NEW)
        assert _settled_by_payload(s, "spill_pages_total", pages)
        # Without the packed draft the payloads hold the target layers only.
        assert _backend_payloads(s) == {"kv": LAYERS * 64 * KV_ROW_B, "indexer": LAYERS * 64 * INDEXER_ROW_B}
    with server("dsa", args + l3_flags(cfg, "load"), root, "load", env=env) as s:
        got = s.generate(P, NEW)
    assert got.storage_tokens == pages * 64, got.meta_info
    assert got.output_ids == ref.output_ids
    print(f"unpersisted draft: verify_ct {verify_ct(ref)} computed -> {verify_ct(got)} restored "
          f"(accept length {ref.meta_info.get('spec_accept_length')} -> {got.meta_info.get('spec_accept_length')})")
    assert verify_ct(got) > verify_ct(ref), (ref.meta_info, got.meta_info)
