"""Offline consistency check of an L3 directory: slab headers against the shared LMDB index.

Run with no server using the directory (``sglang-cp l3 fsck``). What it finds, per index entry
and per slab slot (docs_internal/cachebench.md has the table and the exit codes):

- dangling: an index entry whose slab file, disk or slot does not exist, or whose slot's
  header is missing/unparsable or names another key, payload, slot or length;
- crc: an entry whose slot holds its header but whose payload CRC fails;
- cross_rank: an entry whose slot holds a blob of another rank, or two entries of
  different ranks claiming one slot (``collision`` when both are of one rank);
- orphan (informational): a slot with a valid blob no entry references. The store leaves
  the bytes of freed slots in place (GC, ``clear``, an index commit lost in a crash);
  recovery trusts only referenced slots, so an orphan is inert and not a problem;
- stray (informational): a file named like a slab that the store never writes (its slot
  size is not a positive multiple of 4096, or it is not a regular file). It is skipped, never
  read; entries naming its rank and payload are judged against the real slabs only.

A live directory: a store that writes while fsck reads frees and rewrites slots under it,
so entries read from the index snapshot turn ``dangling`` or even ``crc`` by the time their slot is
read. ``live_owners`` names the ranks whose lock (``format/ownership.py``) a live store holds; the CLI refuses
to check such a directory unless ``--live``, and then ``confirm_live`` keeps a problem only if its
entry still maps the same slot (same seq) after the slot was read, the rest turning ``transient``
(informational). That is sound because of the store's order: a slot is freed only after its entry's
delete committed, and a rewritten page gets a new seq, so an entry present before and after the slot
reads held that slot throughout.

``--repair`` deletes every problem entry (a conditional delete: only if the key still maps
to that exact rank/disk/slot/seq) and zeroes the header block of orphans so they can never
be mistaken for data. Safe only with no live user of the directory: ``live_users`` looks
for processes holding the index or a slab file open (``/proc/*/fd`` and ``/proc/*/maps``)
and the CLI refuses ``--repair`` while there are any.
"""

from __future__ import annotations

import os
import re
import stat
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..format.aligned import aligned_buffer
from ..format.blob import (ALIGN, HEADER_BYTES, BlobError, crc32c, header_block, parse_header, payload_tag,
                   write_extent)
from ..config import L3Config
from ..format.index import IndexEntry, LmdbIndex, SharedIndex, ikey_digest
from ..format.ownership import Holder, probe

from ..config import SLAB_SUBDIR  # noqa: F401  (re-exported: where the store keeps slabs)
_SLAB_NAME = re.compile(r"^r(\d+)\.([A-Za-z0-9_-]{1,64})\.s(\d+)\.slab$")
SLAB_NAME = _SLAB_NAME  # r<rank>.<payload>.s<slot bytes>.slab
PROBLEMS = ("dangling", "crc", "cross_rank", "collision")
INFO = ("orphan", "stray", "transient")


@dataclass
class Slab:
    path: str
    disk: int
    rank: int
    payload: str
    slot_bytes: int
    num_slots: int
    page_bytes: int | None = None  # from the index entries (or the first valid header found)

    @property
    def tag(self) -> int:
        return payload_tag(self.payload)


@dataclass
class Finding:
    kind: str
    slab: str | None
    slot: int | None
    rank: int | None
    detail: str
    ikey: bytes | None = None
    entry: IndexEntry | None = None


@dataclass
class Report:
    slabs: list[Slab] = field(default_factory=list)
    entries: int = 0
    live: int = 0
    findings: list[Finding] = field(default_factory=list)
    repaired: Counter = field(default_factory=Counter)
    repair_failed: int = 0
    cleared_after_delete: int = 0

    def counts(self) -> Counter:
        return Counter(f.kind for f in self.findings)

    def problems(self) -> int:
        c = self.counts()
        return sum(c[k] for k in PROBLEMS)


