"""The raw-disk yardstick cachebench prints its own GB/s against, measured in the same run.

Sequential O_DIRECT writes then reads of one scratch file in the L3 disk directory, writes in
1 MiB requests (the largest write the L3 store coalesces), reads in ``read_block`` requests
(cachebench: the store's coalesced read, ``l3.reads.READ_IO_BYTES``), ``threads`` requests in
flight (cachebench: every rank's ``io.threads``); writes end with fdatasync, as the store's group
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


def _read_pass(fd: int, count: int, threads: int, read_block: int) -> float:
    """Seconds to read ``count`` requests of ``read_block`` bytes from the start of ``fd``."""
    bufs = [aligned_buffer(read_block, populate=True) for _ in range(threads)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        done = sum(ex.map(lambda i: os.preadv(fd, [bufs[i % threads]], i * read_block), range(count)))
    if done != count * read_block:
        raise OSError(f"raw disk probe: short read ({done}/{count * read_block} B)")
    return time.perf_counter() - t0


def reread(raw: dict) -> dict:
    """The probe file of ``measure(..., keep=True)`` read again (at rest now, as L3 pages mostly are when
    read: right after its writes a virtio disk with a write-back cache reads it at half speed), then
    deleted. ``read_gbps`` becomes the faster pass, so "x raw" is against the disk's better figure."""
    path = raw.pop("path")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            t = _read_pass(fd, raw["bytes"] // raw["read_block_bytes"], raw["threads"], raw["read_block_bytes"])
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
    later = raw["bytes"] / t / 1e9
    return dict(raw, read_gbps_passes=[raw["read_gbps"], later], read_gbps=max(raw["read_gbps"], later))


def discard(raw: dict) -> None:
    """Delete the probe file ``measure(..., keep=True)`` kept, if ``reread`` has not (a failed run)."""
    path = raw.pop("path", None)
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def measure(directory: str, nbytes: int, threads: int = 4, read_block: int = BLOCK, keep: bool = False) -> dict:
    if read_block % BLOCK:
        raise ValueError(f"read_block: {read_block} is not a multiple of {BLOCK}")
    per = read_block // BLOCK
    n = max(per, nbytes // read_block * per)  # 1 MiB writes, making whole read requests
    path = os.path.join(directory, f".cachebench-raw-{os.getpid()}")
    bufs = [aligned_buffer(BLOCK, populate=True) for _ in range(threads)]
    for b in bufs:
        b.write(os.urandom(BLOCK))  # incompressible, and not a zero page the device could skip
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, n * BLOCK)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            done = sum(ex.map(lambda i: os.pwritev(fd, [bufs[i % threads]], i * BLOCK), range(n)))
        if done != n * BLOCK:
            raise OSError(f"raw disk probe: short write ({done}/{n * BLOCK} B) in {directory}")
        os.fdatasync(fd)
        t_w = time.perf_counter() - t0
        t_r = _read_pass(fd, n // per, threads, read_block)
    finally:
        os.close(fd)
        if not keep:
            os.unlink(path)
    return {**({"path": path} if keep else {}), "bytes": n * BLOCK, "write_gbps": n * BLOCK / t_w / 1e9,
            "read_gbps": n * BLOCK / t_r / 1e9, "block_bytes": BLOCK, "read_block_bytes": read_block,
            "threads": threads}
