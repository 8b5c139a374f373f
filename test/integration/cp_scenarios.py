"""Rank programs for the CP L3 multi-process tests (run inside cp_harness.run_ranks)."""

from __future__ import annotations

from benchmark.support.cp_harness import PAGE, Rank, tokens_for


def demo_l3_config(root, zero_copy: bool = False, backup_ack: str | None = None) -> str:
    """The embedded demo L3 config under root (0.05 GB slabs), with io.zero_copy_writes and
    durability.backup_ack set when asked; returns its path."""
    from sglang_cp.cli import write_demo_config

    path = write_demo_config(str(root), capacity_gb=0.05, backup_ack=backup_ack)
    if zero_copy:  # backups written straight from upstream's host pages
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace("[[disks]]\n", "[io]\nzero_copy_writes = true\n\n[[disks]]\n", 1))
    return path


def roundtrip(rank, world, rendezvous, l3_config, sharded, n_pages, write_phase, cold_start="clear",
              do_write=True, salt=0, seed=0, sidecars=False, drop_sidecar_page=None, layout="page_first"):
    """Back up n_pages, wipe the host pool, prefetch them back, compare this rank's stripe.

    drop_sidecar_page: logical page whose DSA indexer payload its owner deletes after the
    backup (a sidecar not durable): the whole logical page and everything after it must miss.
    """
    r = Rank(rank, world, rendezvous, l3_config, sharded=sharded, cold_start=cold_start, sidecars=sidecars,
             layout=layout)
    try:
        tokens = tokens_for(n_pages, seed)
        out = {"rank": rank}
        if do_write:
            hi = r.alloc_host(n_pages * PAGE, start_owner=write_phase)
            r.fill(hi, n_pages, salt)
            out["backed_up"] = r.backup(tokens, hi)
            if drop_sidecar_page is not None and r.owner_of_page_start(int(hi[drop_sidecar_page * PAGE])) == rank:
                from sglang.srt.mem_cache.utils import get_storage_hash_str

                h = get_storage_hash_str(tokens, None, page_size=PAGE)[drop_sidecar_page]
                assert r.backend.store.delete("indexer", r.backend.keys.keys([h], rank)) == 1
            r.group.free(hi)
            r.zero_host()
        r.dist.barrier()
        hit, completed, hi2 = r.prefetch(tokens)
        out.update(hit=hit, completed=completed)
        if hi2 is not None:
            owners = [r.owner_of_page_start(int(hi2[i * PAGE])) if sharded else rank
                      for i in range(len(hi2) // PAGE)]
            out["owners"] = owners
            out["checked"], out["equal"] = r.check(hi2, completed // PAGE, salt)
        out["stats"] = r.backend.l3_stats()["counters"]
        return out
    finally:
        r.close()


def restore_and_check(r, tokens, salt, out) -> None:
    """Upstream's prefetch of ``tokens`` on rank ``r``; ``out`` gets the agreed hit, the completed tokens and
    (when something was restored) the pages of this rank's stripe checked / equal to the ``salt`` pattern."""
    hit, completed, hi2 = r.prefetch(tokens)
    out.update(hit=hit, completed=completed)
    if hi2 is not None:
        out["checked"], out["equal"] = r.check(hi2, completed // PAGE, salt=salt)


def _digest(*parts) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def skew(rank, world, rendezvous, l3_config, n_pages, slow_rank, fail_rank, fail_nth):
    """One rank writes slowly, another fails its fail_nth page write (EIO at the I/O seam)."""
    import errno
    import time

    r = Rank(rank, world, rendezvous, l3_config, sharded=True, extra_args=("--enable-metrics",))
    try:
        store = r.backend.store
        if rank == slow_rank:
            orig = store.write_pages

            def slow(*a, **k):
                time.sleep(0.4)
                return orig(*a, **k)
            store.write_pages = slow
        failed_logical = None
        tokens = tokens_for(n_pages, seed=3)
        hi = r.alloc_host(n_pages * PAGE, start_owner=0)
        owned_logical = [i for i in range(n_pages) if r.owner_of_page_start(int(hi[i * PAGE])) == rank]
        if rank == fail_rank:
            slab = store.state.pools["kv"].slab  # the store's own fault seam (l3/format/disk_slab.py)
            bad = {"slot": None, "seen": 0}

            def inject(op, _slab, slot):
                # A bad sector: the fail_nth slot this rank writes fails every time.
                if op != "write":
                    return
                if bad["slot"] is None:
                    bad["seen"] += 1
                    if bad["seen"] == fail_nth:
                        bad["slot"] = slot
                if slot == bad["slot"]:
                    raise OSError(errno.EIO, "injected EIO")
            slab.fault_injector = inject
        r.fill(hi, n_pages)
        backed = r.backup(tokens, hi)
        # Which of this rank's pages did not become durable (the store coalesces slots,
        # so one injected EIO can cost more than one page): ask the index, page by page.
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        keys = r.backend.keys.keys(hashes, rank)
        missing = [i for i in owned_logical if store.exists_prefix("kv", [keys[i]]) == 0]
        failed_logical = missing[0] if missing else None
        r.group.free(hi)
        r.zero_host()
        r.dist.barrier()
        hit, completed, hi2 = r.prefetch(tokens)
        checked = equal = 0
        owners = []
        if hi2 is not None:
            owners = [r.owner_of_page_start(int(hi2[i * PAGE])) for i in range(hit // PAGE)]
            checked, equal = r.check(hi2, completed // PAGE)
        from prometheus_client import REGISTRY, generate_latest

        r.backend._metrics.publish_once()  # what /metrics would show now
        metrics = [line for line in generate_latest(REGISTRY).decode().splitlines()
                   if line.startswith("sglang:cp_l3_write_errors_total")]
        return {"rank": rank, "backed": backed, "hit": hit, "completed": completed, "owners": owners,
                "metrics": metrics,
                "checked": checked, "equal": equal, "failed_logical": failed_logical,
                "digest": _digest(hit, completed, owners),
                "write_errors": r.backend.l3_stats()["counters"].get("write_errors", 0)}
    finally:
        r.close()


def identity_probe(rank, world, rendezvous, l3_config, n_pages, write, model_name, extra_key, cold_start):
    """Write under one identity, or read back under another: collisions must be misses."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    r = Rank(rank, world, rendezvous, l3_config, sharded=False, cold_start=cold_start, model_name=model_name)
    try:
        tokens = RadixKey(tokens_for(n_pages, seed=11), extra_key=extra_key)
        out = {"rank": rank}
        if write:
            hi = r.alloc_host(n_pages * PAGE)
            r.fill(hi, n_pages, salt=5)
            out["backed"] = r.backup(tokens, hi)
        else:
            restore_and_check(r, tokens, 5, out)
        return out
    finally:
        r.close()


def count_collectives(rank, world, rendezvous, l3_config, sharded, n_pages, host_pages=64):
    """Count gloo all_reduce calls per thread: while idle, and for one prefetch."""
    import collections
    import threading
    import time

    import torch.distributed as dist

    counts = collections.Counter()
    orig = dist.all_reduce

    def counting(*a, **k):
        counts[threading.current_thread().name.split("-")[0]] += 1
        return orig(*a, **k)
    dist.all_reduce = counting
    r = Rank(rank, world, rendezvous, l3_config, sharded=sharded, host_pages=host_pages)
    # The store's hit queries (exists_*), to check one per query whatever the sharding.
    store = r.backend.store
    queries = collections.Counter()
    for name in ("exists_prefix", "exists_prefix_multi", "exists_each"):
        def wrap(fn, name=name):
            def counted(*a, **k):
                queries[name] += 1
                return fn(*a, **k)
            return counted
        setattr(store, name, wrap(getattr(store, name)))
    try:
        tokens = tokens_for(n_pages, seed=21)
        hi = r.alloc_host(n_pages * PAGE, start_owner=0)
        r.fill(hi, n_pages)
        r.backup(tokens, hi)
        r.dist.barrier()
        counts.clear()
        time.sleep(2.5)  # storage threads are polling their queues: an idle period
        idle = sum(counts.values())
        counts.clear()
        queries.clear()
        hit, completed, _ = r.prefetch(tokens)
        time.sleep(0.5)
        return {"rank": rank, "idle": idle, "prefetch": sum(counts.values()), "hit": hit,
                "completed": completed, "index_queries": sum(queries.values())}
    finally:
        dist.all_reduce = orig
        r.close()


def placement_assert(rank, world, rendezvous, l3_config, n_pages, diverge):
    """--cp-hicache-placement-assert: agreeing ranks pass; a diverged phase raises on all ranks."""
    from sglang_cp.integration.cp_l3.prefetch import PlacementMismatch, plan_of

    r = Rank(rank, world, rendezvous, l3_config, sharded=True, extra_args=("--cp-hicache-placement-assert",))
    try:
        tokens = tokens_for(n_pages, seed=5)
        hi = r.alloc_host(n_pages * PAGE, start_owner=1)
        r.fill(hi, n_pages)
        r.backup(tokens, hi)
        r.group.free(hi)
        r.dist.barrier()
        if diverge and rank == 1:
            orig = r.cc.allocate_storage_hit

            def skewed(op, *a, **k):  # simulate a rank-local bug: a different phase on rank 1
                plan = plan_of(op)
                plan.start_owner = (plan.start_owner + 1) % world
                return orig(op, *a, **k)
            r.cc.allocate_storage_hit = skewed
        try:
            hit, completed, _ = r.prefetch(tokens)
            return {"rank": rank, "hit": hit, "completed": completed, "raised": None}
        except PlacementMismatch as e:
            return {"rank": rank, "raised": str(e)}
    finally:
        r.close()


def forced_phase_probe(rank, world, rendezvous, l3_config, n_pages, write_phase, anchor_phase):
    """Prefetch as the radix cache would under an anchor whose chain fixes the phase."""
    from sglang_cp.integration.cp_l3.plan import AnchorNote
    from sglang_cp.integration.cp_l3.plan import RESTORE

    r = Rank(rank, world, rendezvous, l3_config, sharded=True)
    try:
        tokens = tokens_for(n_pages, seed=8)
        anchor = "a5" * 32  # the span continues an anchor chain whose last page hash is this
        hi = r.alloc_host(n_pages * PAGE, start_owner=write_phase)
        r.fill(hi, n_pages)
        r.backup(tokens, hi, prior_hash=anchor)
        r.group.free(hi)
        r.zero_host()
        r.dist.barrier()
        # What the tree core's anchor query notes right before upstream creates the operation.
        RESTORE.anchors.write(AnchorNote(last_hash=anchor, phase=anchor_phase))
        hit, completed, hi2 = r.prefetch(tokens, last_hash=anchor)
        owners = [r.owner_of_page_start(int(hi2[i * PAGE])) for i in range(len(hi2) // PAGE)] if hi2 is not None else []
        checked, equal = r.check(hi2, completed // PAGE) if hi2 is not None else (0, 0)
        return {"rank": rank, "hit": hit, "completed": completed, "owners": owners, "checked": checked,
                "equal": equal}
    finally:
        r.close()


def host_bytes_probe(rank, world, rendezvous, l3_config, sharded, n_pages):
    """Every page of this rank's stripe, in every payload (target KV and the sidecars): the bytes the
    backend hands the store (``HostPageBytes``: a slice of one view of the pool's buffer) are the page's
    own memory, as upstream's page tensor has it; and reading or writing a prefetch's pages runs no torch
    ``view`` per page (each releases the GIL: docs_internal/figures.md, "A busy scheduler thread")."""
    import torch

    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from sglang_cp.integration.cp_l3.host_views import as_bytes_view as _as_bytes_view

    r = Rank(rank, world, rendezvous, l3_config, sharded=sharded, sidecars=True)
    try:
        b = r.backend
        hi = r.alloc_host(n_pages * PAGE, start_owner=0)
        r.fill(hi, n_pages, salt=3)
        mine = b._pages(hi, n_pages)
        out = {"rank": rank, "pages": len(mine), "payloads": sorted(b.payloads), "same": 0, "fast": 0}
        for payload in sorted(b.payloads):
            pool = b._pool_for(payload)
            for _i, row in mine:
                page = pool.get_data_page(row, flat=False)
                got, ref = b.host_bytes.of(payload, pool, page), _as_bytes_view(page)
                out["fast"] += got is not None
                out["same"] += got is not None and (got.__array_interface__["data"][0],
                                                    got.nbytes) == (ref.__array_interface__["data"][0], ref.nbytes)
        keys = get_storage_hash_str(tokens_for(n_pages, seed=5), None, page_size=PAGE)
        views = {"n": 0}
        plain = torch.Tensor.view

        def counting(self, *a, **k):
            views["n"] += 1
            return plain(self, *a, **k)
        torch.Tensor.view = counting
        try:
            for payload in sorted(b.payloads):
                b._set(payload, keys, hi)
                b._finish_get(b._start_get(payload, keys, hi))
        finally:
            torch.Tensor.view = plain
        out["views"] = views["n"]
        # Starting a whole prefetch's reads again (rows located, pages durable) keeps the GIL throughout:
        # page starts, this rank's stripe, each page's bytes, the store's slot lookups and hand-off.
        from suite_helpers import gil_releases_seen
        reads, out["gil_released"] = gil_releases_seen(
            lambda: [b._start_get(payload, keys, hi) for payload in sorted(b.payloads)])
        out["restored"] = [b._finish_get(read) for read in reads]
        out["checked"], out["equal"] = r.check(hi, n_pages, salt=3)  # the read-back left every byte as filled
        return out
    finally:
        r.close()


def restore_fault_probe(rank, world, rendezvous, l3_config, n_pages, fault_rank, where):
    """A restore whose data path raises on ``fault_rank`` (three payloads: target KV and two sidecars):
    ``where = "finish"``: finishing the target KV's reads raises (as a store that turned fatal does), so the
    sidecars' reads are still under way; ``"start"``: starting the second payload raises, after the first's
    reads were put on the device. Reports the prefetch's agreed count and, on every rank, how many of the
    store reads started for it were finished (waited for) before upstream got the count: a read left
    running writes host pages the miss hands back to the pool."""
    r = Rank(rank, world, rendezvous, l3_config, sharded=True, sidecars=True)
    try:
        b = r.backend
        tokens = tokens_for(n_pages, seed=11)
        hi = r.alloc_host(n_pages * PAGE, start_owner=0)
        r.fill(hi, n_pages, salt=5)
        r.backup(tokens, hi)
        r.group.free(hi)
        r.zero_host()
        r.dist.barrier()
        started, finished = [], []
        start, finish = b.store.start_read_pages, b.store.finish_read_pages

        def start_spy(*a, **k):
            pending = start(*a, **k)
            started.append(pending)
            return pending

        def finish_spy(pending):
            finished.append(pending)
            return finish(pending)
        b.store.start_read_pages, b.store.finish_read_pages = start_spy, finish_spy
        if rank == fault_rank and where == "finish":
            finish_get = b._finish_get

            def failing_finish(read):
                got = finish_get(read)
                if read.payload == "kv":
                    raise RuntimeError("injected: the target KV's reads failed after they finished")
                return got
            b._finish_get = failing_finish
        elif rank == fault_rank and where == "start":
            start_get = b._start_get

            def failing_start(payload, keys, host_indices):
                if payload != "kv":
                    raise RuntimeError(f"injected: starting {payload}'s reads failed")
                return start_get(payload, keys, host_indices)
            b._start_get = failing_start
        hit, completed, _ = r.prefetch(tokens)
        return {"rank": rank, "hit": hit, "completed": completed, "started": len(started),
                "finished": sum(any(p is q for q in finished) for p in started)}
    finally:
        r.close()


def late_draft_probe(rank, world, rendezvous, l3_config, sharded, n_pages):
    """A draft KV pool registered as a sidecar after the store opened, as upstream registers an EAGLE
    draft (``UnifiedRadixCache.register_sidecar_pool`` -> ``register_host_pool_entry``): its pages are
    backed up and restored with the target KV's, byte for byte in both payloads."""
    import torch

    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    r = Rank(rank, world, rendezvous, l3_config, sharded=sharded, sidecars=False)
    try:
        out = {"rank": rank, "payloads_at_open": sorted(r.backend.payloads)}
        pages = 64
        dev = MLATokenToKVPool(size=pages * PAGE, page_size=PAGE, dtype=torch.uint8, kv_lora_rank=652,
                               qk_rope_head_dim=4, layer_num=1, device="cpu", enable_memory_saver=False)
        draft = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, PAGE, "page_first",
                                     pin_memory=False, device="cpu", override_kv_cache_dim=656,
                                     device_capacity_tokens=pages * PAGE, start_layer=0, end_layer=0,
                                     target_layer_num=1, host_token_capacity=pages * PAGE, pool_label="draft")
        r.cc.register_host_pool_entry(build_pool_entry(name=PoolName.DRAFT, host_pool=draft, device_pool=dev,
                                                       layer_mapping={0: 0}, transfer_layer_id_max=1))
        r.sidecar_hosts[PoolName.DRAFT] = draft
        out["payloads"] = sorted(r.backend.payloads)
        tokens = tokens_for(n_pages, seed=9)
        hi = r.alloc_host(n_pages * PAGE, start_owner=0)
        r.fill(hi, n_pages, salt=2)
        out["backed_up"] = r.backup(tokens, hi)
        r.group.free(hi)
        r.zero_host()
        r.dist.barrier()
        restore_and_check(r, tokens, 2, out)
        return out
    finally:
        r.close()
