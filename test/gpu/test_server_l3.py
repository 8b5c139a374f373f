"""`--enable-cp-l3` on a real server: flush, restarts with each cold-start mode, damage, crash.

Every server is a real ``launch_server`` process with dummy weights. Output ids of a
prompt must be identical whether its KV was computed, reloaded from L3 after
``/flush_cache``, or reloaded after a restart; the ``sglang:cp_l3_*`` counters must say
exactly what happened (the publisher runs every second, so reads wait for the value).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_support import (METRIC, base_dir, flip_payload_bytes, l3_flags, pages_of, prompt, server, slab_files,
                            write_l3_config)

pytestmark = pytest.mark.gpu
N = 4096


def _spilled_ok(v, n_prompt=N, n_new=8):
    """A prompt spills its full input pages, and the page its output tokens complete (the
    radix tree keeps prompt + output); both counts are what happened."""
    return pages_of(n_prompt) <= v <= pages_of(n_prompt + n_new)


def _settled(srv, name, want, timeout_s=90):
    """Wait for a counter to reach ``want``, then give it one more publish to overshoot."""
    v = srv.wait_metric(METRIC(name), lambda x: x >= want, timeout_s)
    time.sleep(1.5)
    return srv.metrics().get(METRIC(name), 0.0) if v >= want else v


@pytest.mark.parametrize("model", ["mla", "mha"])
def test_l3_flush_and_every_cold_start_mode(model, tmp_path_factory):
    root = base_dir(tmp_path_factory, f"l3-{model}")
    cfg = write_l3_config(root)
    P, pages = prompt(N, 2), pages_of(N)

    # 1. clear: compute, spill, flush, same prompt from storage.
    with server(model, l3_flags(cfg, "clear"), root, "clear1") as s:
        first = s.generate(P)
        assert first.storage_tokens == 0 and first.device_tokens == 0, first.meta_info
        spilled = _settled(s, "spill_pages_total", pages)
        assert _spilled_ok(spilled), spilled
        s.flush_cache()
        second = s.generate(P)
        assert second.storage_tokens == pages * 64, second.meta_info
        assert second.cached_details.get("storage_backend") == "CpL3Storage", second.meta_info
        assert _settled(s, "reload_pages_total", pages) == pages
        m = s.metrics()
        assert m.get(METRIC("read_misses_total"), 0) == 0 and m.get(METRIC("crc_errors_total"), 0) == 0
    assert second.output_ids == first.output_ids

    # 2. restart with load: served from storage, nothing re-spilled.
    with server(model, l3_flags(cfg, "load"), root, "load") as s:
        third = s.generate(P)
        assert third.storage_tokens == pages * 64, third.meta_info
        assert _settled(s, "reload_pages_total", pages) == pages
        assert s.metrics().get(METRIC("used_slots"), 0) >= pages
    assert third.output_ids == first.output_ids

    # 3. restart with clear: nothing from storage; the prompt is recomputed and spilled anew.
    with server(model, l3_flags(cfg, "clear"), root, "clear2") as s:
        fourth = s.generate(P)
        assert fourth.storage_tokens == 0, fourth.meta_info
        spilled = _settled(s, "spill_pages_total", pages)
        assert _spilled_ok(spilled), spilled
        assert s.metrics().get(METRIC("reload_pages_total"), 0) == 0
    assert fourth.output_ids == first.output_ids

    # 4. restart with verify (full CRC scan at startup): the pages spilled in 3 are served.
    with server(model, l3_flags(cfg, "verify"), root, "verify") as s:
        fifth = s.generate(P)
        assert fifth.storage_tokens == pages * 64, fifth.meta_info
        assert _settled(s, "reload_pages_total", pages) == pages
        assert s.metrics().get(METRIC("crc_errors_total"), 0) == 0
    assert fifth.output_ids == first.output_ids


def test_damaged_slab_bytes_are_recomputed_not_served(tmp_path_factory):
    root = base_dir(tmp_path_factory, "l3-damage")
    cfg = write_l3_config(root)
    P, pages = prompt(N, 3), pages_of(N)
    with server("mla", l3_flags(cfg, "clear"), root, "write") as s:
        ref = s.generate(P)
        assert _spilled_ok(_settled(s, "spill_pages_total", pages))
    damaged = flip_payload_bytes(slab_files(root), every=7, phase=3, back=777)
    assert damaged >= 2, f"expected to damage pages in {slab_files(root)}"

    with server("mla", l3_flags(cfg, "load"), root, "damaged") as s:
        got = s.generate(P)
        # The prefix stops at the first damaged page: fewer tokens from storage, the rest
        # recomputed, the same output, and the server keeps serving.
        assert got.storage_tokens < pages * 64, got.meta_info
        assert got.output_ids == ref.output_ids
        crc = s.wait_metric(METRIC("crc_errors_total"), lambda x: x >= 1, 30)
        assert crc >= 1, s.metrics()
        again = s.generate(P)
        assert again.output_ids == ref.output_ids
        other = s.generate(prompt(1024, 4))
        assert len(other.output_ids) == 8


@pytest.mark.parametrize("backup_ack", ["durable", "operation"])
def test_sigkill_during_spill_burst_loses_no_acked_page(backup_ack, tmp_path_factory):
    """With backup_ack = "operation" a backup's batches return before their pages are durable and
    the operation's ack waits for all of them: the counter (durable pages) must still hold."""
    root = base_dir(tmp_path_factory, f"l3-kill-{backup_ack}")
    cfg = write_l3_config(root, capacity_gb=4.0, backup_ack=backup_ack)
    prompts = [prompt(2 * N, 100 + i) for i in range(24)]
    total = len(prompts) * pages_of(2 * N)
    s = server("mla", l3_flags(cfg, "clear"), root, "burst").start()
    refs: dict = {}
    acked = 0.0
    pool = ThreadPoolExecutor(8)
    try:
        futs = {pool.submit(s.generate, p, 8, 120): i for i, p in enumerate(prompts)}
        # SIGKILL the whole server (scheduler included) once a third of the pages are acked,
        # while the rest are still being computed and spilled. The counter is published
        # every second, so the value read is a lower bound of what was acked at the kill.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            acked = s.metrics().get(METRIC("spill_pages_total"), 0.0)
            if acked >= total / 3 or all(f.done() for f in futs):
                break
            time.sleep(0.05)
        s.kill(signal.SIGKILL)
        for f, i in futs.items():
            try:
                refs[i] = f.result(timeout=60)
            except Exception:
                pass  # in flight at the kill
    finally:
        s.kill(signal.SIGKILL)
        pool.shutdown(wait=False, cancel_futures=True)
    assert refs, "no request completed before the kill"
    assert acked > 0, "no page was durable before the kill: the backups never reached L3"

    with server("mla", l3_flags(cfg, "load"), root, "after-kill") as s2:
        live = s2.wait_metric(METRIC("used_slots"), lambda x: x >= acked, 30)
        assert live >= acked, f"{acked} pages acked before the kill, {live} live after load"
        hit_pages = 0
        for i, p in enumerate(prompts):
            got = s2.generate(p)
            assert got.storage_tokens % 64 == 0
            hit_pages += got.storage_tokens // 64
            if i in refs:  # no wrong output: the same ids as before the crash
                assert got.output_ids == refs[i].output_ids, f"prompt {i}"
        assert s2.metrics().get(METRIC("crc_errors_total"), 0) == 0
    print(f"spill burst ({backup_ack} ack): {total} pages, {len(refs)}/{len(prompts)} requests done, "
          f">= {acked:.0f} pages acked before SIGKILL, {live:.0f} live after load, "
          f"{hit_pages} served from storage")
    # Every page acked before the kill is a hit after it, except the page that only the
    # output tokens completed (acked, but no prompt asks for it): at most one per prompt.
    assert hit_pages >= acked - len(prompts)
