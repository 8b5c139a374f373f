"""benchmark/support/page_cache.py on real files: what the page cache holds of a written file, of one
whose pages were dropped, and of one written with O_DIRECT (what separates a page-file tier from ours)."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile

import pytest

from benchmark.support import page_cache

MB = 1 << 20


def _write(path, size: int, direct: bool = False) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        buf.write(os.urandom(size))
        os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_written_file_is_resident_dropped_file_is_not(disk_tmp):
    p = disk_tmp / "page"
    _write(p, 8 * MB)
    got = page_cache.file_resident_bytes(str(p))
    assert 6 * MB <= got <= 8 * MB  # a busy host may reclaim a little, never more than the file
    _drop(p)
    assert page_cache.file_resident_bytes(str(p)) < MB
    with open(p, "rb") as f:  # a buffered read brings the first half back
        f.read(4 * MB)
    assert 3 * MB <= page_cache.file_resident_bytes(str(p)) <= 8 * MB


def test_an_odirect_file_is_not_in_the_page_cache_and_a_tail_counts_to_its_end(disk_tmp):
    d = disk_tmp / "tier"
    d.mkdir()
    try:
        _write(d / "slab", 4 * MB, direct=True)
    except OSError as e:  # a filesystem without O_DIRECT: nothing to show here
        pytest.skip(f"O_DIRECT refused on this filesystem: {e}")
    assert page_cache.file_resident_bytes(str(d / "slab")) == 0
    with open(d / "tail", "wb") as f:
        f.write(b"x" * (mmap.PAGESIZE + 100))
    (d / "empty").touch()
    os.symlink(d / "tail", d / "link")  # not followed, not counted twice
    got = page_cache.resident_bytes([str(d)])
    assert got == {"resident": mmap.PAGESIZE + 100, "files": 2, "unread": 0}


def test_what_it_cannot_read_is_said_not_hidden():
    """A file and a directory the measuring process may not read each count in ``unread``. Run as an
    unprivileged user (root reads everything): in a child that drops to ``nobody`` when this is root."""
    # the system temp dir: every user may enter it (pytest's own base is 0700 root's, xdist's one deeper)
    base = tempfile.mkdtemp(dir=tempfile.gettempdir())
    os.chmod(base, 0o755)
    try:
        d = os.path.join(base, "t")
        os.makedirs(os.path.join(d, "closed"))
        with open(os.path.join(d, "open"), "wb") as f:
            f.write(b"z" * 100)
        with open(os.path.join(d, "locked"), "wb") as f:
            f.write(b"y" * 100)
        with open(os.path.join(d, "closed", "inside"), "wb") as f:
            f.write(b"w" * 100)
        os.chmod(d, 0o755)
        os.chmod(os.path.join(d, "open"), 0o644)
        os.chmod(os.path.join(d, "locked"), 0)
        os.chmod(os.path.join(d, "closed"), 0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child measures as nobody when this is root, then leaves without pytest's teardown
            try:
                os.close(r)
                if os.geteuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                os.write(w, json.dumps(page_cache.resident_bytes([d])).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            got = f.read()
        os.waitpid(pid, 0)
        assert json.loads(got) == {"resident": 100, "files": 1, "unread": 2}
    finally:
        for dirpath, dirs, _ in os.walk(base):
            for x in dirs:
                os.chmod(os.path.join(dirpath, x), 0o700)
        shutil.rmtree(base, ignore_errors=True)
