"""Power-loss model for the L3 crash test: build the LD_PRELOAD shim, and after a SIGKILL undo what no
flush covered.

The shim (l3_powerloss.c) journals, in the killed writer, every write to the slabs and to LMDB's data.mdb
with the bytes it replaced, and which writes each successful fdatasync/fsync covered. `power_loss()`
then plays the device: every write no flush covered is reverted (in `random` mode: reverted, kept, or
torn per 4 KiB block), size changes no flush covered are undone, and files created in a directory that
was not fsynced afterwards disappear. A store that acks before its data and index reached stable storage
loses acked pages here; a SIGKILL alone would not show it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "l3_powerloss.c")
_HDR = struct.Struct("<IIQQQqqqII")
_MAGIC = 0x314A4C50
W, T, S, C, D = 1, 2, 3, 4, 5
BLOCK = 4096  # the unit a torn write keeps or loses (a sector-atomic device writes at least this)


def build(out_dir: str) -> str:
    """Compile the shim (needs a C compiler; the project's setup requires one for its native deps)."""
    src = open(SRC, "rb").read()
    lib = os.path.join(out_dir, f"l3_powerloss-{hashlib.sha256(src).hexdigest()[:12]}.so")
    if not os.path.exists(lib):
        cc = shutil.which("cc") or shutil.which("gcc")
        assert cc, "the power-loss model needs a C compiler (cc) to build its LD_PRELOAD shim"
        tmp = f"{lib}.{os.getpid()}.tmp"
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wall", "-o", tmp, SRC, "-ldl", "-lpthread"], check=True)
        os.replace(tmp, lib)
    return lib


def child_env(lib: str, journal: str, match: str = ".slab,/data.mdb") -> dict:
    env = dict(os.environ)
    env["LD_PRELOAD"] = lib
    env["L3_POWERLOSS_JOURNAL"] = journal
    env["L3_POWERLOSS_MATCH"] = match
    return env


def read_journal(path: str) -> list[tuple]:
    """(type, id, dev, ino, a, b, c, extra) in journal order; a torn last record (killed mid-append) is
    dropped: the shim appends a write's record before the write, so that write never started."""
    raw = open(path, "rb").read() if os.path.exists(path) else b""
    out, pos = [], 0
    while pos + _HDR.size <= len(raw):
        magic, typ, rid, dev, ino, a, b, c, elen, _ = _HDR.unpack_from(raw, pos)
        assert magic == _MAGIC, f"journal {path}: bad record at byte {pos}"
        if pos + _HDR.size + elen > len(raw):
            break
        out.append((typ, rid, dev, ino, a, b, c, raw[pos + _HDR.size:pos + _HDR.size + elen]))
        pos += _HDR.size + elen
    return out


def _files_by_inode(root: str) -> dict:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[(st.st_dev, st.st_ino)] = p
    return out


def _minus(lo: int, hi: int, protected: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) minus the protected intervals."""
    parts = [(lo, hi)]
    for plo, phi in protected:
        nxt = []
        for a, b in parts:
            if phi <= a or plo >= b:
                nxt.append((a, b))
                continue
            if a < plo:
                nxt.append((a, plo))
            if phi < b:
                nxt.append((phi, b))
        parts = nxt
    return parts


def power_loss(root: str, journal: str, rnd, mode: str = "random") -> dict:
    """Undo, under `root`, what no flush covered. mode "revert": every unflushed write and creation is
    lost; "random": each unflushed write is lost (60%), kept (20%) or torn per 4 KiB block (20%)."""
    recs = read_journal(journal)
    covered = set()
    for typ, _, _, _, _, _, _, extra in recs:
        if typ == S:
            covered.update(struct.unpack(f"<{len(extra) // 8}Q", extra))
    files = _files_by_inode(root)
    stats = {"writes": 0, "unflushed": 0, "reverted": 0, "torn": 0, "kept": 0, "resizes_undone": 0,
             "files_removed": 0}
    # Newest first, so each undo restores what the write before it left; a flushed newer write protects
    # its bytes from the undo of older unflushed ones (an O_DSYNC write over an unflushed one).
    protected: dict[tuple, list] = {}
    fds: dict[tuple, int] = {}
    try:
        for pos in range(len(recs) - 1, -1, -1):
            typ, rid, dev, ino, a, b, c, extra = recs[pos]
            if typ not in (W, T):
                continue
            key = (dev, ino)
            stats["writes"] += typ == W
            lo, hi = (a, a + b) if typ == W else (min(a, b), max(a, b))
            if rid in covered:
                protected.setdefault(key, []).append((lo, hi))
                continue
            stats["unflushed"] += 1
            path = files.get(key)
            if path is None:
                continue  # the file is gone (removed by a later step of the store): nothing to undo
            fate = "revert" if mode == "revert" else rnd.choices(["revert", "keep", "tear"], [6, 2, 2])[0]
            stats[{"revert": "reverted", "keep": "kept", "tear": "torn"}[fate]] += 1
            if fate == "keep":
                continue
            if key not in fds:
                fds[key] = os.open(path, os.O_RDWR)
            fd = fds[key]
            prot = protected.get(key, [])
            if typ == W:
                old_size = c
                for blo in range(lo - lo % BLOCK, hi, BLOCK):
                    if fate == "tear" and rnd.random() < 0.5:
                        continue
                    for s, e in _minus(max(lo, blo), min(hi, blo + BLOCK), prot):
                        if s < old_size:
                            e2 = min(e, old_size)
                            os.pwrite(fd, extra[s - a:e2 - a], s)
                if hi > old_size and fate == "revert":
                    _shrink_to(fd, old_size, prot)
            else:
                old, new = a, b
                if new > old:
                    _shrink_to(fd, old, prot)
                else:
                    os.pwrite(fd, extra, new)
                stats["resizes_undone"] += 1
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    # A created file survives only if its directory was fsynced after the creation.
    for pos, (typ, _, dev, ino, _, _, _, extra) in enumerate(recs):
        if typ != C:
            continue
        synced = any(r[0] == D and (r[2], r[3]) == (dev, ino) for r in recs[pos + 1:])
        path = extra.decode()
        if not synced and os.path.exists(path) and (mode == "revert" or rnd.random() < 0.6):
            os.unlink(path)
            stats["files_removed"] += 1
    os.unlink(journal)
    return stats


def _shrink_to(fd: int, size: int, protected: list[tuple[int, int]]) -> None:
    size = max([size] + [hi for _, hi in protected])
    if os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)
