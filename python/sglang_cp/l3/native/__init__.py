"""The L3 store's native library (sglang_cp/l3/_native), loaded with ctypes.

The package build compiles `native/*.c` into the stable-ABI extension `sglang_cp.l3._native` (setup.py);
nothing is compiled on a serving host. Its functions are plain C called through ctypes, which releases
the GIL for each call, so I/O threads and digest threads run them in parallel:
  cpl3_crc32c             CRC32C (SSE4.2, three chains), the checksum of every blob
  cpl3_stage_pages        the write path's staging copy and checksum of a run of pages in one call
                          (stage_pages below; used whenever the library is installed)
  cpl3_write_runs         the write path's pwritev of a group of runs in one call (write_runs below;
                          used whenever the library is installed)
  cpl3_read_pages         the native read engine (io.read_engine = "native"): native/reads.py
  cpl3_gate_close         closes an operation's permission to write the caller's pages
  cpl3_uring_*            the io_uring read engine (io.read_engine = "uring"): native/uring.py declares them
  cpl3_digests_sep/_ends  the hit query's key digests (index.digest_threads > 0): native/digests.py
  cpl3_page_starts        whole pages in a run of token indices (page_starts below) and
  cpl3_held_probe         the hit query's batch lookup in HeldDigests' table (held_probe below), called
                          through ctypes.PyDLL, which keeps the GIL: short loops whose GIL release would
                          cost more than the loop beside a busy Python thread (CPython's 5 ms switch interval)
A build without a C compiler installs without the library; a store configured to use it then refuses
to start with the field and the fix (`unavailable`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from typing import Optional

import numpy as np

from ..errors import L3InvariantError, L3StartupError

MODULE = "sglang_cp.l3._native"

# Mirror of cpl3_read_item (read_pages.c); its size is checked against the library's at load.
READ_ITEM = np.dtype([("offset", "<u8"), ("dst", "<u8"), ("slot", "<u4"), ("reserved", "<u4"),
                      ("digest", "V16"), ("status", "<i4"), ("detail", "<i4")])
# cpl3_read_item.status
OK, READ_ERROR, SHORT_READ, BAD_MAGIC, HEADER_CRC, BAD_VERSION, FOREIGN, CRC_MISMATCH, CANCELLED = (
    1, -1, -2, -3, -4, -5, -6, -7, -8)
# The BlobError reason (and so the counter) of each failed status, as the Python read path names it.
BLOB_REASONS = {SHORT_READ: "short_read", BAD_MAGIC: "bad_magic", HEADER_CRC: "header_crc",
                BAD_VERSION: "bad_version", FOREIGN: "foreign_blob", CRC_MISMATCH: "crc_mismatch"}
FOREIGN_DETAIL = {1: "payload/rank/length differ", 2: "slot differs", 3: "key digest differs"}


class Gate(ctypes.Structure):
    """cpl3_gate: an operation's permission to write the caller's pages (closed, copying)."""
    _fields_ = [("closed", ctypes.c_int32), ("copying", ctypes.c_int32)]


_lib: Optional[ctypes.CDLL] = None
_lock = threading.Lock()
_gil_lib = None  # ctypes.PyDLL of the library (calls keep the GIL), False once found missing


def library_path() -> Optional[str]:
    spec = importlib.util.find_spec(MODULE)
    return spec.origin if spec is not None and spec.origin else None


def unavailable(field: str, value) -> L3StartupError:
    return L3StartupError(
        f"{field} = {value!r} needs the sglang-cp native library ({MODULE}), which this installation lacks "
        "(the package was built without a C compiler); install gcc or cc and reinstall sglang-cp "
        f"(pip install --force-reinstall --no-deps <sglang-cp>), or set {field} back to its default")


def load(field: str, value, fix: str = "reinstall sglang-cp on this host, or set the field back to its default"
         ) -> ctypes.CDLL:
    """The library, loaded once per process; L3StartupError naming `field` when it is not installed, and
    `fix` when it is installed but does not load."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if path is None:
            raise unavailable(field, value)
        try:
            lib = ctypes.CDLL(path)  # CDLL, not PyDLL: each call releases the GIL
        except OSError as e:
            raise L3StartupError(f"{field} = {value!r}: cannot load the sglang-cp native library {path} ({e}); "
                                 f"{fix}") from None
        _declare(lib)
        if lib.cpl3_read_item_size() != READ_ITEM.itemsize or lib.cpl3_gate_size() != ctypes.sizeof(Gate):
            raise L3InvariantError(f"{path}: its structures differ from sglang_cp.l3.native's mirror; the "
                                   "library and the Python package come from different builds")
        _lib = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    vp, u8p, sz, u32, u64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint64
    lib.cpl3_crc32c.argtypes = [u32, vp, sz]
    lib.cpl3_crc32c.restype = u32
    lib.cpl3_stage_pages.argtypes = [u64, vp, vp, u64, vp]
    lib.cpl3_stage_pages.restype = None
    lib.cpl3_write_runs.argtypes = [ctypes.c_int, u64, vp, vp, vp, vp]
    lib.cpl3_write_runs.restype = None
    lib.cpl3_crc32c_hardware.argtypes = [ctypes.c_int]
    lib.cpl3_crc32c_hardware.restype = ctypes.c_int
    lib.cpl3_read_pages.argtypes = [ctypes.c_int, u32, u32, u64, u64, vp, u64, vp, u64, ctypes.POINTER(Gate)]
    lib.cpl3_read_pages.restype = ctypes.c_int
    lib.cpl3_gate_close.argtypes = [ctypes.POINTER(Gate), ctypes.c_double]
    lib.cpl3_gate_close.restype = ctypes.c_int
    lib.cpl3_read_item_size.restype = lib.cpl3_gate_size.restype = u64
    lib.cpl3_digests_sep.argtypes = [u8p, u8p, sz, u8p, sz, sz, vp]
    lib.cpl3_digests_ends.argtypes = [u8p, u8p, sz, u8p, sz, vp, sz, vp]
    lib.cpl3_digests_sep.restype = lib.cpl3_digests_ends.restype = ctypes.c_int