def find_slabs(config: L3Config, strays: list | None = None) -> list[Slab]:
    """The slab files of every disk; files only named like one go to ``strays`` as (path, why)."""
    out = []
    for d_i, disk in enumerate(config.disks):
        sub = config.slab_dir(disk.path)
        if not os.path.isdir(sub):
            continue
        for name in sorted(os.listdir(sub)):
            m = _SLAB_NAME.match(name)
            if not m:
                continue
            path = os.path.join(sub, name)
            slot_bytes = int(m.group(3))
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            why = None
            if not stat.S_ISREG(st.st_mode):
                why = "not a regular file"
            elif slot_bytes <= 0 or slot_bytes % ALIGN:
                why = f"slot size {slot_bytes} B is not a positive multiple of {ALIGN} (the store never writes it)"
            if why is not None:
                if strays is not None:
                    strays.append((path, why))
                continue
            out.append(Slab(path, d_i, int(m.group(1)), m.group(2), slot_bytes, st.st_size // slot_bytes))
    return out


def open_index(config: L3Config, must_exist: bool = True) -> LmdbIndex | None:
    if must_exist and not os.path.exists(os.path.join(config.index_dir, "data.mdb")):
        return None
    return SharedIndex(config.index_dir, config.index.map_size_bytes, config.index.max_map_size_bytes)


def all_entries(index: LmdbIndex) -> list[tuple[bytes, IndexEntry]]:
    return index.all_entries()


class _Reader:
    """O_DIRECT reads of slab slots (what the store itself sees, not a stale page cache)."""

    def __init__(self):
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW)
        return self._fds[path]

    def read(self, slab: Slab, slot: int, off: int, length: int) -> memoryview:
        buf = aligned_buffer(length)
        n = os.preadv(self.fd(slab.path), [buf], slot * slab.slot_bytes + off)
        return memoryview(buf)[:n]

    def header(self, slab: Slab, slot: int, page_bytes: int):
        off, length = header_block(page_bytes)
        buf = self.read(slab, slot, off, length)
        start = page_bytes - off
        return parse_header(buf[start:start + HEADER_BYTES])

    def payload_crc(self, slab: Slab, slot: int, page_bytes: int) -> int:
        buf = self.read(slab, slot, 0, write_extent(page_bytes))
        if len(buf) < page_bytes:
            raise BlobError("short_read")
        return crc32c(buf[:page_bytes])

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _guess_page_bytes(reader: _Reader, slab: Slab, tries: int = 64) -> int | None:
    """No entry names this slab's page size: find a header in the last block(s) of a slot
    (the header follows the payload and the slot is the payload + header rounded to 4 KiB)."""
    span = min(slab.slot_bytes, 2 * ALIGN)
    for slot in range(min(tries, slab.num_slots)):
        buf = reader.read(slab, slot, slab.slot_bytes - span, span)
        pos = bytes(buf).find(b"CPL3")
        while pos >= 0:
            try:
                h = parse_header(buf[pos:pos + HEADER_BYTES])
                if h.length == slab.slot_bytes - span + pos:
                    return h.length
            except BlobError:
                pass
            pos = bytes(buf).find(b"CPL3", pos + 1)
    return None


def check(config: L3Config, *, full: bool = True) -> Report:
    """Scan everything; ``full`` also reads every referenced payload and checks its CRC."""
    strays: list[tuple[str, str]] = []
    rep = Report(slabs=find_slabs(config, strays))
    rep.findings += [Finding("stray", path, None, None, why + "; skipped (remove it if nothing of yours uses it)")
                     for path, why in strays]
    index = open_index(config)
    entries = all_entries(index) if index is not None else []
    if index is not None:
        index.close()
    rep.entries = len(entries)
    by_key = defaultdict(list)  # (disk, rank, tag) -> slabs (several slot sizes may coexist)
    for s in rep.slabs:
        by_key[(s.disk, s.rank, s.tag)].append(s)
    lengths = defaultdict(Counter)
    for _, e in entries:
        lengths[(e.disk, e.rank, e.payload_tag)][e.length] += 1
    reader = _Reader()
    try:
        for s in rep.slabs:
            common = lengths[(s.disk, s.rank, s.tag)].most_common(1)
            try:
                s.page_bytes = common[0][0] if common else _guess_page_bytes(reader, s)
            except OSError:
                s.page_bytes = None  # unreadable: its entries (if any) turn dangling below
        # slot -> entries whose slot holds a parsable header of their rank (right key or not)
        claimed: dict[tuple[str, int], list[tuple[bytes, IndexEntry, bool]]] = defaultdict(list)
        for ikey, e in entries:
            _check_entry(rep, reader, by_key, ikey, e, claimed, full)
        for (path, slot), owners in claimed.items():
            ranks = sorted({e.rank for _, e, _ in owners})
            for ikey, e, matches in owners:
                if matches:
                    continue
                if len(owners) == 1:
                    rep.findings.append(Finding("dangling", path, slot, e.rank,
                                                "the slot holds another key's blob", ikey, e))
                else:  # the header names the one true owner; the rest lose
                    kind = "cross_rank" if len(ranks) > 1 else "collision"
                    rep.findings.append(Finding(kind, path, slot, e.rank,
                                                f"{len(owners)} entries (ranks {ranks}) claim this slot", ikey, e))
        live_slots = {(p, slot) for (p, slot), owners in claimed.items()}
        for s in rep.slabs:
            if s.page_bytes is None or s.page_bytes + HEADER_BYTES > s.slot_bytes:
                continue
            for slot in range(s.num_slots):
                if (s.path, slot) in live_slots:
                    continue
                try:
                    h = reader.header(s, slot, s.page_bytes)
                except (BlobError, OSError):
                    continue
                if h.slot == slot and h.rank == s.rank and h.payload_tag == s.tag:
                    rep.findings.append(Finding("orphan", s.path, slot, s.rank,
                                                "valid blob, no index entry (inert)"))
        bad = {(f.ikey, f.entry) for f in rep.findings if f.kind in PROBLEMS}
        rep.live = sum(1 for ikey, e in entries if (ikey, e) not in bad)
    finally:
        reader.close()
    return rep


def _check_entry(rep, reader, by_key, ikey, e, claimed, full) -> None:
    cands = by_key.get((e.disk, e.rank, e.payload_tag), [])
    if not cands:
        rep.findings.append(Finding("dangling", None, e.slot, e.rank,
                                    f"no slab file for rank {e.rank}, disk {e.disk}, payload tag {e.payload_tag:#x}",
                                    ikey, e))
        return
    last_err = None
    for s in cands:  # several slot sizes of one (rank, payload) may coexist after a config change
        if not 0 <= e.slot < s.num_slots or e.length + HEADER_BYTES > s.slot_bytes:
            last_err = (s, f"slot {e.slot} outside the slab ({s.num_slots} slots of {s.slot_bytes} B)")
            continue
        try:
            h = reader.header(s, e.slot, e.length)
        except (BlobError, OSError) as err:
            last_err = (s, f"header: {err}")
            continue
        if h.rank != e.rank:
            rep.findings.append(Finding("cross_rank", s.path, e.slot, e.rank,
                                        f"slot holds a blob of rank {h.rank}", ikey, e))
            return
        if h.slot != e.slot or h.payload_tag != e.payload_tag or h.length != e.length:
            last_err = (s, f"header names slot {h.slot}, tag {h.payload_tag:#x}, length {h.length}")
            continue
        matches = h.digest == ikey_digest(ikey)
        claimed[(s.path, e.slot)].append((ikey, e, matches))
        if matches and full:
            try:
                if reader.payload_crc(s, e.slot, e.length) != h.payload_crc:
                    rep.findings.append(Finding("crc", s.path, e.slot, e.rank, "payload CRC mismatch", ikey, e))
            except (BlobError, OSError) as err:
                rep.findings.append(Finding("crc", s.path, e.slot, e.rank, f"payload read: {err}", ikey, e))
        return
    s, why = last_err
    rep.findings.append(Finding("dangling", s.path, e.slot, e.rank, why, ikey, e))


def live_owners(config: L3Config) -> list[tuple[int, Holder]]:
    """(rank, holder) of every rank of this config's directories a live store holds (its rank lock in
    the index directory or a slab directory; /proc/locks, no lock taken)."""
    held: dict[int, Holder] = {}
    for d in [config.index_dir] + [config.slab_dir(disk.path) for disk in config.disks]:
        for rank, holder in probe(d):
            held.setdefault(rank, holder)
    return sorted(held.items())


def _same_slot(a: IndexEntry, b: IndexEntry) -> bool:
    return (a.rank, a.disk, a.slot, a.payload_tag, a.length, a.seq) == (b.rank, b.disk, b.slot, b.payload_tag,
                                                                          b.length, b.seq)


def confirm_live(config: L3Config, rep: Report) -> int:
    """After check() on a directory a live store writes: a problem whose entry no longer maps the same
    slot (deleted, or rewritten with a new seq) turns ``transient``; the others stay problems. Returns
    the number made transient. Call it after check(): the index is read again after every slot read."""
    doubtful = [f for f in rep.findings if f.kind in PROBLEMS and f.ikey is not None]
    if not doubtful:
        return 0
    index = open_index(config)
    if index is None:
        now = [None] * len(doubtful)
    else:
        try:
            now = index.get_many([f.ikey for f in doubtful])
        finally:
            index.close()
    n = 0
    for f, e in zip(doubtful, now):
        if e is None or not _same_slot(e, f.entry):
            f.detail = f"{f.kind}: {f.detail}; the entry was deleted or rewritten while fsck read it (live writer)"
            f.kind = "transient"
            n += 1
    bad = {(f.ikey, f.entry) for f in rep.findings if f.kind in PROBLEMS}
    rep.live = rep.entries - len(bad)
    return n


def repair(config: L3Config, rep: Report) -> Report:
    """Delete problem entries (conditionally), then zero the header block of every orphan:
    those found, and the slots whose entries were just deleted (a CRC-failed blob keeps a
    valid header and would otherwise show up as an orphan on the next run)."""
    doomed = [(f.ikey, f.entry) for f in rep.findings if f.kind in PROBLEMS and f.ikey is not None]
    if doomed:
        index = open_index(config)
        try:
            flags = index.commit(deletes=doomed)
        finally:
            index.close()
        kinds = {(f.ikey, f.entry): f.kind for f in rep.findings if f.kind in PROBLEMS}
        for (ikey, e), ok in zip(doomed, flags):
            if ok:
                rep.repaired[kinds[(ikey, e)]] += 1
            else:
                rep.repair_failed += 1
    slabs = {s.path: s for s in rep.slabs}
    found = [(f.slab, f.slot) for f in rep.findings if f.kind == "orphan"]
    rep.repaired["orphan"] += _wipe_headers(slabs, found, rep)
    if doomed:
        after = check(config, full=False)
        rep.cleared_after_delete = _wipe_headers(
            slabs, [(f.slab, f.slot) for f in after.findings if f.kind == "orphan"], rep)
    if not rep.repaired["orphan"]:
        del rep.repaired["orphan"]
    return rep


def _wipe_headers(slabs: dict, where: list, rep: Report) -> int:
    n = 0
    for path, slot in where:
        s = slabs[path]
        off, length = header_block(s.page_bytes)
        fd = os.open(s.path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            buf = aligned_buffer(length)  # anonymous mmap: zero filled
            if os.pwritev(fd, [buf], slot * s.slot_bytes + off) != length:
                rep.repair_failed += 1
                continue
            os.fdatasync(fd)
        finally:
            os.close(fd)
        n += 1
    return n


def live_users(config: L3Config) -> list[tuple[int, str]]:
    """(pid, command) of other processes holding the index or a slab file open or mapped."""
    targets = {os.path.realpath(os.path.join(config.index_dir, n)) for n in ("data.mdb", "lock.mdb")}
    targets |= {os.path.realpath(s.path) for s in find_slabs(config)}
    me = os.getpid()
    users = []
    for pid_s in os.listdir("/proc"):
        if not pid_s.isdigit() or int(pid_s) == me:
            continue
        pid = int(pid_s)
        held = False
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                        held = True
                        break
                except OSError:
                    continue
            if not held:
                with open(f"/proc/{pid}/maps") as f:
                    held = any(line.rstrip().split(" ")[-1] in targets for line in f)
            if held:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                users.append((pid, cmd[:160]))
        except OSError:
            continue  # gone, or not ours to read
    return users
