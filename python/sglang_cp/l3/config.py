"""TOML config of the L3 store: schema, validation and semantics.

`load_l3_config(path)` is called by the server at startup (args.py); every `L3ConfigError` message is
shown to users verbatim, so each names the TOML field path and the fix. See docs_internal/l3_store.md.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project runs on 3.11; tomli is the backport
    import tomli as tomllib

from .format.blob import ALIGN
from .devices import shared_device_pairs
from .errors import L3ConfigError
from .plp import PlpProbe, probe_write_cache

logger = logging.getLogger(__name__)

GB = 10**9
SLAB_SUBDIR = "sglang-cp-l3"  # the store's directory under each disk path
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
PLP_POLICIES = ("require", "warn", "ignore")
BACKUP_ACKS = ("durable", "written", "operation")
# Upper bounds, so an absurd value is a config error naming the field instead of an OverflowError or an
# allocation failure at store open.
MAX_DISK_BYTES = 2**62            # a slab is one file: its size must be a valid off_t with room to spare
MAX_MAP_BYTES = 2**46             # LMDB maps the whole map: 64 TiB is half of x86-64 user address space
MAX_INFLIGHT_PAGES = 65536        # staging holds this many slot images per payload, allocated at open
_warned_devices: set[str] = set()
_warned_shared: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class IndexConfig:
    dir: str
    map_size_bytes: int
    max_map_size_bytes: int
    # Threads hashing a hit query's keys in C (l3/native/digests.py); 0: hashlib on the caller's thread.
    digest_threads: int = 0


@dataclass(frozen=True)
class GcConfig:
    high_watermark: float = 0.90
    low_watermark: float = 0.85
    max_reclaim_per_iter: int = 64


@dataclass(frozen=True)
class IoConfig:
    threads: int = 4
    max_inflight_pages: int = 64
    # write_pages with a timeout (upstream's backup path) writes 4 KiB-aligned pages straight from the
    # caller's memory instead of copying them into staging; a page whose I/O outlives the caller's
    # bound is never indexed. docs_internal/l3_store.md, "Zero-copy writes under a timeout".
    zero_copy_writes: bool = False
    # How reads land, are checked and reach the caller: "python" (a whole slot lands in store memory,
    # then CRC and copy-out on a finisher thread) or "native" (l3/native/reads.py: chunk by chunk in C,
    # checked in cache and copied once, one GIL-free call per run). docs_internal/l3_store.md,
    # "The native read engine". "uring" (l3/native/uring.py): the native engine's checks with each run's
    # reads in flight together on an io_uring; falls back to "native" where io_uring is refused.
    read_engine: str = "python"
    # io.read_engine = "uring": reads in flight per ring (one ring per read I/O thread).
    uring_depth: int = 64
    # CPython's switch interval (ms) for the serving process, set when the store opens there; 0 leaves
    # the interpreter's own (5 ms). A server's scheduler thread polls without pause while a request waits
    # for its prefetch, so each GIL hand-off of the restore (upstream's prefetch and completion threads,
    # our read's return) waits up to this long. docs_internal/cp_l3_integration.md, item 6.
    gil_switch_interval_ms: float = 0.0


READ_ENGINES = ("python", "native", "uring")
# io.gil_switch_interval_ms: below 0.05 ms the interpreter would hand the GIL over faster than a thread does
# useful work between hand-offs; above 5 ms it would be longer than CPython's own default.
MIN_SWITCH_INTERVAL_MS, MAX_SWITCH_INTERVAL_MS = 0.05, 5.0
MAX_URING_DEPTH = 1024  # each read in flight has its own landing slot (264 KiB), allocated at open


@dataclass(frozen=True)
class DiskConfig:
    name: str
    path: str
    capacity_bytes: int


@dataclass(frozen=True)
class L3Config:
    index: IndexConfig
    disks: tuple[DiskConfig, ...]
    gc: GcConfig = GcConfig()
    io: IoConfig = IoConfig()
    plp_policy: str = "warn"
    # When the HiCache backend returns a backup to SGLang: "durable" (data -> fdatasync -> index
    # commit), "written" (pwrite done; the commit follows in a group) or "operation" (each batch of an
    # upstream backup operation returns once staged; the operation's ack waits until every page of it
    # is durable). docs_internal/l3_write_ack.md
    backup_ack: str = "durable"
    rank_to_disk: dict[int, str] = field(default_factory=dict)
    slot_bytes: dict[str, int] = field(default_factory=dict)
    plp_probes: tuple[PlpProbe, ...] = ()
    source: Optional[str] = None
    namespace: str = ""  # one server's files among several sharing index.dir / disk paths

    @property
    def index_dir(self) -> str:
        """The LMDB index of this config's namespace: index.dir itself, or ns-<namespace> under it."""
        return os.path.join(self.index.dir, f"ns-{self.namespace}") if self.namespace else self.index.dir

    def slab_dir(self, disk_path: str) -> str:
        """Where this namespace's slab files live on a disk: <path>/sglang-cp-l3[/ns-<namespace>]."""
        base = os.path.join(disk_path, SLAB_SUBDIR)
        return os.path.join(base, f"ns-{self.namespace}") if self.namespace else base

    def disk_index_for_rank(self, rank: int) -> int:
        name = self.rank_to_disk.get(rank)
        if name is None:
            return rank % len(self.disks)
        return [d.name for d in self.disks].index(name)