def _gil_held_library():
    """The library through ctypes.PyDLL (its calls keep the GIL), or None where it is not installed."""
    global _gil_lib
    if _gil_lib is None:
        with _lock:
            if _gil_lib is None:
                path = library_path()
                try:
                    lib = ctypes.PyDLL(path) if path is not None else False
                    if lib:
                        vp, u64, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
                        lib.cpl3_page_starts.argtypes = [vp, u64, i64, vp]
                        lib.cpl3_page_starts.restype = i64
                        lib.cpl3_held_probe.argtypes = [vp, u64, ctypes.c_char_p, u64, ctypes.c_uint32, u64, vp, vp]
                        lib.cpl3_held_probe.restype = i64
                except (OSError, AttributeError):  # not installed, or a build without these functions
                    lib = False
                _gil_lib = lib
    return _gil_lib or None


def page_starts(address: int, n_pages: int, page_size: int) -> Optional[list[int]]:
    """The first index of each of `n_pages` groups of `page_size` int64 token indices at `address` (a
    contiguous CPU buffer the caller keeps alive), if every group is a whole page (s, s+1, ...,
    s+page_size-1, s a multiple of page_size); None if one is not or the library is not installed: the
    caller then checks with its own code, which names the bad group. Keeps the GIL (see the docstring)."""
    lib = _gil_held_library()
    if lib is None or page_size <= 0 or n_pages < 0:
        return None
    starts = np.empty(n_pages, dtype=np.int64)
    bad = lib.cpl3_page_starts(address, n_pages, page_size, starts.ctypes.data)
    return starts.tolist() if bad < 0 else None


def held_probe(table: np.ndarray, raw: bytes, max_probes: int, mask: int):
    """HeldDigests' batch lookup (``cpl3_held_probe``): for the digests back to back in `raw`, their
    values in `table` (uint64, a power-of-two size), UINT64_MAX where a chain went past `max_probes`;
    and how many values hold every bit of `mask`. (values, full, past_bound), or None where the library
    is not installed. Keeps the GIL, so the table's writer cannot store into it meanwhile."""
    lib = _gil_held_library()
    if lib is None:
        return None
    n = len(raw) // 16
    out = np.empty(n, dtype=np.uint64)
    full = ctypes.c_uint64(0)
    past = lib.cpl3_held_probe(table.ctypes.data, table.size - 1, raw, n, max_probes, mask, out.ctypes.data,
                               ctypes.addressof(full))
    return out, full.value, past


def installed() -> Optional[ctypes.CDLL]:
    """The library if this installation has it, else None: for paths with a Python fallback (the write
    path's staging copy). A library that is installed but does not load is a broken installation: that
    raises, naming the file, rather than quietly taking the slower path."""
    if _lib is None and library_path() is None:
        return None
    return load("the write path's staging copy", "native", fix="reinstall sglang-cp on this host")


def address(buf) -> int:
    """Start address of a contiguous buffer (a memoryview the caller keeps alive), for a C call."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def stage_pages(lib: ctypes.CDLL, dsts: np.ndarray, srcs: np.ndarray, nbytes: int) -> np.ndarray:
    """Copy `nbytes` from each address in `srcs` to the one in `dsts` (uint64 arrays; the caller keeps both
    sides alive) and return each copy's CRC32C (uint32), in one call, so one GIL release for the run."""
    n = len(dsts)
    if len(srcs) != n:
        raise L3InvariantError(f"stage_pages: {n} destinations but {len(srcs)} sources")
    crcs = np.empty(n, dtype=np.uint32)
    lib.cpl3_stage_pages(n, dsts.ctypes.data, srcs.ctypes.data, nbytes, crcs.ctypes.data)
    return crcs


# struct iovec on Linux x86-64 and aarch64: a pointer and a size_t
IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])


def write_runs(lib: ctypes.CDLL, fd: int, offsets: list[int], runs: list[list[memoryview]]) -> list[int]:
    """pwritev each run's buffers (contiguous, alive for the call) at its offset, all in one call, so one
    GIL release for the group; per run the bytes written or -errno (EINTR retried)."""
    n = len(runs)
    if len(offsets) != n:
        raise L3InvariantError(f"write_runs: {n} runs but {len(offsets)} offsets")
    counts = np.fromiter((len(r) for r in runs), dtype=np.uint64, count=n)
    iovs = np.array([(address(v), v.nbytes) for run in runs for v in run], dtype=IOVEC)
    offs = np.asarray(offsets, dtype=np.uint64)
    results = np.empty(n, dtype=np.int64)
    lib.cpl3_write_runs(fd, n, offs.ctypes.data, counts.ctypes.data, iovs.ctypes.data, results.ctypes.data)
    return results.tolist()


def crc32c(data, value: int = 0) -> int:
    """The library's CRC32C of a buffer (the same values as the crc32c package)."""
    lib = load("crc32c", "native")
    arr = np.frombuffer(data, dtype=np.uint8)
    return lib.cpl3_crc32c(value, arr.ctypes.data, arr.nbytes)
