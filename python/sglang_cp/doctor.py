"""``sglang-cp doctor``: can this machine run what the user asked for?

Each check yields rows (area, item, status, detail). Status is one of OK, INFO, WARN,
FAIL; any FAIL makes the command exit non-zero, because it names something that would
stop the server at startup (or, worse, make it run without what was asked for).
"""

from __future__ import annotations

import importlib.metadata as md
import mmap
import os
import platform
import re
import uuid
from dataclasses import dataclass
from typing import Iterable, Optional

OK, INFO, WARN, FAIL = "OK", "INFO", "WARN", "FAIL"
HUGETLBFS_MAGIC = 0x958458F6
GiB = 1 << 30


@dataclass
class Row:
    area: str
    item: str
    status: str
    detail: str


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_versions() -> Iterable[Row]:
    from sglang_cp.plugin import SGLANG_PIN, installed_sglang_version, sglang_pin_problem

    yield Row("versions", "python", INFO, platform.python_version())
    pin = sglang_pin_problem()
    yield Row("versions", "sglang", FAIL if pin else OK, pin or installed_sglang_version())
    fixes = {"torch": f'pip install "sglang=={SGLANG_PIN}" brings the torch it pins',
             "sglang-cp": "pip install the sglang-cp checkout (or its wheel): the plugin's entry point comes with it"}
    for dist, fix in fixes.items():
        v = _version(dist)
        yield Row("versions", dist, OK if v else FAIL, v or f"not installed: {fix}")


def check_plugin() -> Iterable[Row]:
    eps = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "sglang_cp"]
    if not eps:
        yield Row("plugin", "entry point", FAIL, "sglang.srt.plugins:sglang_cp not found: in the sglang-cp checkout run `pip install .`")
    else:
        yield Row("plugin", "entry point", OK, eps[0].value)
    if os.environ.get("SGLANG_CP_DISABLE"):
        yield Row("plugin", "kill switch", WARN, "SGLANG_CP_DISABLE is set: the plugin will not load")
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "sglang_cp" not in allowed.split(","):
        yield Row("plugin", "SGLANG_PLUGINS", WARN, f"{allowed!r} does not name sglang_cp: it will not load")


def unresolved_hook_targets() -> list[tuple[str, str, str]]:
    """(module, target, error) for every hook target that does not resolve upstream."""
    import pkgutil

    from sglang_cp.integration import all_hooks

    bad = []
    for module, spec in all_hooks():
        try:
            if spec.kind == "resolution":
                from sglang.srt.arg_groups.resolution_hooks import _OVERRIDABLE_HOOKS

                if spec.target not in _OVERRIDABLE_HOOKS:
                    raise LookupError("not an overridable resolution step")
            else:
                pkgutil.resolve_name(spec.target)
        except Exception as e:  # report every failure, not only the first
            bad.append((module, spec.target, f"{type(e).__name__}: {e}"))
    return bad


def check_hooks() -> Iterable[Row]:
    from sglang_cp.integration import all_hooks

    try:
        total = len(all_hooks())
        bad = unresolved_hook_targets()
    except Exception as e:
        yield Row("hooks", "import", FAIL, f"{type(e).__name__}: {e}")
        return
    if not bad:
        yield Row("hooks", "upstream targets", OK, f"all {total} resolve in the installed sglang")
    for module, target, err in bad:
        yield Row("hooks", target, FAIL, f"{module}: {err}")


