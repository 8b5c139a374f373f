"""Rank programs for the CP L3 multi-process tests (run inside cp_harness.run_ranks)."""

from __future__ import annotations

from cp_harness import PAGE, Rank


def tokens_for(n_pages: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n_pages * PAGE)]


def roundtrip(rank, world, port, l3_config, sharded, n_pages, write_phase, cold_start="clear",
              do_write=True, salt=0, seed=0):
    """Back up n_pages, wipe the host pool, prefetch them back, compare this rank's stripe."""
    r = Rank(rank, world, port, l3_config, sharded=sharded, cold_start=cold_start)
    try:
        tokens = tokens_for(n_pages, seed)
        out = {"rank": rank}
        if do_write:
            hi = r.alloc_host(n_pages * PAGE, start_owner=write_phase)
            r.fill(hi, n_pages, salt)
            out["backed_up"] = r.backup(tokens, hi)
            r.group.free(hi)
            r.zero_host()
        r.dist.barrier()
        hit, completed, hi2 = r.prefetch(tokens)
        out.update(hit=hit, completed=completed)
        if hi2 is not None:
            owners = [r.owner_of_page_start(int(hi2[i * PAGE])) if sharded else rank for i in range(n_pages)]
            out["owners"] = owners
            out["checked"], out["equal"] = r.check(hi2, completed // PAGE, salt)
        out["stats"] = r.backend.l3_stats()["counters"]
        return out
    finally:
        r.close()
