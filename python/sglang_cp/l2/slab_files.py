"""Slab file names, ownership and stale-file reclaim on the hugetlbfs mount.

hugetlbfs supports neither write(2) nor xattrs, and an in-file header would cost a
whole hugepage per slab (1 GiB with 1 GiB pages), so each file's header is its name:

    sglcp-l2.v1.<namespace>.r<rank>.<label>.<layout>.<slab>of<n>.<pid>-<starttime>.slab

``layout`` is the layout name plus a digest of the pool geometry. ``pid``+``starttime``
(field 22 of /proc/<pid>/stat) identify the owner across pid reuse. A file whose owner
is gone is stale: it still holds its hugepages, so startup unlinks it -- its content is
never reused, with this layout or any other, because L2 content dies with its process.

Reclaim looks at every namespace, not only this server's: the namespace is the server's
``--port``, and a server restarted on another port must still get back the hugepages of
the one that died (they would otherwise stay taken until someone deletes the files and
fail the new server's preflight). Liveness is two checks: the owner pid with its start
time, and a ``flock`` the owner holds on each of its files for as long as it maps them.
The lock is what keeps a live owner safe when its pid means nothing here (another pid
namespace sharing the mount); the kernel drops it when the owner dies.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

from sglang_cp.l2.errors import SlabOwnershipError

logger = logging.getLogger(__name__)

PREFIX = "sglcp-l2"
VERSION = "v1"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
_NAME = re.compile(
    rf"^{PREFIX}\.(?P<version>v\d+)\.(?P<namespace>[A-Za-z0-9_-]+)\.r(?P<rank>\d+)\."
    r"(?P<label>[A-Za-z0-9_-]+)\.(?P<layout>[A-Za-z0-9_-]+)\.(?P<slab>\d+)of(?P<n>\d+)\."
    r"(?P<pid>\d+)-(?P<start>\d+)\.slab$"
)


def _token(name: str, value: str) -> str:
    value = str(value)
    if not _TOKEN.match(value):
        raise ValueError(f"slab file {name} {value!r} must match [A-Za-z0-9_-]+")
    return value


def layout_tag(layout: str, *geometry) -> str:
    digest = hashlib.sha1(repr((layout, *geometry)).encode()).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', layout)}-{digest}"


def process_start_time(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22 overall: starttime


@dataclass(frozen=True)
class SlabFileName:
    namespace: str
    rank: int
    label: str
    layout: str
    slab: int
    n_slabs: int
    pid: int
    start_time: int
    version: str = VERSION

    def format(self) -> str:
        return (
            f"{PREFIX}.{self.version}.{_token('namespace', self.namespace)}.r{self.rank}."
            f"{_token('label', self.label)}.{_token('layout', self.layout)}."
            f"{self.slab}of{self.n_slabs}.{self.pid}-{self.start_time}.slab"
        )

    @classmethod
    def parse(cls, name: str) -> Optional["SlabFileName"]:
        m = _NAME.match(name)
        if not m:
            return None
        g = m.groupdict()
        return cls(
            namespace=g["namespace"], rank=int(g["rank"]), label=g["label"], layout=g["layout"],
            slab=int(g["slab"]), n_slabs=int(g["n"]), pid=int(g["pid"]), start_time=int(g["start"]),
            version=g["version"],
        )

    def owner_alive(self) -> bool:
        return process_start_time(self.pid) == self.start_time

    @classmethod
    def for_this_process(cls, namespace: str, rank: int, label: str, layout: str, slab: int, n_slabs: int):
        pid = os.getpid()
        start = process_start_time(pid)
        if start is None:
            raise RuntimeError("cannot read /proc/self/stat; slab ownership needs procfs")
        return cls(namespace, rank, label, layout, slab, n_slabs, pid, start)


def scan(directory: str) -> list[tuple[str, SlabFileName]]:
    out = []
    for entry in sorted(os.listdir(directory)):
        parsed = SlabFileName.parse(entry)
        if parsed is not None:
            out.append((os.path.join(directory, entry), parsed))
    return out


def hold_owner_lock(fd: int, path: str) -> None:
    """The owner's side: an exclusive flock on a slab file it just created, held while the fd is open."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        raise SlabOwnershipError(
            f"slab file {path}: cannot take its owner lock ({e.strerror}); another process is reclaiming "
            "this mount's files right now: start again") from None


def _unlink_if_unlocked(path: str) -> Optional[bool]:
    """Unlink ``path`` if no process holds its owner lock: True unlinked, False held by a live
    owner, None already gone. The lock is taken before the unlink, so no owner loses a file it maps."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        return True
    finally:
        os.close(fd)


def stale_files(directory: str) -> list[tuple[str, SlabFileName, int]]:
    """(path, name, bytes) of every slab file on the mount whose owner is dead (any namespace):
    what the next start reclaims. Read-only."""
    out = []
    for path, f in scan(directory):
        if f.owner_alive():
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                continue  # a live owner holds it
            out.append((path, f, os.fstat(fd).st_blocks * 512))
        finally:
            os.close(fd)
    return out


def reclaim_stale(directory: str, namespace: str, rank: int) -> list[str]:
    """Unlink every slab file on the mount whose owner is dead; refuse a live owner of our
    namespace and rank.

    Dead owners of any rank and any namespace are reclaimed (a restart with fewer ranks, or
    on another --port, would otherwise leak their hugepages forever).
    """
    me = os.getpid()
    reclaimed = []
    for path, f in scan(directory):
        if f.owner_alive():
            if f.namespace == namespace and f.rank == rank and f.pid != me:
                raise SlabOwnershipError(
                    f"slab file {path} of rank {rank} belongs to live process {f.pid}: another "
                    f"server with the same namespace ({namespace!r}, i.e. the same --port) is "
                    f"running on this node; stop it or start this one with another --port"
                )
            continue
        done = _unlink_if_unlocked(path)
        if done is None:
            continue  # another rank or server reclaimed it first
        if done is False:
            logger.info("sglang-cp L2: slab %s names pid %d, not alive here, but its owner lock is held "
                        "(a live process in another pid namespace): left alone", path, f.pid)
            continue
        reclaimed.append(path)
        logger.warning(
            "sglang-cp L2: reclaimed stale hugepage slab %s (owner pid %d is gone; namespace %s, layout %s, "
            "rank %d); its content is discarded, never reused",
            path, f.pid, f.namespace, f.layout, f.rank,
        )
    return reclaimed
