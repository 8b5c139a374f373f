"""Exclusive ownership of an L3 rank's files for the lifetime of one store (engine-independent).

Two processes that open the same rank of the same L3 directory destroy each other's pages: each
one's cold start, slot allocation and GC assume it alone writes the rank's slabs and index entries.
The store therefore holds an ``flock`` on a per-rank lock file next to each thing the rank owns (its
slab directory and the shared index directory) from before its first destructive step until
``close()``. A second opener fails at once with a message naming the rank, the owner identity the
holder recorded and the holder's pid.

The lock file is created 0600 with ``O_NOFOLLOW`` (a planted symlink is refused, never followed) and
must be a regular file owned by this user with no other hard link (a link to another file would have
that file truncated and overwritten with the holder's pid); a wider mode is narrowed to 0600. It is never unlinked: the lock lives on the open file
description, so a crashed holder (even SIGKILL) releases it with its last descriptor and the next
opener takes it over; unlinking would let two openers lock two different inodes. The recorded pid
is for the message only: ownership is the kernel's flock, never a pid check.

A child forked while the lock is held inherits the open file description and with it the lock (the
descriptor is close-on-exec, so an exec'd child does not).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from typing import Optional

from ..errors import L3StartupError

LOCK_SUFFIX = ".lock"


class L3OwnershipError(L3StartupError):
    """Another live process owns this L3 rank (or the lock file is unusable)."""


@dataclass(frozen=True)
class Holder:
    pid: Optional[int]
    owner: str


def lock_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"r{rank}{LOCK_SUFFIX}")


def _read_holder(fd: int) -> Holder:
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return Holder(None, "")
    first, _, rest = raw.partition("\n")
    try:
        pid = int(first.strip())
    except ValueError:
        pid = None
    return Holder(pid, rest.strip())


def _open_lock_file(path: str, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise L3OwnershipError(
                f"{what}: lock file '{path}' is a symbolic link; refusing to follow it. Remove the link "
                "(nothing of the store lives there) and start again") from None
        raise L3OwnershipError(f"{what}: cannot open lock file '{path}' ({e.strerror}); the directory must be "
                               "writable by this user") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        kind = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}, not {os.geteuid()}"
        raise L3OwnershipError(f"{what}: lock file '{path}' is {kind}; remove it, or run the server as its owner")
    if st.st_nlink != 1:  # another name for some other file: taking the lock would truncate that file
        os.close(fd)
        raise L3OwnershipError(f"{what}: lock file '{path}' has {st.st_nlink} hard links; remove it (nothing "
                               "of the store lives there), or the other links, and start again")
    if stat.S_IMODE(st.st_mode) & ~0o600:
        os.fchmod(fd, 0o600)
    return fd


class RankLock:
    """An exclusive, non-blocking flock on ``<directory>/r<rank>.lock``, held until :meth:`release`."""

    def __init__(self, directory: str, rank: int, owner: str, *, what: str = "L3"):
        self.path = lock_path(directory, rank)
        self.rank = rank
        self.owner = owner
        self._fd: Optional[int] = None
        fd = _open_lock_file(self.path, what)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise L3OwnershipError(f"{what}: cannot lock '{self.path}' ({e.strerror})") from None
            pid = holder.pid if holder.pid is not None else "unknown"
            held_as = f" ({holder.owner})" if holder.owner else ""
            raise L3OwnershipError(
                f"{what}: L3 rank {rank} is already owned by pid {pid}{held_as}; this process ({owner}) cannot "
                f"open it (lock '{self.path}'): two processes on one rank destroy each other's pages. Stop "
                "that process, or give this server its own L3 directories or its own `namespace` in the "
                "L3 TOML") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n{owner}\n".encode(), 0)
        except OSError:
            pass  # the pid is for messages only; the flock is the ownership
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _flocked_inodes() -> set[tuple[int, int, int]]:
    """(major, minor, inode) of every file someone holds an flock on, from /proc/locks."""
    held = set()
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return held
    for line in lines:
        parts = line.split()
        if "FLOCK" not in parts or "->" in parts:  # "->": a waiter, not a holder
            continue
        try:
            major, minor, ino = parts[parts.index("FLOCK") + 4].split(":")
            held.add((int(major, 16), int(minor, 16), int(ino)))
        except (IndexError, ValueError):
            continue
    return held


def probe(directory: str) -> list[tuple[int, Holder]]:
    """(rank, holder) for every lock file in ``directory`` a live process holds.

    Reads /proc/locks and takes no lock itself, so probing never makes a starting owner fail.
    """
    out: list[tuple[int, Holder]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    held = None
    for name in names:
        if not (name.startswith("r") and name.endswith(LOCK_SUFFIX) and name[1:-len(LOCK_SUFFIX)].isdigit()):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            if held is None:
                held = _flocked_inodes()
            if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held:
                out.append((int(name[1:-len(LOCK_SUFFIX)]), _read_holder(fd)))
        finally:
            os.close(fd)
    return out
