"""One owner per L3 rank: a second process opening the same rank fails at startup instead of
destroying the first one's acked pages (l3/format/ownership.py), with real processes and real files."""

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from l3_helpers import config_doc, page
from sglang_cp.l3 import L3Store, parse_l3_config
from sglang_cp.l3.format.ownership import L3OwnershipError, RankLock, lock_path, probe

P = 16384
N = 50
HERE = os.path.dirname(os.path.abspath(__file__))

# Process A: open rank 0, write N pages (write_pages returns only when each is durable), report,
# then on "reread" read them all back and report how many verify.
HOLDER = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from l3_helpers import config_doc, page
    from sglang_cp.l3 import L3Store, parse_l3_config
    doc = config_doc(sys.argv[1])
    doc.update(json.loads(sys.argv[3]))
    s = L3Store(parse_l3_config(doc), rank=0, ranks_per_node=1, payloads={"kv": 16384},
                owner="process A")
    keys = [b"a%d" % i for i in range(50)]
    acked = sum(s.write_pages("kv", keys, [page(i) for i in range(50)]))
    print(json.dumps({"acked": acked}), flush=True)
    for line in sys.stdin:
        if line.strip() == "reread":
            outs = [np.zeros(16384, np.uint8) for _ in keys]
            ok = s.read_pages("kv", keys, outs)
            good = sum(1 for i, o in enumerate(outs) if ok[i] and o.tobytes() == page(i))
            print(json.dumps({"reread": good}), flush=True)
    s.close()
""")


def _start_holder(root, extra=None):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, root, HERE, json.dumps(extra or {})],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, "holder process died before acking"
    return p, json.loads(line)


def _reread(p) -> int:
    p.stdin.write("reread\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())["reread"]


def _stop(p):
    p.stdin.close()
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def test_second_process_on_a_rank_is_refused_and_the_first_keeps_its_pages(l3_root):
    a, msg = _start_holder(l3_root)
    try:
        assert msg["acked"] == N
        # Process B: the same config and rank, the default cold start (clear), then writes.
        outcome = "opened"
        try:
            b = L3Store(parse_l3_config(config_doc(l3_root)), rank=0, ranks_per_node=1, payloads={"kv": P})
        except L3OwnershipError as e:
            outcome = str(e)
        else:
            b.write_pages("kv", [b"b%d" % i for i in range(N)], [page(1000 + i) for i in range(N)])
            b.close()
        reread = _reread(a)
        assert (outcome.startswith("disks[0].path: L3 rank 0") and f"owned by pid {a.pid} (process A)" in outcome
                and reread == N), (outcome, f"A re-reads {reread}/{N}")
        assert "namespace" in outcome  # the message names the fix
    finally:
        _stop(a)


def test_a_killed_owner_releases_the_rank(l3_root):
    a, msg = _start_holder(l3_root)
    assert msg["acked"] == N
    a.send_signal(signal.SIGKILL)
    a.wait()
    s = L3Store(parse_l3_config(config_doc(l3_root)), rank=0, ranks_per_node=1, payloads={"kv": P}, cold_start="load")
    try:
        outs = [np.zeros(P, np.uint8) for _ in range(N)]
        assert all(s.read_pages("kv", [b"a%d" % i for i in range(N)], outs))  # the restart owns it, pages intact
    finally:
        s.close()
    again = L3Store(parse_l3_config(config_doc(l3_root)), rank=0, ranks_per_node=1, payloads={"kv": P},
                    cold_start="load")
    again.close()  # close() released it


def test_other_ranks_and_other_namespaces_open_side_by_side(l3_root):
    a, msg = _start_holder(l3_root)
    try:
        assert msg["acked"] == N
        cfg = parse_l3_config(config_doc(l3_root))
        with L3Store(cfg, rank=1, ranks_per_node=2, payloads={"kv": P}):
            pass
        ns = parse_l3_config(config_doc(l3_root, namespace="server-b"))
        with L3Store(ns, rank=0, ranks_per_node=1, payloads={"kv": P}) as b:
            assert all(b.write_pages("kv", [b"b%d" % i for i in range(N)], [page(1000 + i) for i in range(N)]))
            assert os.path.dirname(b.state.pools["kv"].slab.path).endswith(os.path.join("sglang-cp-l3", "ns-server-b"))
        assert _reread(a) == N
    finally:
        _stop(a)


def test_lock_files_are_private_and_symlinks_are_refused(tmp_path):
    d = str(tmp_path)
    with RankLock(d, 3, "owner x") as lk:
        st = os.lstat(lock_path(d, 3))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert open(lk.path).read() == f"{os.getpid()}\nowner x\n"
        assert [(r, h.pid, h.owner) for r, h in probe(d)] == [(3, os.getpid(), "owner x")]
        with pytest.raises(L3OwnershipError,
                           match=rf"L3 rank 3 is already owned by pid {os.getpid()} \(owner x\); this process \(other\)"):
            RankLock(d, 3, "other")  # a second open file description conflicts even in one process
    assert probe(d) == []  # released
    target = tmp_path / "victim"
    target.write_text("keep")
    os.symlink(target, lock_path(d, 4))
    with pytest.raises(L3OwnershipError, match="symbolic link; refusing to follow"):
        RankLock(d, 4, "x")
    assert target.read_text() == "keep"
    os.mkdir(lock_path(d, 5))
    with pytest.raises(L3OwnershipError):
        RankLock(d, 5, "x")
    # A hard link to another file of this user: taking the lock would truncate that file and write the
    # holder's pid into it. Refused, the file untouched.
    os.chmod(target, 0o644)
    os.link(target, lock_path(d, 6))
    with pytest.raises(L3OwnershipError, match=r"has 2 hard links; remove it"):
        RankLock(d, 6, "x")
    assert target.read_text() == "keep"
    # A lock file of ours left with a wider mode is narrowed to 0600.
    wide = lock_path(d, 7)
    with open(wide, "w"):
        pass
    os.chmod(wide, 0o644)
    with RankLock(d, 7, "x"):
        assert stat.S_IMODE(os.lstat(wide).st_mode) == 0o600
