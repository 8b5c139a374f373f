"""The raw-disk yardstick cachebench prints its own GB/s against, measured in the same run.

Sequential O_DIRECT writes then reads of one scratch file in the L3 disk directory, in
1 MiB requests (the largest write the L3 store coalesces) with ``threads`` requests in
flight (the store's ``io.threads``); writes end with fdatasync, as the store's group
commit does. No index, no CRC, no headers: what the disk gives with nothing on top.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from sglang_cp.l3.format.aligned import aligned_buffer

BLOCK = 1 << 20


def drop_caches() -> bool:
    """Flush and drop the page cache, so the next read is cold; False where that is not allowed (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def measure(directory: str, nbytes: int, threads: int = 4) -> dict:
    n = max(1, nbytes // BLOCK)
    path = os.path.join(directory, f".cachebench-raw-{os.getpid()}")
    bufs = [aligned_buffer(BLOCK, populate=True) for _ in range(threads)]
    for i, b in enumerate(bufs):
        b.write(os.urandom(BLOCK))  # incompressible, and not a zero page the device could skip
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, n * BLOCK)

        def run(fn):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as ex:
                done = list(ex.map(fn, range(n)))
            if sum(done) != n * BLOCK:
                raise OSError(f"raw disk probe: short I/O ({sum(done)}/{n * BLOCK} B) in {directory}")
            return time.perf_counter() - t0

        def write(i):
            return os.pwritev(fd, [bufs[i % threads]], i * BLOCK)

        def read(i):
            return os.preadv(fd, [bufs[i % threads]], i * BLOCK)

        t_w = run(write)
        t0 = time.perf_counter()
        os.fdatasync(fd)
        t_w += time.perf_counter() - t0
        t_r = run(read)
    finally:
        os.close(fd)
        os.unlink(path)
    return {"bytes": n * BLOCK, "write_gbps": n * BLOCK / t_w / 1e9, "read_gbps": n * BLOCK / t_r / 1e9,
            "block_bytes": BLOCK, "threads": threads}
