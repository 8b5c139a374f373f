"""Cold start of one rank's L3 state, run before the store's threads start.

clear: delete this rank's index entries, all slots free.
load: a slot is live iff the index maps a key to exactly that slot AND the slot's header parses, its
      CRC holds and it names that key digest, payload, rank, slot and length. Live slots are occupied
      and seed the LRU; every other entry of this rank is deleted from the index, so no slot the index
      references is ever free, and no two entries share a slot.
verify: load + a full payload CRC of every live slot.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from .format.aligned import BounceBuffers
from .format.blob import BlobError, check_identity
from .format.index import IndexEntry, LmdbIndex, ikey_digest
from .payload_slab import PayloadSlab

# The modes and the default of --cp-l3-cold-start, of L3Store(cold_start=) and of cachebench: defined
# here only, where they are implemented; args.py, the backend and cachebench import them.
COLD_START_MODES = ("clear", "load", "verify")
DEFAULT_COLD_START = "clear"  # never trusts what is on disk: a changed or damaged tier costs nothing
_RECORD_NAME = "r{rank}.cold_start.json"
_RECORD_RE = re.compile(r"^r(\d+)\.cold_start\.json$")


def record_path(slab_dir: str, rank: int) -> str:
    return os.path.join(slab_dir, _RECORD_NAME.format(rank=rank))


def write_record(slab_dir: str, rank: int, result: dict) -> None:
    """Persist this rank's last cold start next to its slabs, so `sglang-cp l3 stats` can show it
    offline. Atomic (temp file, fsync, rename, directory fsync): a crash leaves the old record or the
    new one, never a torn file. Raises OSError; the caller decides whether that matters."""
    rec = dict(result, rank=rank, finished_unix=round(time.time(), 3), pid=os.getpid(),
               host=socket.gethostname())
    path = record_path(slab_dir, rank)
    stale = os.path.basename(path) + ".tmp."
    for name in os.listdir(slab_dir):  # a crash between write and rename left one: ours, so drop it
        if name.startswith(stale):
            os.unlink(os.path.join(slab_dir, name))
    tmp = f"{path}.tmp.{os.getpid()}"
    # 0600, created here (O_EXCL: never an existing file or a link); rename replaces a link, never follows it.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(slab_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(slab_dir: str, rank: int) -> dict | None:
    """The recorded last cold start of `rank`, None if there is none; a damaged record says so."""
    try:
        fd = os.open(record_path(slab_dir, rank), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return {"rank": rank, "error": f"unreadable record ({e})"}
    return rec if isinstance(rec, dict) else {"rank": rank, "error": "record is not a JSON object"}


def check_mode(mode: str) -> None:
    """ValueError unless `mode` is a cold-start mode (the store checks before it opens anything)."""
    if mode not in COLD_START_MODES:
        raise ValueError(f"cold_start: {mode!r} is not one of {', '.join(COLD_START_MODES)} "
                         "(--cp-l3-cold-start)")


def run_cold_start(mode: str, index: LmdbIndex, rank: int, pools: dict[int, PayloadSlab], threads: int) -> dict:
    check_mode(mode)
    t0 = time.monotonic()
    for p in pools.values():
        p.reset()
    if mode == "clear":
        n = index.delete_rank(rank)
        _rebuild_held_tables(pools)
        return {"mode": mode, "index_entries_wiped": n, "live": 0, "dropped": 0,
                "seconds": round(time.monotonic() - t0, 3)}
    entries = index.scan_rank(rank)
    bounce = BounceBuffers()
    verify = mode == "verify"

    def check(item):
        ikey, e = item
        pool = pools.get(e.payload_tag)
        if pool is None:
            return item, "other_payload"
        if not pool.entry_fits(e):
            return item, "geometry"
        try:
            h = pool.read_header(e.slot, bounce)
            check_identity(h, payload_tag=pool.tag, rank=rank, slot=e.slot, length=pool.page_bytes,
                           digest=ikey_digest(ikey))
            if verify:
                pool.verify_payload(e.slot, h, bounce)
        except BlobError as err:
            return item, err.reason
        except OSError:
            return item, "io_error"
        return item, None

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="l3-recover") as ex:
        results = list(ex.map(check, entries))

    live: dict[int, list[tuple[bytes, IndexEntry]]] = {t: [] for t in pools}
    claimed: set[tuple[int, int]] = set()
    doomed, reasons = [], {}
    for (ikey, e), why in results:
        if why == "other_payload":
            continue  # a payload this run did not open: its slab is not ours to judge now
        if why is None and (e.payload_tag, e.slot) in claimed:
            why = "slot_claimed_twice"
        if why is not None:
            doomed.append((ikey, e))
            reasons[why] = reasons.get(why, 0) + 1
            continue
        claimed.add((e.payload_tag, e.slot))
        live[e.payload_tag].append((ikey, e))
    # Drop dangling entries before anything can allocate the slots they name.
    index.commit(deletes=doomed)
    for tag, items in live.items():
        pool = pools[tag]
        pool.slots.rebuild_from_allocated(e.slot for _, e in items)
        pool.lru.seed(items)
        pool.owner = {e.slot: k for k, e in items}
    _rebuild_held_tables(pools)
    return {"mode": mode, "scanned": len(entries), "live": sum(len(v) for v in live.values()),
            "dropped": len(doomed), "drop_reasons": reasons, "seconds": round(time.monotonic() - t0, 3)}


def _rebuild_held_tables(pools: dict[int, PayloadSlab]) -> None:
    """Seeding and resetting pools drops the hit query's batch table; build it once, after all of them
    (the pools of a store share one HeldDigests)."""
    for held in {id(p.lru.held): p.lru.held for p in pools.values()}.values():
        held.rebuild_table()


def read_records(slab_dir: str) -> list[dict]:
    """Every rank's recorded last cold start in `slab_dir`, by rank."""
    ranks = sorted(int(m.group(1)) for m in map(_RECORD_RE.match, os.listdir(slab_dir)) if m)
    return [rec for rec in (read_record(slab_dir, r) for r in ranks) if rec is not None]