_SCHEMA: dict[str, set[str]] = {
    "": {"namespace", "index", "gc", "durability", "io", "disks", "rank_to_disk", "slot_bytes"},
    "index": {"dir", "map_size_gb", "max_map_size_gb", "digest_threads"},
    "gc": {"high_watermark", "low_watermark", "max_reclaim_per_iter"},
    "durability": {"plp_policy", "backup_ack"},
    "io": {"threads", "max_inflight_pages", "zero_copy_writes", "read_engine", "uring_depth",
           "gil_switch_interval_ms"},
    "disks": {"name", "path", "capacity_gb"},
}


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _check_keys(table: dict, where: str, schema_key: str) -> None:
    allowed = _SCHEMA[schema_key]
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(sorted(allowed))}"
            raise L3ConfigError(f"{_join(where, key)}: unknown key; {hint}")


def _table(doc: dict, key: str, where: str, required: bool) -> dict:
    if key not in doc:
        if required:
            raise L3ConfigError(f"[{_join(where, key)}]: required table is missing; add it (see docs_internal/l3_store.md)")
        return {}
    value = doc[key]
    if not isinstance(value, dict):
        raise L3ConfigError(f"{_join(where, key)}: must be a table ([{key}]), got {type(value).__name__}")
    return value


def _number(table: dict, key: str, where: str, default: Optional[float]) -> float:
    path = _join(where, key)
    if key not in table:
        if default is None:
            raise L3ConfigError(f"{path}: required key is missing; set it to a number")
        return float(default)
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise L3ConfigError(f"{path}: must be a number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # a TOML integer too large for a float
        raise L3ConfigError(f"{path}: {value} is out of range; use a finite number") from None
    if not math.isfinite(value):
        raise L3ConfigError(f"{path}: must be a finite number, got {value}")
    return value


def _gb_to_bytes(value: float, path: str, limit: int, what: str) -> int:
    """GB (10**9 bytes) to bytes, refusing what no machine can honour instead of overflowing later."""
    if value * GB > limit:
        raise L3ConfigError(f"{path}: {value:g} GB is beyond {limit / GB:g} GB ({what}); use a real size")
    return int(value * GB)


def _integer(table: dict, key: str, where: str, default: Optional[int]) -> int:
    path = _join(where, key)
    if key not in table:
        if default is None:
            raise L3ConfigError(f"{path}: required key is missing; set it to an integer")
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise L3ConfigError(f"{path}: must be an integer, got {type(value).__name__} {value!r}")
    return value


def _string(table: dict, key: str, where: str, default: Optional[str]) -> str:
    path = _join(where, key)
    if key not in table:
        if default is None:
            raise L3ConfigError(f"{path}: required key is missing; set it to a string")
        return default
    value = table[key]
    if not isinstance(value, str) or not value:
        raise L3ConfigError(f"{path}: must be a non-empty string, got {type(value).__name__} {value!r}")
    return value


def _writable_dir(path: str, field_path: str) -> str:
    if not os.path.isabs(path):
        raise L3ConfigError(f"{field_path}: '{path}' must be an absolute path")
    if not os.path.exists(path):
        raise L3ConfigError(f"{field_path}: '{path}' does not exist; create it (mkdir -p '{path}') or fix the path")
    if not os.path.isdir(path):
        raise L3ConfigError(f"{field_path}: '{path}' is not a directory; point it at a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise L3ConfigError(
            f"{field_path}: '{path}' is not writable by this process (read-only mount or permissions); "
            "use a writable directory")
    return os.path.realpath(path)


def _parse_index(doc: dict) -> IndexConfig:
    t = _table(doc, "index", "", required=True)
    _check_keys(t, "index", "index")
    d = _writable_dir(_string(t, "dir", "index", None), "index.dir")
    size = _number(t, "map_size_gb", "index", 1.0)
    if size <= 0:
        raise L3ConfigError(f"index.map_size_gb: must be > 0, got {size}; e.g. 1.0")
    max_size = _number(t, "max_map_size_gb", "index", 16 * size)
    if max_size < size:
        raise L3ConfigError(
            f"index.max_map_size_gb: {max_size} is below index.map_size_gb {size}; raise it or remove it "
            "(default 16 x map_size_gb)")
    room = "what one process can map"
    size_bytes = _gb_to_bytes(size, "index.map_size_gb", MAX_MAP_BYTES, room)
    if "max_map_size_gb" in t:
        max_bytes = _gb_to_bytes(max_size, "index.max_map_size_gb", MAX_MAP_BYTES, room)
    else:  # the default grows with map_size_gb; keep it mappable
        max_bytes = min(int(max_size * GB), MAX_MAP_BYTES)
    threads = _integer(t, "digest_threads", "index", 0)
    if not 0 <= threads <= 64:
        raise L3ConfigError(f"index.digest_threads: must be in [0, 64], got {threads}; 0 (hashlib, the "
                            "default) or a few threads, e.g. 4")
    return IndexConfig(d, _round_up(size_bytes, ALIGN), _round_up(max_bytes, ALIGN), threads)


def _parse_gc(doc: dict) -> GcConfig:
    t = _table(doc, "gc", "", required=False)
    _check_keys(t, "gc", "gc")
    hi = _number(t, "high_watermark", "gc", 0.90)
    lo = _number(t, "low_watermark", "gc", 0.85)
    for name, v in (("high_watermark", hi), ("low_watermark", lo)):
        if not 0.0 < v <= 1.0:
            raise L3ConfigError(f"gc.{name}: must be in (0, 1], got {v}")
    if lo >= hi:
        raise L3ConfigError(
            f"gc.low_watermark: {lo} must be below gc.high_watermark {hi} (GC starts above high and reclaims "
            "down to low); e.g. high 0.90, low 0.85")
    n = _integer(t, "max_reclaim_per_iter", "gc", 64)
    if n < 1:
        raise L3ConfigError(f"gc.max_reclaim_per_iter: must be >= 1, got {n}")
    return GcConfig(hi, lo, n)


def _parse_io(doc: dict) -> IoConfig:
    t = _table(doc, "io", "", required=False)
    _check_keys(t, "io", "io")
    threads = _integer(t, "threads", "io", 4)
    if not 1 <= threads <= 256:
        raise L3ConfigError(f"io.threads: must be in [1, 256], got {threads}")
    inflight = _integer(t, "max_inflight_pages", "io", 64)
    if not 1 <= inflight <= MAX_INFLIGHT_PAGES:
        raise L3ConfigError(
            f"io.max_inflight_pages: must be >= 1 and <= {MAX_INFLIGHT_PAGES}, got {inflight} (the store allocates "
            "this many page-sized staging buffers per payload at open); the default is 64")
    zero_copy = t.get("zero_copy_writes", False)
    if not isinstance(zero_copy, bool):
        raise L3ConfigError(f"io.zero_copy_writes: must be true or false, got {type(zero_copy).__name__} "
                            f"{zero_copy!r}; the default is false")
    engine = t.get("read_engine", "python")
    if engine not in READ_ENGINES:
        raise L3ConfigError(f"io.read_engine: must be one of {', '.join(map(repr, READ_ENGINES))}, got {engine!r}; "
                            "the default is \"python\" (\"native\" and \"uring\" need the package's compiled library)")
    depth = _integer(t, "uring_depth", "io", 64)
    if not 2 <= depth <= MAX_URING_DEPTH:
        raise L3ConfigError(f"io.uring_depth: must be in [2, {MAX_URING_DEPTH}], got {depth}; the default is 64 "
                            "(reads in flight per read I/O thread with io.read_engine = \"uring\")")
    switch_ms = _number(t, "gil_switch_interval_ms", "io", 0.0)
    if switch_ms != 0.0 and not MIN_SWITCH_INTERVAL_MS <= switch_ms <= MAX_SWITCH_INTERVAL_MS:
        raise L3ConfigError(
            f"io.gil_switch_interval_ms: must be 0 (leave CPython's 5 ms) or in [{MIN_SWITCH_INTERVAL_MS}, "
            f"{MAX_SWITCH_INTERVAL_MS}], got {switch_ms}; e.g. 0.5 for drives faster than about 2 GB/s")
    return IoConfig(threads, inflight, zero_copy, engine, depth, switch_ms)


def _parse_disks(doc: dict) -> tuple[DiskConfig, ...]:
    if "disks" not in doc:
        raise L3ConfigError("disks: at least one [[disks]] entry is required (name, path, capacity_gb)")
    raw = doc["disks"]
    if not isinstance(raw, list) or not raw:
        raise L3ConfigError("disks: must be a non-empty array of tables ([[disks]]), "
                            f"got {type(raw).__name__}")
    disks, names, paths = [], {}, {}
    for i, t in enumerate(raw):
        where = f"disks[{i}]"
        if not isinstance(t, dict):
            raise L3ConfigError(f"{where}: must be a table with name, path, capacity_gb")
        _check_keys(t, where, "disks")
        name = _string(t, "name", where, None)
        path = _writable_dir(_string(t, "path", where, None), f"{where}.path")
        cap = _number(t, "capacity_gb", where, None)
        if cap <= 0:
            raise L3ConfigError(f"{where}.capacity_gb: must be > 0, got {cap}")
        if name in names:
            raise L3ConfigError(f"{where}.name: '{name}' duplicates disks[{names[name]}].name; names must be unique")
        if path in paths:
            raise L3ConfigError(
                f"{where}.path: '{path}' is the same directory as disks[{paths[path]}].path; "
                "list each directory once and give it the combined capacity_gb")
        names[name], paths[path] = i, i
        disks.append(DiskConfig(name, path, _gb_to_bytes(cap, f"{where}.capacity_gb", MAX_DISK_BYTES,
                                                          "the largest slab file")))
    return tuple(disks)


def _parse_rank_to_disk(doc: dict, disks: tuple[DiskConfig, ...]) -> dict[int, str]:
    t = _table(doc, "rank_to_disk", "", required=False)
    known = [d.name for d in disks]
    out = {}
    for k, v in t.items():
        where = f"rank_to_disk.{k!r}" if not str(k).isdigit() else f'rank_to_disk."{k}"'
        if not str(k).isdigit():
            raise L3ConfigError(f"{where}: keys must be rank numbers as strings, e.g. \"0\" = \"{known[0]}\"")
        if not isinstance(v, str) or v not in known:
            close = difflib.get_close_matches(str(v), known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known disks: {', '.join(known)}"
            raise L3ConfigError(f"{where}: names unknown disk {v!r}; {hint}")
        out[int(k)] = v
    return out


def _parse_slot_bytes(doc: dict) -> dict[str, int]:
    t = _table(doc, "slot_bytes", "", required=False)
    out = {}
    for k, v in t.items():
        where = f"slot_bytes.{k}"
        if isinstance(v, bool) or not isinstance(v, int):
            raise L3ConfigError(f"{where}: must be an integer number of bytes, got {type(v).__name__} {v!r}")
        if v <= 0 or v % ALIGN:
            raise L3ConfigError(
                f"{where}: {v} is not a positive multiple of {ALIGN} (O_DIRECT slots are 4 KiB aligned); "
                f"use {_round_up(max(v, 1), ALIGN)}")
        out[k] = v
    return out


def _parse_namespace(doc: dict) -> str:
    if "namespace" not in doc:
        return ""
    ns = doc["namespace"]
    if not isinstance(ns, str) or not _NAMESPACE.match(ns):
        raise L3ConfigError(
            f"namespace: {ns!r} is not a valid namespace; use 1-64 letters, digits, '_', '-' or '.', starting "
            "with a letter or digit (e.g. namespace = \"server-a\"), one per server sharing these directories")
    return ns


def _apply_plp_policy(policy: str, disks: tuple[DiskConfig, ...]) -> tuple[PlpProbe, ...]:
    probes = tuple(probe_write_cache(d.path) for d in disks)
    if policy == "ignore":
        return probes
    for i, (d, p) in enumerate(zip(disks, probes)):
        if not p.volatile:
            continue
        what = (f"disks[{i}].path '{d.path}' is on device {p.device} whose write cache is volatile "
                f"(/sys/block/{p.device}/queue/write_cache = 'write back'): without power-loss protection "
                "a power cut can lose pages after fdatasync if the device ignores flushes")
        if policy == "require":
            raise L3ConfigError(
                f"durability.plp_policy = 'require': {what}. Use a device with PLP / write-through cache, "
                "or set durability.plp_policy = 'warn'")
        if p.device not in _warned_devices:
            _warned_devices.add(p.device)
            logger.warning("L3: %s (durability.plp_policy = 'warn')", what)
    return probes


def _warn_shared_devices(disks: tuple[DiskConfig, ...]) -> None:
    """[[disks]] entries are meant to be separate devices; two on one device is allowed (tests, a box with
    one disk) but ranks mapped to them share its bandwidth, so say so once per pair (docs_internal/l3_store.md)."""
    for i, j, why in shared_device_pairs([d.path for d in disks]):
        key = (disks[i].path, disks[j].path)
        if key in _warned_shared:
            continue
        _warned_shared.add(key)
        logger.warning(
            "L3: disks[%d].path '%s' and disks[%d].path '%s' are on %s: ranks that rank_to_disk maps to them "
            "share that device's bandwidth, so the second entry adds no I/O capacity; list one [[disks]] entry "
            "per device (sharing one device is allowed, e.g. for tests)", i, disks[i].path, j, disks[j].path, why)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def parse_l3_config(doc: dict[str, Any], source: Optional[str] = None) -> L3Config:
    if not isinstance(doc, dict):
        raise L3ConfigError("config: top level must be a table")
    _check_keys(doc, "", "")
    namespace = _parse_namespace(doc)
    index = _parse_index(doc)
    gc = _parse_gc(doc)
    io = _parse_io(doc)
    dur = _table(doc, "durability", "", required=False)
    _check_keys(dur, "durability", "durability")
    policy = _string(dur, "plp_policy", "durability", "warn")
    if policy not in PLP_POLICIES:
        raise L3ConfigError(f"durability.plp_policy: {policy!r} is not one of {', '.join(PLP_POLICIES)}")
    backup_ack = _string(dur, "backup_ack", "durability", "durable")
    if backup_ack not in BACKUP_ACKS:
        raise L3ConfigError(f"durability.backup_ack: {backup_ack!r} is not one of {', '.join(BACKUP_ACKS)}")
    disks = _parse_disks(doc)
    r2d = _parse_rank_to_disk(doc, disks)
    slots = _parse_slot_bytes(doc)
    probes = _apply_plp_policy(policy, disks)
    _warn_shared_devices(disks)
    return L3Config(index=index, disks=disks, gc=gc, io=io, plp_policy=policy, rank_to_disk=r2d,
                    slot_bytes=slots, plp_probes=probes, source=source, namespace=namespace,
                    backup_ack=backup_ack)


def load_l3_config(path: str) -> L3Config:
    """Read and fully validate the TOML at `path`; raises L3ConfigError naming the field and fix."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise L3ConfigError(f"--cp-l3-config: file '{path}' does not exist; pass the path of an L3 TOML config") from None
    except IsADirectoryError:
        raise L3ConfigError(f"--cp-l3-config: '{path}' is a directory; pass the TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise L3ConfigError(f"--cp-l3-config: '{path}' is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise L3ConfigError(f"--cp-l3-config: '{path}' is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} "
                            f"at offset {e.start}); TOML files must be UTF-8: re-save it as UTF-8") from None
    except OSError as e:
        raise L3ConfigError(f"--cp-l3-config: cannot read '{path}' ({e.strerror}); check the path and "
                            "its permissions") from None
    return parse_l3_config(doc, source=path)
