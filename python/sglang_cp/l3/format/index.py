"""The node's shared LMDB index: (rank, payload tag, key digest) -> (rank, disk, slot, length, last_access, seq).

Format 2 (FORMAT): an entry's key is b"R" + rank (2 B big endian) + payload tag (4 B) + key digest
(16 B), so one rank's entries are one contiguous key range: cold start scans and deletes only its own
(`scan_rank` / `delete_rank` are range scans), whatever the other ranks hold. The format is stamped
under META_KEY (sorts before every entry); an index without it that holds entries is format 1 (keys
without the rank prefix, digests of another scheme) and is refused at open: it could never hit.

One environment per node, opened by every rank process (LMDB serialises writers across processes).
`sync=True`: a committed transaction is on stable storage, which is what makes "index commit" the
durability point of a page. A full map grows (x2 up to the configured maximum); in-process readers are
fenced by a reader/writer lock because LMDB forbids resizing with transactions open in the process.
When another process grew the map, LMDB reports MapResizedError and we adopt the new size (inside
lmdb.open, whose own first txn can meet it too, we open again; both retries are bounded).
A process killed inside a read txn (a rank, `sglang-cp l3 stats`) leaves its reader slot behind, and
that slot pins a snapshot: no page freed after it can be reused, so the file grows on every commit up
to the map limit. `reader_check()` clears slots of dead processes: at open, before growing the map,
and at most every _READER_CHECK_INTERVAL_S on the write path (one scan of the reader table).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from typing import Iterable, NamedTuple, Optional

import lmdb

from ..errors import L3InvariantError, L3StartupError
from .files import FILE_MODE, check_private_file, fsync_dir, private_dirs

_VAL = struct.Struct("<HHIIQQQ")
FORMAT = 2
META_KEY = b"M:format"        # value: b"%d" % FORMAT
_ENTRY = b"R"                 # first byte of every entry key
_RANK = struct.Struct(">H")   # big endian: a rank's keys sort together
_TAG = struct.Struct("<I")
IKEY_BYTES = 1 + 2 + 4 + 16
MAX_RANKS = 1 << 16
_READER_CHECK_INTERVAL_S = 10.0
_OPEN_ATTEMPTS = 8           # opens retried after MapResizedError (another rank grew the map)
_TXN_ATTEMPTS = 8            # txn begins retried after MapResizedError, adopting the new size
logger = logging.getLogger(__name__)
_LMDB_FILES = ("data.mdb", "lock.mdb")


class IndexEntry(NamedTuple):
    rank: int
    disk: int
    slot: int
    payload_tag: int
    length: int
    last_access: int
    seq: int

    def pack(self) -> bytes:
        return _VAL.pack(*self)

    @classmethod
    def unpack(cls, raw: bytes) -> "IndexEntry":
        return cls(*_VAL.unpack(raw))


class IndexFull(Exception):
    """The map is at its maximum size; the caller fails the batch soft."""


class IndexUnavailable(Exception):
    """LMDB failed for another reason (I/O error, disk full under the env); fail soft."""


def key_prefix(rank: int, tag: Optional[int] = None) -> bytes:
    """The bytes every index key of `rank` (and of payload `tag`, if given) starts with."""
    p = _ENTRY + _RANK.pack(rank)
    return p if tag is None else p + _TAG.pack(tag)


def index_key(tag: int, digest: bytes, rank: int) -> bytes:
    return key_prefix(rank, tag) + digest


def ikey_digest(ikey: bytes) -> bytes:
    """The key digest inside an index key (what the slot's blob header names)."""
    return ikey[7:]


class _RWLock:
    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class LmdbIndex:
    def __init__(self, path: str, map_size: int, max_map_size: int):
        self.path = path
        self.max_map_size = max_map_size
        self.grows = 0
        self._rw = _RWLock()
        # LMDB opens its files itself (following links): check ours before and after it does.
        private_dirs(path, "index.dir")
        files = [os.path.join(path, name) for name in _LMDB_FILES]
        fresh = not check_private_file(files[0], "index.dir")
        check_private_file(files[1], "index.dir")
        self.env = self._open_env(path, map_size)
        try:
            for f in files:  # a link swapped in meanwhile: refuse (lstat only, see check_private_file)
                check_private_file(f, "index.dir", fix_mode=False)
            if fresh:
                fsync_dir(path)  # data.mdb's directory entry survives a power loss
        except BaseException:
            self.env.close()
            raise
        self.stale_readers_cleared = 0
        self._reader_check()
        try:
            self._check_format()
        except BaseException:
            self.env.close()
            raise
        # Another rank may already have grown the map beyond our configured start size.
        cur = self.env.info()["map_size"]
        if cur < map_size:
            self.env.set_mapsize(map_size)

    @staticmethod
    def _open_env(path: str, map_size: int) -> lmdb.Environment:
        """lmdb.open begins a txn of its own (to open the main DB) right after it sized its map from the
        file. A rank that grows the map and commits past that size in between makes that txn fail with
        MapResizedError (seen when four ranks open a fresh index at once): open again, and the new open
        maps the grown file. Bounded: each retry needs another process to have grown the map meanwhile."""
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                return lmdb.open(path, map_size=map_size, subdir=True, lock=True, sync=True, metasync=True,
                                 max_readers=1024, readahead=False, meminit=False, max_dbs=0, mode=FILE_MODE)
            except lmdb.MapResizedError as e:
                err = e
                logger.info("L3 index %s: map grown by another process during open (attempt %d), reopening",
                            path, attempt + 1)
            except lmdb.Error as e:
                err = e
                break
        raise L3StartupError(f"index.dir: cannot open the LMDB index at '{path}' ({err}); "
                             "check the directory is writable and on a local filesystem")

    def _check_format(self) -> None:
        """Stamp a fresh index with FORMAT; refuse one of another format before anyone writes to it.
        Through _read/_write: another rank may be growing the map meanwhile (MapResizedError)."""
        def stamp(txn):  # writers serialise: one opener stamps it
            if txn.get(META_KEY) is None and txn.stat()["entries"] == 0:
                txn.put(META_KEY, b"%d" % FORMAT)
            return txn.get(META_KEY)
        try:
            raw, entries = self._read(lambda txn: (txn.get(META_KEY), txn.stat()["entries"]))
            if raw is None and entries == 0:
                raw = self._write(stamp)
        except (IndexFull, IndexUnavailable) as e:
            raise L3StartupError(f"index.dir: cannot open the LMDB index at '{self.path}' ({e}); check the "
                                 "directory is writable and on a local filesystem") from None
        found = 1 if raw is None else (int(raw) if raw.isdigit() else -1)
        if found != FORMAT:
            what = {1: "format 1, written by an older sglang-cp (keys without the rank prefix)"}.get(
                found, f"format {raw!r}, not one this sglang-cp writes")
            raise L3StartupError(
                f"index.dir: the LMDB index at '{self.path}' is {what}; this version reads format {FORMAT} "
                "only and would never hit its pages. Stop every server using it, then delete data.mdb and "
                "lock.mdb there (its cached pages become misses) or point index.dir at a new directory")

    def _reader_check(self) -> int:
        """Clear reader slots left by dead processes; returns how many were cleared."""
        self._last_reader_check = time.monotonic()
        try:
            n = self.env.reader_check()
        except lmdb.Error as e:
            logger.warning("L3 index %s: reader check failed (%s)", self.path, e)
            return 0
        if n:
            self.stale_readers_cleared += n
            logger.warning("L3 index %s: cleared %d reader slot(s) left by dead processes", self.path, n)
        return n

    # -- transactions -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _txn(self, write: bool):
        for _ in range(_TXN_ATTEMPTS):
            with self._rw.shared():
                try:
                    txn = self.env.begin(write=write)
                except lmdb.MapResizedError:
                    pass
                else:
                    try:
                        yield txn
                    except BaseException:
                        txn.abort()
                        raise
                    else:
                        txn.commit()
                    return
            self._adopt_foreign_resize()
        raise IndexUnavailable("LMDB map kept being resized by other processes")

    def _adopt_foreign_resize(self) -> None:
        with self._rw.exclusive():
            self.env.set_mapsize(0)

    def _grow(self) -> bool:
        if self._reader_check():
            return True  # a dead reader pinned old pages: retry before growing
        with self._rw.exclusive():
            cur = self.env.info()["map_size"]
            if cur >= self.max_map_size:
                return False
            self.env.set_mapsize(min(cur * 2, self.max_map_size))
            self.grows += 1
            return True

    def _write(self, fn):
        """Run fn(txn) in a write txn; on MapFull grow and retry; IndexFull when at max."""
        if time.monotonic() - self._last_reader_check >= _READER_CHECK_INTERVAL_S:
            self._reader_check()
        while True:
            try:
                with self._txn(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                if not self._grow():
                    raise IndexFull(f"LMDB map at index.max_map_size_gb ({self.max_map_size / 1e9:.3f} GB)")
            except lmdb.Error as e:
                raise IndexUnavailable(str(e)) from e

    def _read(self, fn):
        try:
            with self._txn(write=False) as txn:
                return fn(txn)
        except lmdb.Error as e:
            raise IndexUnavailable(str(e)) from e

    # -- queries ------------------------------------------------------------------------------------

    def get_many(self, ikeys: list[bytes]) -> list[Optional[IndexEntry]]:
        def fn(txn):
            out = []
            for k in ikeys:
                raw = txn.get(k)
                out.append(IndexEntry.unpack(raw) if raw is not None else None)
            return out
        return self._read(fn)

    def exists_prefix(self, ikey_rows: list[list[bytes]]) -> int:
        """Length of the prefix of rows whose keys are all present; one read txn. Not the store's hit
        query (hits.py answers from memory, no txn): the LMDB-only answer that bench_l3_index measures the
        hit query against and tests use to see what is durable."""
        def fn(txn):
            n = 0
            for row in ikey_rows:
                for k in row:
                    if txn.get(k) is None:
                        return n
                n += 1
            return n
        return self._read(fn)

    @staticmethod
    def _range(txn, prefix: bytes):
        """(key, value) of every entry whose key starts with `prefix`: one B-tree seek, then in order."""
        cur = txn.cursor()
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            if not k.startswith(prefix):
                return
            yield k, v

    def scan_rank(self, rank: int) -> list[tuple[bytes, IndexEntry]]:
        """This rank's entries: a range scan of its key prefix (other ranks' entries are not read)."""
        def fn(txn):
            out = []
            for k, v in self._range(txn, key_prefix(rank)):
                e = IndexEntry.unpack(v)
                if e.rank != rank:
                    raise L3InvariantError(f"index entry {bytes(k).hex()} under rank {rank}'s prefix names rank {e.rank}")
                out.append((bytes(k), e))
            return out
        return self._read(fn)

    def all_entries(self) -> list[tuple[bytes, IndexEntry]]:
        """Every rank's entries (tools: fsck, stats)."""
        return self._read(lambda txn: [(bytes(k), IndexEntry.unpack(v)) for k, v in self._range(txn, _ENTRY)])

    def count(self) -> int:
        """Entries of every rank (the format stamp is not one)."""
        return self._read(lambda txn: txn.stat()["entries"] - (txn.get(META_KEY) is not None))

    # -- updates ------------------------------------------------------------------------------------

    def commit(self, puts: Iterable[tuple[bytes, IndexEntry]] = (),
               deletes: Iterable[tuple[bytes, IndexEntry]] = (),
               touches: Iterable[tuple[bytes, IndexEntry]] = ()) -> list[bool]:
        """One durable txn. Deletes and touches apply only if the key still maps to the same
        (rank, disk, slot, seq): another rank or a newer write may own it now. Returns per-delete flags."""
        puts, deletes, touches = list(puts), list(deletes), list(touches)

        def same(a: IndexEntry, b: IndexEntry) -> bool:
            return (a.rank, a.disk, a.slot, a.seq) == (b.rank, b.disk, b.slot, b.seq)

        def fn(txn):
            flags = []
            for k, expected in deletes:
                raw = txn.get(k)
                ok = raw is not None and same(IndexEntry.unpack(raw), expected)
                if ok:
                    txn.delete(k)
                flags.append(ok)
            for k, e in touches:
                raw = txn.get(k)
                if raw is not None:
                    cur = IndexEntry.unpack(raw)
                    if same(cur, e) and cur.last_access < e.last_access:
                        txn.put(k, cur._replace(last_access=e.last_access).pack())
            for k, e in puts:
                txn.put(k, e.pack())
            return flags
        if not (puts or deletes or touches):
            return []
        return self._write(fn)

    def delete_rank(self, rank: int) -> int:
        """Delete this rank's entries: a range of its key prefix (other ranks' entries are not read)."""
        prefix = key_prefix(rank)

        def fn(txn):
            cur = txn.cursor()
            n = 0
            if cur.set_range(prefix):
                while cur.key().startswith(prefix):
                    cur.delete()  # moves to the next entry
                    n += 1
            return n
        return self._write(fn)

    def map_size(self) -> int:
        return self.env.info()["map_size"]

    def close(self) -> None:
        with self._rw.exclusive():
            self.env.close()


# LMDB allows one open environment per path per process; ranks hosted in one process share it.
_shared: dict[str, list] = {}
_shared_lock = threading.Lock()


class SharedIndex:
    """A reference to the process-wide LmdbIndex of a path; close() drops the reference."""

    def __new__(cls, path: str, map_size: int, max_map_size: int) -> LmdbIndex:
        key = os.path.realpath(path)
        with _shared_lock:
            entry = _shared.get(key)
            if entry is None:
                ix = LmdbIndex(path, map_size, max_map_size)
                entry = _shared[key] = [ix, 0]
                real_close = ix.close

                def close_ref() -> None:
                    with _shared_lock:
                        entry[1] -= 1
                        if entry[1] == 0:
                            del _shared[key]
                            real_close()
                ix.close = close_ref
            entry[1] += 1
            return entry[0]
