"""The write I/O threads' groups of runs (write_io.py, native/write_runs.c).

With the native library an I/O task writes several runs in one call (one GIL release for the group):
beside a busy Python thread each return from the kernel costs an I/O thread up to the switch interval.
What must hold: every page of a group lands byte-exact; a run that fails inside a group (an error, a
short write) fails only its own pages, and the runs after it in the same call are still written.
"""

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest

from l3_helpers import WAIT_S, build_native_variant, native_source, page
from sglang_cp.l3 import native

# One page per run: a slot's extent is above the 4 MiB a coalesced pwritev covers.
BIG = (4 << 20) + 100


@pytest.fixture
def calls(monkeypatch):
    """Runs per native write call, recorded; skips where the library is not installed."""
    if native.installed() is None:
        pytest.skip("the native library is not installed")
    seen = []
    real = native.write_runs

    def counting(lib, fd, offsets, runs):
        seen.append(len(runs))
        return real(lib, fd, offsets, runs)

    monkeypatch.setattr(native, "write_runs", counting)
    return seen


def test_runs_go_to_the_device_in_groups_and_read_back_exact(make_store, calls):
    n = 24
    s = make_store(payloads={"kv": BIG}, capacity_gb=0.25, io={"threads": 1, "max_inflight_pages": 16})
    keys = [b"g%d" % i for i in range(n)]
    assert s.write_pages("kv", keys, [page(i, BIG) for i in range(n)], timeout=WAIT_S) == [True] * n
    assert sum(calls) == n  # every page went through the group call, each once
    assert max(calls) >= 2 and len(calls) < n
    outs = [bytearray(BIG) for _ in range(n)]
    assert s.read_pages("kv", keys, outs, timeout=WAIT_S) == [True] * n
    assert all(bytes(o) == page(i, BIG) for i, o in enumerate(outs))


def test_a_run_that_fails_inside_a_group_fails_only_its_page(make_store, calls):
    failing = {}

    def disk(op, slab, slot):
        if op == "write" and slot == failing.get("slot"):
            raise OSError(errno.EIO, "injected: bad sector")

    n = 8
    s = make_store(payloads={"kv": BIG}, capacity_gb=0.25, io={"threads": 1, "max_inflight_pages": 16},
                   fault_injector=disk)
    failing["slot"] = 2  # slots are handed out from the start of a fresh slab, in order
    keys = [b"f%d" % i for i in range(n)]
    got = s.write_pages("kv", keys, [page(i, BIG) for i in range(n)], timeout=WAIT_S)
    assert got.count(False) == 1 and max(calls) >= 2  # the failed run shared a call with others
    assert s.stats()["counters"]["write_errors"] == 1
    ok = [k for k, g in zip(keys, got) if g]
    outs = [bytearray(BIG) for _ in ok]
    assert s.read_pages("kv", ok, outs, timeout=WAIT_S) == [True] * len(ok)
    assert all(bytes(o) == page(keys.index(k), BIG) for k, o in zip(ok, outs))
    assert s.read_pages("kv", [keys[got.index(False)]], [bytearray(BIG)], timeout=WAIT_S) == [False]


# Three one-slot runs written in one call while the file size limit (RLIMIT_FSIZE) cuts the second run
# 4 KiB in: the kernel writes that run short and refuses the third (EFBIG). A real short write, on a real
# O_DIRECT slab.
_SHORT_WRITE = textwrap.dedent("""
    import functools, json, os, resource, signal, sys
    from sglang_cp.l3 import native
    from sglang_cp.l3.format.aligned import aligned_buffer
    from sglang_cp.l3.format.disk_slab import DiskSlab
    from sglang_cp.l3.format.blob import write_extent
    variant = os.environ.get("VARIANT")
    if variant:
        native.library_path = lambda: variant
    lib = native.load("test", "native")
    page = 65536
    ext = write_extent(page)
    slab = DiskSlab(sys.argv[1], slot_bytes=ext, num_slots=3, page_bytes=page)
    bufs = [aligned_buffer(ext) for _ in range(3)]
    for i, b in enumerate(bufs):
        b[:] = bytes([i + 1]) * ext
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (ext + 4096, resource.RLIM_INFINITY))
    runs = [(i, [[memoryview(bufs[i])]]) for i in range(3)]
    errs = slab.write_runs(functools.partial(native.write_runs, lib), runs)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    with open(sys.argv[1], "rb") as f:
        first = f.read(ext)
    print(json.dumps({"errors": [None if e is None else [e.errno, str(e)] for e in errs],
                      "first_slot_written": first == bytes(bufs[0])}))
""")


def _short_write(tmp_path, variant=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    if variant:
        env["VARIANT"] = variant
    out = subprocess.run([sys.executable, "-c", _SHORT_WRITE, str(tmp_path / "slab")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_short_write_fails_its_run_and_the_runs_after_it_still_report_their_own(tmp_path):
    if native.installed() is None:
        pytest.skip("the native library is not installed")
    got = _short_write(tmp_path)
    assert got["first_slot_written"]
    first, short, refused = got["errors"]
    assert first is None
    assert short[0] == errno.EIO and "short write 4096/" in short[1]
    assert refused[0] == errno.EFBIG


def test_a_library_that_trusts_a_short_write_is_caught(tmp_path):
    """The test above must be able to fail: a library that reports each run as fully written hides the
    short write (its run would be indexed over a slot holding 4 KiB of it)."""
    text = native_source("write_runs.c")
    old = "results[i] = r < 0 ? -(int64_t)errno : (int64_t)r;"
    assert text.count(old) == 1
    trusting = ("int64_t all = 0; for (int j = 0; j < (int)iov_counts[i]; j++) all += (int64_t)iov[j].iov_len; "
                "results[i] = r < 0 ? -(int64_t)errno : all;")
    lib = build_native_variant(tmp_path, "write_runs.c", text.replace(old, trusting))
    got = _short_write(tmp_path, variant=lib)
    assert got["errors"][1] is None  # the short write went unseen


def test_idle_threads_get_a_share_each_before_runs_are_grouped(make_store, calls):
    """The device must still see io.threads requests: while threads are idle each gets a share of the
    work; once none is, runs go in groups of up to 32 MB. Without the library every task is one run."""
    s = make_store(payloads={"kv": BIG}, capacity_gb=0.25)
    io = s._writer._io
    ext = s.state.pools["kv"].extent
    runs = [[object()] for _ in range(16)]  # 16 one-page runs of 4.2 MB
    assert [len(g) for g in io.groups(runs, ext, idle=4)] == [4, 4, 4, 4]
    assert [len(g) for g in io.groups(runs, ext, idle=16)] == [1] * 16
    busy = io.groups(runs, ext, idle=0)
    assert sum(len(g) for g in busy) == 16 and all(len(g) * ext <= 32 << 20 for g in busy) and len(busy) == 3
    io._pwritev_runs = None
    assert [len(g) for g in io.groups(runs, ext, idle=0)] == [1] * 16
