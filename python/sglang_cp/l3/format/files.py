"""Files and directories of the L3 store: private to the server's user, never reached through a link.

KV pages are derived from prompts, so every directory the store creates is 0700 and every file 0600,
whatever the umask. Every open of one of our files uses O_NOFOLLOW, and a path that holds a symbolic
link, something other than a regular file, a file owned by another user or a file with other hard links
is refused with an `L3StartupError` naming the path and the fix, before anything writes to it (a link
planted at a slab path would otherwise have the store truncate and zero its target). Files and
directories of ours found with wider modes (created by an older version) are narrowed to 0600 / 0700.
"""

from __future__ import annotations

import errno
import os
import stat

from ..errors import L3StartupError

DIR_MODE = 0o700
FILE_MODE = 0o600
# O_NONBLOCK has no effect on regular files; it keeps a FIFO planted at one of our paths from blocking
# the open (we refuse it right after, from fstat).
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _refuse(field: str, path: str, what: str, fix: str) -> L3StartupError:
    return L3StartupError(f"{field}: '{path}' {what}; {fix}")


def _check_stat(st: os.stat_result, path: str, field: str, want_dir: bool) -> None:
    kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(field, path, "is a symbolic link", "remove it; sglang-cp never follows links at its own paths")
    if not kind_ok:
        raise _refuse(field, path, f"is not a {'directory' if want_dir else 'regular file'}",
                      "move it away; sglang-cp creates its own files there")
    euid = os.geteuid()
    if st.st_uid != euid:
        raise _refuse(field, path, f"is owned by uid {st.st_uid}, not by this server's uid {euid}",
                      f"remove it, or chown it to uid {euid} if it is this server's")
    if not want_dir and st.st_nlink != 1:
        raise _refuse(field, path, f"has {st.st_nlink} hard links", "remove the other links or the file")


def _check_fd(fd: int, path: str, field: str, want_dir: bool) -> None:
    st = os.fstat(fd)
    _check_stat(st, path, field, want_dir)
    want = DIR_MODE if want_dir else FILE_MODE
    if stat.S_IMODE(st.st_mode) & ~want:
        os.fchmod(fd, want)


def open_private(path: str, flags: int, field: str) -> int:
    """os.open of one of our files: created 0600, never through a link, refused unless it is a regular
    file of ours with one link. Raises L3StartupError for those, OSError for anything else."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(field, path, "is a symbolic link",
                          "remove it; sglang-cp never follows links at its own paths") from None
        try:
            st = os.lstat(path)
        except OSError:
            raise e from None
        _check_stat(st, path, field, want_dir=False)  # raises for a non-regular file (O_DIRECT on a FIFO)
        raise
    try:
        _check_fd(fd, path, field, want_dir=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private_file(path: str, field: str, *, fix_mode: bool = True) -> bool:
    """For a file another library opens (LMDB's data.mdb, lock.mdb): refuse what open_private refuses
    and narrow its mode; False if it does not exist. fix_mode=False only looks (lstat): once LMDB has
    the file open, opening and closing another fd of it would drop this process's fcntl locks on it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    _check_stat(st, path, field, want_dir=False)
    if not fix_mode:
        return True
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(field, path, "is a symbolic link",
                          "remove it; sglang-cp never follows links at its own paths") from None
        raise
    try:
        _check_fd(fd, path, field, want_dir=False)
    finally:
        os.close(fd)
    return True


def private_dir(path: str, field: str) -> None:
    """Create `path` 0700 (its parent must exist) and fsync the parent so the new entry survives a power
    loss; an existing one must be a real directory of ours (narrowed to 0700). Raises L3StartupError."""
    created = False
    try:
        os.mkdir(path, DIR_MODE)
        created = True
    except FileExistsError:
        pass
    except OSError as e:
        raise L3StartupError(f"{field}: cannot create '{path}' ({e.strerror}); the directory must be writable") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            _check_stat(os.lstat(path), path, field, want_dir=True)
        raise _refuse(field, path, f"cannot be opened ({e.strerror})", "the directory must be accessible") from None
    try:
        _check_fd(fd, path, field, want_dir=True)
    finally:
        os.close(fd)
    if created:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(path: str) -> None:
    """Make the entries of directory `path` (a file or directory created in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_dirs(path: str, field: str) -> None:
    """Create the missing directories of `path`, each 0700 (private_dir); existing ones are left alone."""
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.lexists(parent):
        private_dirs(parent, field)
    if not os.path.lexists(path):
        private_dir(path, field)
