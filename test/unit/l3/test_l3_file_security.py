"""The store's files are private and never reached through a link (KV pages are derived from prompts).

Directories it creates are 0700 and files 0600 even under umask 0; a symbolic link, a FIFO, a hard
link or a file of another user at one of its paths is refused at open with a message naming the path,
and the file it points to is left untouched.
"""

import os
import stat

import pytest

from sglang_cp.l3 import L3StartupError
from sglang_cp.l3.format.index import LmdbIndex
from sglang_cp.l3.recovery import record_path

KV = {"kv": 16384}
SLAB = "r0.kv.s20480.slab"  # 16 KiB page + 64 B header, rounded up to 4 KiB
CAP = 0.001                 # 48 slots: a 0.98 MB slab


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask0():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def slab_dir(root):
    return os.path.join(root, "d0", "sglang-cp-l3")


def victim(tmp_path, size=1_500_000):
    """A file outside the store, larger than the slab (the store would truncate it to the slab size)."""
    p = tmp_path / "victim"
    p.write_bytes(b"\xa5" * size)
    return p


def test_modes_under_umask_0(make_store, umask0):
    s = make_store(KV, capacity_gb=CAP)
    s.close()
    root = make_store.root
    assert mode(slab_dir(root)) == 0o700
    assert mode(os.path.join(slab_dir(root), SLAB)) == 0o600
    assert mode(record_path(slab_dir(root), 0)) == 0o600
    for name in ("data.mdb", "lock.mdb"):
        assert mode(os.path.join(root, "idx", name)) == 0o600, name


def test_index_dirs_it_creates_are_0700(tmp_path, umask0):
    path = tmp_path / "a" / "b" / "idx"
    LmdbIndex(str(path), 1 << 20, 1 << 21).close()
    for d in (tmp_path / "a", tmp_path / "a" / "b", path):
        assert mode(d) == 0o700, d
    assert mode(path / "data.mdb") == mode(path / "lock.mdb") == 0o600


def test_wider_modes_of_older_files_are_narrowed(make_store, umask0):
    make_store(KV, capacity_gb=CAP).close()
    root = make_store.root
    slab = os.path.join(slab_dir(root), SLAB)
    data = os.path.join(root, "idx", "data.mdb")
    os.chmod(slab_dir(root), 0o755)
    os.chmod(slab, 0o644)
    os.chmod(data, 0o644)
    make_store(KV, capacity_gb=CAP, cold_start="load").close()
    assert (mode(slab_dir(root)), mode(slab), mode(data)) == (0o700, 0o600, 0o600)


def test_symlink_at_slab_path_is_refused_and_its_target_untouched(make_store, tmp_path):
    os.makedirs(slab_dir(make_store.root), mode=0o700)
    target = victim(tmp_path)
    link = os.path.join(slab_dir(make_store.root), SLAB)
    os.symlink(target, link)
    with pytest.raises(L3StartupError, match=r"disks\[0\]: '.*r0\.kv\.s20480\.slab' is a symbolic link; remove it"):
        make_store(KV, capacity_gb=CAP)
    assert target.read_bytes() == b"\xa5" * 1_500_000
    assert os.path.islink(link)


def test_symlink_at_slab_dir_is_refused(make_store, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, slab_dir(make_store.root))
    with pytest.raises(L3StartupError, match=r"disks\[0\]\.path: '.*sglang-cp-l3' is a symbolic link"):
        make_store(KV, capacity_gb=CAP)
    assert os.listdir(elsewhere) == []


def test_fifo_and_hard_link_at_slab_path_are_refused(make_store, tmp_path):
    os.makedirs(slab_dir(make_store.root), mode=0o700)
    slab = os.path.join(slab_dir(make_store.root), SLAB)
    os.mkfifo(slab)
    with pytest.raises(L3StartupError, match=r"r0\.kv\.s20480\.slab' is not a regular file; move it away"):
        make_store(KV, capacity_gb=CAP)
    os.unlink(slab)
    target = victim(tmp_path)
    os.link(target, slab)
    with pytest.raises(L3StartupError, match=r"r0\.kv\.s20480\.slab' has 2 hard links"):
        make_store(KV, capacity_gb=CAP)
    assert target.read_bytes() == b"\xa5" * 1_500_000


def test_symlink_at_lmdb_files_is_refused_and_its_target_untouched(make_store, tmp_path):
    target = victim(tmp_path)
    for name in ("data.mdb", "lock.mdb"):
        link = os.path.join(make_store.root, "idx", name)
        os.symlink(target, link)
        with pytest.raises(L3StartupError, match=rf"index\.dir: '.*{name}' is a symbolic link"):
            make_store(KV, capacity_gb=CAP)
        os.unlink(link)
        assert target.read_bytes() == b"\xa5" * 1_500_000


def test_symlink_at_cold_start_record_is_replaced_not_followed(make_store, tmp_path):
    os.makedirs(slab_dir(make_store.root), mode=0o700)
    target = victim(tmp_path, 1000)
    rec = record_path(slab_dir(make_store.root), 0)
    os.symlink(target, rec)
    make_store(KV, capacity_gb=CAP).close()
    assert target.read_bytes() == b"\xa5" * 1000
    assert not os.path.islink(rec) and mode(rec) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("which", ["slab", "data.mdb"])
def test_foreign_owned_file_is_refused(make_store, which):
    make_store(KV, capacity_gb=CAP).close()
    root = make_store.root
    path = os.path.join(slab_dir(root), SLAB) if which == "slab" else os.path.join(root, "idx", "data.mdb")
    before = open(path, "rb").read()
    os.chown(path, 65534, -1)
    with pytest.raises(L3StartupError, match=r"is owned by uid 65534, not by this server's uid 0; remove it, or chown"):
        make_store(KV, capacity_gb=CAP, cold_start="load")
    assert open(path, "rb").read() == before and os.stat(path).st_uid == 65534