def probe_odirect(directory: str) -> tuple[bool, str]:
    """Write, fdatasync and read back one 4 KiB block with O_DIRECT in ``directory``."""
    from sglang_cp.l3.format.blob import ALIGN

    path = os.path.join(directory, f".sglang-cp-odirect-probe-{uuid.uuid4().hex}")
    buf = mmap.mmap(-1, ALIGN)
    buf.write(b"\xa5" * ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        return False, f"open(O_DIRECT) failed: {e.strerror}"
    try:
        os.pwritev(fd, [buf], 0)
        os.fdatasync(fd)
        back = mmap.mmap(-1, ALIGN)
        n = os.preadv(fd, [back], 0)
        ok = n == ALIGN and back[:] == buf[:]
        return ok, "write+fdatasync+read of 4 KiB ok" if ok else "read-back mismatch"
    except OSError as e:
        return False, f"O_DIRECT I/O failed: {e.strerror}"
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


def _writable(directory: str) -> tuple[bool, str]:
    path = os.path.join(directory, f".sglang-cp-write-probe-{uuid.uuid4().hex}")
    try:
        with open(path, "wb") as f:
            f.write(b"x")
        os.unlink(path)
        return True, "writable"
    except OSError as e:
        return False, f"not writable: {e.strerror}"


def check_l3_config(path: str) -> Iterable[Row]:
    from sglang_cp.args import CpArgsError, load_config

    try:
        cfg = load_config(path)
    except CpArgsError as e:
        yield Row("l3 config", path, FAIL, str(e))
        return
    yield Row("l3 config", path, OK, "schema valid")
    index_dir = cfg.index.dir
    ok, detail = _writable(index_dir)
    yield Row("l3 index", index_dir, OK if ok else FAIL, f"LMDB dir {detail}")
    if ok and cfg.index.digest_threads:
        yield _native_digest_row(cfg.index.digest_threads)
    if cfg.io.read_engine == "native":
        yield _native_read_engine_row()
    if cfg.io.read_engine == "uring":
        yield _uring_read_engine_row()
    if cfg.io.read_engine != "python":
        yield _switch_interval_row(cfg.io.gil_switch_interval_ms)
    for disk in cfg.disks:
        ok, detail = probe_odirect(disk.path)
        yield Row("l3 disk", f"{disk.name}: {disk.path}", OK if ok else FAIL, f"O_DIRECT: {detail}")
        space = disk_space(cfg, disk)
        yield Row("l3 disk", f"{disk.name}: space", FAIL if space.short else OK,
                  space.detail() + ("; lower capacity_gb or free space" if space.short else ""))
        if space.stale:
            total = sum(b for _, b, _ in space.stale)
            yield Row("l3 disk", f"{disk.name}: stale slabs", WARN,
                      f"{len(space.stale)} file(s), {total / 1e9:.3f} GB the store will not reuse (not counted as "
                      "free): " + "; ".join(f"{os.path.basename(p)} ({why})" for p, _, why in space.stale[:5])
                      + ("; ..." if len(space.stale) > 5 else "")
                      + ". With no server running, delete them to free the space")
        yield from _plp_rows(disk.name, disk.path, cfg.plp_policy)


@dataclass
class DiskSpace:
    """Room for one ``[[disks]]`` entry's slab files: ``need`` bytes (its capacity_gb, shared by the
    node's ranks on it) against what is free plus the slabs the store reopens in place."""

    need: int
    free: int
    reusable: int  # bytes in slab files the store would reopen (counted up to ``need``, never beyond)
    stale: list  # [(path, bytes, why)] of slab files it would not reuse (not counted as free)

    @property
    def short(self) -> bool:
        return self.free + min(self.reusable, self.need) < self.need

    def detail(self) -> str:
        reuse = f" + {min(self.reusable, self.need) / 1e9:.1f} GB in slabs the store reopens" if self.reusable else ""
        return f"capacity {self.need / 1e9:g} GB; {self.free / 1e9:.1f} GB free{reuse}"


def disk_space(cfg, disk) -> DiskSpace:
    """``disk``'s room as the store will find it at startup (it preallocates every slab file then):
    shared by ``sglang-cp doctor`` and ``sglang-cp check-args``."""
    st = os.statvfs(disk.path)
    reusable, stale = _slab_space(cfg.slab_dir(disk.path))
    return DiskSpace(need=int(disk.capacity_bytes), free=st.f_bavail * st.f_frsize, reusable=reusable, stale=stale)


def space_problems(cfg) -> list[str]:
    """One line per ``[[disks]]`` entry whose capacity_gb does not fit on its disk, naming the field."""
    out = []
    for i, disk in enumerate(cfg.disks):
        space = disk_space(cfg, disk)
        if space.short:
            out.append(f"disks[{i}].capacity_gb = {disk.capacity_bytes / 1e9:g} does not fit on '{disk.path}': "
                       f"{space.detail()}. The store preallocates its slab files at startup: lower "
                       "capacity_gb or free space on that disk")
    return out


def _native_read_engine_row() -> Row:
    """io.read_engine = "native": the package's native library must be installed on this host."""
    from sglang_cp.l3 import native
    from sglang_cp.l3.errors import L3StartupError

    try:
        lib = native.load("io.read_engine", "native")
    except L3StartupError as e:
        return Row("l3 io", "read_engine = native", FAIL, str(e))
    crc = "SSE4.2" if lib.cpl3_crc32c_hardware(-1) else "a table loop (no SSE4.2: slower than the CPU allows)"
    return Row("l3 io", "read_engine = native", OK if lib.cpl3_crc32c_hardware(-1) else WARN,
               f"native library {native.library_path()} loaded; CRC32C on {crc}")


def _uring_read_engine_row() -> Row:
    """io.read_engine = "uring": the native library, and io_uring allowed here (else the store reads with the
    native engine: a warning, not a failure)."""
    from sglang_cp.l3.native import uring as uring_reads
    from sglang_cp.l3.errors import L3StartupError

    item = "read_engine = uring"
    try:
        err = uring_reads.probe()
    except L3StartupError as e:
        return Row("l3 io", item, FAIL, str(e))
    if err:
        refused = uring_reads.UringRefused(err)
        return Row("l3 io", item, WARN, f"io_uring refused ({refused}): the store reads with read_engine_effective = "
                   f"native; to use io_uring, {refused.fix()}")
    return Row("l3 io", item, OK, "io_uring available: read_engine_effective = uring")


def _switch_interval_row(ms: float) -> Row:
    """A fast-drive engine: say how long a restore's GIL hand-offs may wait beside the server's busy
    scheduler thread (io.gil_switch_interval_ms); advice, never a failure."""
    if ms:
        return Row("l3 io", f"gil_switch_interval_ms = {ms:g}", INFO,
                   f"the server's scheduler process runs at a {ms:g} ms switch interval while the store is open")
    return Row("l3 io", "gil_switch_interval_ms = 0", INFO,
               "CPython's 5 ms: each GIL hand-off of a restore beside the server's busy scheduler thread can wait "
               "that long; for drives faster than about 2 GB/s set it to 0.5 (docs/configuration.md)")


def _native_digest_row(threads: int) -> Row:
    """index.digest_threads > 0: load the native hasher as the server will and check it against
    hashlib, so an installation without the native library fails here rather than at the server's start."""
    from sglang_cp.l3.errors import L3StartupError
    from sglang_cp.l3.native.digests import native_digests

    item = f"digest_threads = {threads}"
    try:
        native_digests(threads).close()
    except L3StartupError as e:
        return Row("l3 index", item, FAIL, str(e))
    cores = os.cpu_count() or 1
    status = OK if threads <= cores else WARN
    more = "" if status == OK else f"; more threads than the {cores} cores: lower it"
    return Row("l3 index", item, status,
               f"native key hasher loaded and checked against hashlib{more}")


def _slab_space(sub: str) -> tuple[int, list[tuple[str, int, str]]]:
    """(bytes of the slab files a store would reopen in place, [(path, bytes, why)] of stale ones) in the
    config's slab directory ``sub`` (``<disk>/sglang-cp-l3[/ns-<namespace>]``).

    The store opens ``r<rank>.<payload>.s<slot bytes>.slab`` there: one file per rank and payload. Another
    slot size of the same rank and payload (left by an earlier config) is never reopened, nor is a file
    only named like a slab; of several, the most recently written is the one in use. Other namespaces'
    files are other servers': neither reusable nor stale here."""
    from sglang_cp.l3.format.blob import ALIGN
    from sglang_cp.l3.tools.fsck import SLAB_NAME

    try:
        names = os.listdir(sub)
    except OSError:
        return 0, []
    latest: dict[tuple[str, str], tuple[float, str, int]] = {}
    stale: list[tuple[str, int, str]] = []
    for name in sorted(names):
        m = SLAB_NAME.match(name)
        if not m:
            continue
        path = os.path.join(sub, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        size = st.st_blocks * 512
        slot = int(m.group(3))
        if not os.path.isfile(path) or os.path.islink(path) or slot <= 0 or slot % ALIGN:
            stale.append((path, size, "not a slab the store writes"))
            continue
        key = (m.group(1), m.group(2))
        prev = latest.get(key)
        if prev is None or st.st_mtime > prev[0]:
            if prev is not None:
                stale.append((prev[1], prev[2], f"older slot size of rank {key[0]} payload {key[1]}"))
            latest[key] = (st.st_mtime, path, size)
        else:
            stale.append((path, size, f"older slot size of rank {key[0]} payload {key[1]}"))
    return sum(v[2] for v in latest.values()), stale


def _plp_rows(name: str, path: str, policy: str) -> Iterable[Row]:
    from sglang_cp.l3.plp import probe_write_cache

    probe = probe_write_cache(path)
    item = f"{name}: write cache"
    if probe.write_cache is None:
        yield Row("l3 disk", item, INFO, "unknown (not a block device); PLP not verifiable")
    elif probe.volatile:
        # The loader already refused the config when plp_policy = "require".
        yield Row("l3 disk", item, WARN, f"{probe.device}: volatile ('write back'); plp_policy = {policy!r}")
    else:
        yield Row("l3 disk", item, OK, f"{probe.device}: {probe.write_cache}")


def hugetlbfs_mounts() -> list[str]:
    mounts = []
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "hugetlbfs":
                    mounts.append(parts[1])
    except OSError:
        pass
    return mounts


def check_hugepages(hugetlbfs_dir: Optional[str], hicache_size_gb: Optional[float],
                    max_slab_gb: float, required: bool) -> Iterable[Row]:
    from sglang_cp.l2 import doctor_report
    from sglang_cp.l2.errors import HugepageL2Error
    from sglang_cp.l2.hugetlbfs import HugetlbfsMount

    mounts = hugetlbfs_mounts()
    if not mounts:
        yield Row(
            "hugepages",
            "hugetlbfs mounts",
            FAIL if required else INFO,
            "none mounted; `echo N > /proc/sys/vm/nr_hugepages && mount -t hugetlbfs none "
            "/dev/hugepages` to use --enable-cp-shared-physical-l2-hicache",
        )
    for m in mounts:
        # statvfs reports 0 free on a mount without size=: count through sysfs (l2).
        try:
            cap = HugetlbfsMount.probe(m).capacity()
            yield Row("hugepages", m, OK, f"hugetlbfs, {cap.total_pages} total / {cap.free_pages} free "
                                          f"({cap.free_bytes / GiB:.1f} GiB; {cap.source})")
        except HugepageL2Error as e:
            yield Row("hugepages", m, WARN, str(e))
        yield from _stale_l2_rows(m)
    if not required and hugetlbfs_dir not in mounts:
        return  # nothing asked for hugepages and the default dir is not mounted: no plan to show
    for area, item, status, detail in doctor_report(hugetlbfs_dir, hicache_size_gb, max_slab_gb):
        if not required and status == FAIL:
            status = WARN  # not asked for: informative only
        yield Row(area, item, status, detail)


def _stale_l2_rows(mount: str) -> Iterable[Row]:
    from sglang_cp.l2.slab_files import stale_files

    try:
        stale = stale_files(mount)
    except OSError as e:
        yield Row("hugepages", f"{mount}: L2 slab files", WARN, f"cannot list them: {e.strerror}")
        return
    if stale:
        spaces = sorted({f.namespace for _, f, _ in stale})
        yield Row("hugepages", f"{mount}: stale L2 slabs", WARN,
                  f"{len(stale)} slab file(s) of dead servers (namespaces {', '.join(spaces)}) hold "
                  f"{sum(b for _, _, b in stale) / GiB:.2f} GiB of hugepages; the next server start with "
                  "--enable-cp-shared-physical-l2-hicache on this mount reclaims them, whatever its --port")


def check_cuda() -> Iterable[Row]:
    try:
        import torch

        if torch.cuda.is_available():
            names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
            yield Row("cuda", "devices", OK, f"{torch.cuda.device_count()} x {', '.join(names)}")
        else:
            yield Row("cuda", "devices", INFO, "no CUDA device: CPU-only checks and tests only")
    except Exception as e:
        yield Row("cuda", "torch", WARN, f"torch import failed: {e}")


def run_checks(cp_l3_config: Optional[str] = None, hugetlbfs_dir: Optional[str] = None,
               hicache_size_gb: Optional[float] = None, max_slab_gb: float = 480.0,
               require_hugepages: bool = False) -> list[Row]:
    rows: list[Row] = []
    rows += check_versions()
    rows += check_plugin()
    rows += check_hooks()
    if cp_l3_config:
        rows += check_l3_config(cp_l3_config)
    rows += check_hugepages(hugetlbfs_dir, hicache_size_gb, max_slab_gb, require_hugepages)
    rows += check_cuda()
    return rows


# A command in a row's detail, as we write them: `echo N > /proc/sys/vm/nr_hugepages && mount ...`.
COMMAND = re.compile(r"`([^`]+)`")


def render(rows: list[Row], console=None) -> None:
    """The rows as a table. Commands named in a detail are printed below it, numbered, one per
    line and never wrapped, so they copy and paste whole; the table names them by number."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log or a pipe: do not squeeze the table into 80 columns
            console = Console(width=160)
    commands: list[str] = []

    def lift(detail: str) -> str:
        def number(m):
            if m.group(1) not in commands:
                commands.append(m.group(1))
            return f"command [{commands.index(m.group(1)) + 1}] below"
        return COMMAND.sub(number, detail)

    table = Table(title="sglang-cp doctor", show_lines=False)
    for col in ("area", "item", "status", "detail"):
        table.add_column(col, overflow="fold")
    style = {OK: "green", INFO: "cyan", WARN: "yellow", FAIL: "bold red"}
    for r in rows:
        # Items and details carry user text: paths, TOML fields such as "[index]" or "disks[0]".
        table.add_row(escape(r.area), escape(r.item), f"[{style[r.status]}]{r.status}[/]", escape(lift(r.detail)))
    console.print(table)
    for n, cmd in enumerate(commands, 1):
        console.print(f"[{n}] {cmd}", markup=False, highlight=False, soft_wrap=True)
    fails = sum(r.status == FAIL for r in rows)
    console.print(f"{fails} blocking problem(s)" if fails else "no blocking problems")


def exit_code(rows: list[Row]) -> int:
    return 1 if any(r.status == FAIL for r in rows) else 0

