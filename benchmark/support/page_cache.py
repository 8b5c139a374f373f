"""How many bytes of a set of files the kernel's page cache holds: the DRAM a storage tier that reads and
writes through the page cache (upstream's ``file`` backend) serves from beyond the host pool every tier is
given, which O_DIRECT tiers (ours, nixl, Mooncake's and LMCache's O_DIRECT readers) do not use.

``mincore(2)`` over a read-only shared mapping of each file, a window at a time: it reports which pages are
resident without faulting any in, so measuring does not change what it measures.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import stat
from typing import Optional

WINDOW = 1 << 30  # bytes mapped at a time: a 24 GB slab never needs 24 GB of address space at once

_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def file_resident_bytes(path: str) -> int:
    """Bytes of the regular file at ``path`` (not followed if a link) that are in the page cache."""
    lib, page = _lib(), mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        resident = 0
        for off in range(0, size, WINDOW):
            length = min(WINDOW, size - off)
            addr = lib.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, off)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path}: {os.strerror(ctypes.get_errno())}")
            try:
                pages = (length + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if lib.mincore(addr, length, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path}: {os.strerror(ctypes.get_errno())}")
                n = sum(b & 1 for b in bytes(vec))
                # the last page of the file counts only up to its end
                if n and vec[pages - 1] & 1 and length % page:
                    resident -= page - length % page
                resident += n * page
            finally:
                lib.munmap(addr, length)
        return resident
    finally:
        os.close(fd)


def resident_bytes(paths: list) -> Optional[dict]:
    """``{"resident": bytes, "files": n, "unread": n}`` over every regular file under ``paths``: the bytes
    the page cache holds, the files counted, and the files and directories that could not be read
    (counted as 0, and said); None where the kernel cannot say (no ``mincore``). A file that vanishes while counted (a
    tier's GC) is not counted."""
    resident = files = unread = 0

    def cannot_list(_err: OSError) -> None:
        nonlocal unread
        unread += 1

    for root in paths:
        for dirpath, _dirs, names in os.walk(root, onerror=cannot_list):
            for n in names:
                p = os.path.join(dirpath, n)
                try:
                    st = os.lstat(p)
                    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                        continue
                    resident += file_resident_bytes(p)
                    files += 1
                except FileNotFoundError:
                    continue
                except OSError as e:
                    if e.errno == errno.ENOSYS:
                        return None
                    unread += 1
    return {"resident": resident, "files": files, "unread": unread}
