"""The tiers of the peers benchmark (``bench_peers.py``): one function per tier, each a real
``launch_server`` flag list, the environment it needs, the side services it starts (a Mooncake master,
an LMCache server), the directories its KV lands in and a "how configured" line for the results.

Every tier gets the same model, GPU, device pool, disk budget (``disk_gb``, 10^9 bytes each; where a
peer counts its cap in GiB the harness converts, so no tier gets more bytes), host DRAM for KV
(``host_gb``: HiCache's host pool, or for LMCache, which replaces HiCache, its own L1) and prefetch
policy. Each peer runs with its own SGLang flags and the settings its documentation gives for one node:

- ``no-hicache``: upstream's radix cache only (device pool);
- ``hicache-l2``: HiCache with the host pool, no storage;
- ``file``: ``--hicache-storage-backend file``, its LRU evictor capped at ``disk_gb`` through the
  backend's extra config (``max_size``; the ``SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE`` variable would do
  the same);
- ``nixl``: the NIXL backend with its POSIX plugin and O_DIRECT (``SGLANG_HICACHE_NIXL_BACKEND_PLUGIN``,
  ``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR``, ``use_direct_io``); it has no byte cap: upstream's L3
  cleaner keeps the filesystem between its default watermarks (80 / 70 % full);
- ``mooncake``: Mooncake Store through a real ``mooncake_master --enable_offload=true`` (TCP, one node,
  P2P handshake), the embedded real client with SSD offload to a local directory, the bucket backend
  capped at ``disk_gb`` with LRU eviction, one object per bucket and a 1 s offload heartbeat (so every
  stored page reaches the disk, and soon: ``_mooncake_offload_env`` says why), io_uring with O_DIRECT
  reads; its DRAM segment lives in the SGLang process;
- ``mooncake-strict``: the embedded client with Mooncake's durable SSD backend instead
  (``offset_allocator_storage_backend`` in its ``strict`` persistence mode: every offload batch durable,
  a CRC-32C per record, its index recovered when the client starts again), FIFO eviction in our GC's band;
- ``mooncake-standalone``: the same store with its real client as a process of its own
  (``mooncake_client``, the segment and the SSD offload) and SGLang as its dummy client
  (``standalone_storage``): the segment outlives an SGLang restart (Mooncake's deployment guide, mode B);
- ``lmcache``: ``--enable-lmcache`` with a real ``lmcache server`` (multiprocess mode), L1 of
  ``host_gb`` and its native filesystem L2 adapter (``fs_native``, O_DIRECT) on a local directory, capped
  at ``disk_gb`` by an LRU ``eviction`` block (the plain ``fs`` adapter takes no cap: its
  ``max_capacity_gb`` is not read);
- ``lmcache-raw-block``: the same server with its ``raw_block`` L2 adapter instead: fixed slots with a
  header each in one preallocated file of ``disk_gb``, O_DIRECT, io_uring, its slot index checkpointed to
  the file (every 60 s and when the server stops) and verified against the slot headers when it starts;
- ``cp-l3-<engine>``: ours, ``--enable-cp-l3`` on HiCache, one tier per read engine the L3 config
  accepts (``sglang_cp.l3.config.READ_ENGINES``).

A peer whose package or program is missing still gets its row: ``error`` holds the exact import error
and ``needs`` what it would take.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Optional

GB = 10**9  # the disk budget's unit for every tier (ours counts capacity_gb in 10^9 bytes too)
GIB = 1 << 30  # LMCache's max_capacity_gb unit

# Disk-eviction band for the peers whose trigger is configurable: start at 90 % of the cap and free down
# to 85 %, as our L3's GC does by default (gc.high_watermark / gc.low_watermark).
EVICT_HIGH, EVICT_LOW = 0.90, 0.85
BAND = f"from {EVICT_HIGH:.0%} to {EVICT_LOW:.0%}".replace("%", " %")  # how a tier's "how" line says it


@dataclass
class Service:
    """A side process a tier needs, started before its server and stopped after it."""

    name: str
    argv: list
    port: int
    env: dict = field(default_factory=dict)


@dataclass
class Tier:
    name: str
    args: list  # launch_server flags beyond the model's and the harness's own
    how: str
    env: dict = field(default_factory=dict)  # added to the server's environment
    services: list = field(default_factory=list)
    storage_dirs: list = field(default_factory=list)  # where its KV lands (emptied before the tier runs)
    restart_args: Optional[list] = None  # flags of the restarted server, where they differ
    files: dict = field(default_factory=dict)  # config files to write before it starts: path -> text
    presized: dict = field(default_factory=dict)  # files it needs preallocated before it starts: path -> bytes
    error: Optional[str] = None  # why it cannot run on this host (exact text)
    needs: Optional[str] = None  # what it would take
    # Percent of its filesystem in use at which the tier deletes its own files (nixl's L3 cleaner), if any
    cleaner_high_pct: Optional[float] = None

    @property
    def storage(self) -> bool:
        return bool(self.storage_dirs)


@dataclass
class TierSettings:
    work_dir: str
    host_gb: int  # HiCache host pool (LMCache: its L1), GB
    disk_gb: float  # storage budget of every tier, GB
    free_port: Callable[[], int]  # the harness's free_port
    prefetch_policy: str = "wait_complete"
    write_policy: str = "write_through"
    mem_layout: str = "page_first"
    io_threads: int = 8
    # our L3's io.gil_switch_interval_ms (0: the interpreter's own 5 ms); the docs set 0.5 for fast drives
    gil_switch_interval_ms: float = 0.0
    mooncake_segment_gb: float = 4.0  # Mooncake's own DRAM segment (the SSD-offload guide's example)
    # KV bytes one token takes in an LMCache chunk: the KV row at the cache's dtype, plus a DSA model's indexer
    # row (LMCache keeps both in one object); 0: not known (raw_block's slot size needs it)
    kv_bytes_per_token: int = 0
    # upstream's prefetch_threshold for every HiCache storage tier alike (None: upstream's default, 256)
    prefetch_threshold: Optional[int] = None
    # bench_server_ttft.write_l3_toml (root, capacity_gb, threads, engine, switch_ms)
    l3_toml: Optional[Callable] = None

    def dir(self, tier: str) -> str:
        return os.path.join(os.path.abspath(self.work_dir), tier)


def probe_import(module: str) -> Optional[str]:
    """None when ``module`` imports here, else the exact error (type and message)."""
    try:
        importlib.import_module(module)
        return None
    except Exception as e:  # an ImportError, or whatever a half-installed package raises on import
        return f"{type(e).__name__}: {e}"


def _hicache(s: TierSettings) -> list:
    return ["--enable-hierarchical-cache", "--hicache-size", str(s.host_gb), "--hicache-mem-layout", s.mem_layout,
            "--hicache-write-policy", s.write_policy, "--hicache-storage-prefetch-policy", s.prefetch_policy]


EXTRA_FLAG = "--hicache-storage-backend-extra-config"


def _extra(cfg: dict) -> list:
    return [EXTRA_FLAG, json.dumps(cfg, separators=(",", ":"))]


def _threshold(s: TierSettings) -> dict:
    """Upstream's prefetch threshold as its storage config takes it, the same for every HiCache storage tier."""
    return {} if s.prefetch_threshold is None else {"prefetch_threshold": s.prefetch_threshold}


def _prefetch_how(s: TierSettings) -> str:
    return f"prefetch {s.prefetch_policy}" + ("" if s.prefetch_threshold is None
                                               else f", prefetch threshold {s.prefetch_threshold} tokens")


def tier_no_hicache(s: TierSettings) -> Tier:
    return Tier("no-hicache", [], "upstream radix cache on the device pool only: no host pool, no storage")


def tier_hicache_l2(s: TierSettings) -> Tier:
    return Tier("hicache-l2", _hicache(s), f"HiCache host pool {s.host_gb} GB ({s.mem_layout}, {s.write_policy}); "
                "no storage backend")


def tier_file(s: TierSettings) -> Tier:
    d = os.path.join(s.dir("file"), "kv")
    cap = int(s.disk_gb * GB)
    # eviction_ratio: where its evictor evicts down to once a write would pass the cap (default 0.9); our
    # band's low end. Its trigger is the cap itself (not settable): it fills to 100 % where the others
    # start evicting at 90 %.
    args = _hicache(s) + ["--hicache-storage-backend", "file"] + _extra({"file_storage_path": d, "max_size": cap,
                                                                         "eviction_ratio": EVICT_LOW,
                                                                         **_threshold(s)})
    return Tier("file", args, f"upstream HiCacheFile in {d}, LRU evictor capped at {cap} B (extra config max_size; "
                f"at the cap it evicts down to {EVICT_LOW:.0%}), host pool {s.host_gb} GB, {_prefetch_how(s)}; page "
                "files through the page cache, no fsync",
                storage_dirs=[d])


NIXL_CLEANER_HIGH_PCT = 80.0  # nixl_utils.get_l3_cleaner_config's default high watermark (pinned by a test)


def tier_nixl(s: TierSettings) -> Tier:
    d = os.path.join(s.dir("nixl"), "kv")
    # use_uring: upstream's README and nixl.config.toml.sample recommend it for the POSIX plugin ("io_uring
    # for async I/O, recommended if supported"); a flat key upstream passes to the plugin as it is
    args = (_hicache(s) + ["--hicache-storage-backend", "nixl"]
            + _extra({"use_direct_io": True, "use_uring": "true", **_threshold(s)}))
    env = {"SGLANG_HICACHE_NIXL_BACKEND_PLUGIN": "POSIX", "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR": d}
    t = Tier("nixl", args, f"upstream HiCacheNixl, POSIX plugin, O_DIRECT, io_uring, files in {d}; no byte cap: "
             f"upstream's L3 cleaner deletes its files once their filesystem is {NIXL_CLEANER_HIGH_PCT:g} % full, "
             f"down to 70 % (at run time set to the disk budget's 90 % -> 85 % band), host pool {s.host_gb} GB, "
             f"{_prefetch_how(s)}", env=env, storage_dirs=[d],
             cleaner_high_pct=NIXL_CLEANER_HIGH_PCT)
    t.error = probe_import("nixl._api")
    if t.error:
        t.needs = ("the nixl Python package with its POSIX plugin (pip install nixl, which pulls nixl-cu12 or "
                   "nixl-cu13 to match CUDA; on an offline GPU host carry the wheels)")
    return t


def _mooncake_master(s: TierSettings) -> Service:
    port = s.free_port()
    return Service("mooncake_master", ["mooncake_master", f"--rpc_port={port}", "--enable_offload=true"], port)


# Every Mooncake tier's offload pacing and reads: a 1 s heartbeat and io_uring (_mooncake_offload_env says why)
MOONCAKE_PACING = {"MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1", "MOONCAKE_OFFLOAD_USE_URING": "1"}


def _mooncake_offload_env(cap: int) -> dict:
    """Mooncake's SSD offload of its real client: the bucket backend capped at ``cap`` bytes, LRU eviction
    in our GC's band, a bucket per object, a 1 s offload heartbeat and io_uring.

    - One object per bucket: with the backend's default grouping (a bucket is written once it holds 500
      objects or 256 MiB) a client's last < 256 MiB of objects wait in memory without a disk copy, and a
      restart of the client loses them: 48 SGLang pages of 2.36 MB stored through the standalone client had
      no file on disk 25 s later, where one object per bucket had all 48 on disk (98 files) within one
      offload heartbeat (mooncake-transfer-engine 0.3.13.post1, ``docs_internal/peers.md``).
    - The heartbeat (default 10 s) paces the offload: with it, objects stored in a replay's last seconds
      had no disk copy when the harness stopped the server; Mooncake's own tests and benchmarks run 1 s.
    - ``MOONCAKE_OFFLOAD_USE_URING``: its io_uring file path, the one that reads with O_DIRECT (the POSIX
      path reads through the page cache), as our tier and nixl read.
    Every name is one the 0.3.13.post1 client reads (its ``store.so`` and ``mooncake_client`` carry them)."""
    return {"MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
            "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(cap), "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(cap),
            "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "lru", "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "1",
            "MOONCAKE_OFFLOAD_DISK_EVICTION_HIGH_WATERMARK_RATIO": f"{EVICT_HIGH:g}",
            "MOONCAKE_OFFLOAD_DISK_EVICTION_LOW_WATERMARK_RATIO": f"{EVICT_LOW:g}",
            **MOONCAKE_PACING}


MOONCAKE_OFFLOAD_HOW = f"bucket backend, {{cap}} B cap, LRU {BAND}, one object per bucket, 1 s heartbeat, io_uring"


def _mooncake_strict_env(cap: int) -> dict:
    """Mooncake's durable SSD backend (mooncake-transfer-engine 0.3.13.post1 carries kvcache-ai/Mooncake#2932):
    one preallocated data file of ``cap`` bytes (``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` is its size and
    its only cap), ``strict`` persistence (each offload batch durable before it counts; the other modes
    checkpoint every N s or not at all), a CRC-32C per record (its default), and at start the index rebuilt
    from the persisted metadata: on the dev VM all 600 pages came back byte-exact after a client restart
    (``docs_internal/peers.md``).
    Eviction FIFO (its only policy besides none; LRU is not implemented in this version) from 90 % of the
    file down to 85 %. Heartbeat and io_uring as the bucket tiers'."""
    return {"MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "offset_allocator_storage_backend",
            "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(cap), "MOONCAKE_OFFSET_PERSIST_MODE": "strict",
            "MOONCAKE_OFFSET_EVICTION_POLICY": "fifo", "MOONCAKE_OFFSET_HIGH_RATIO": f"{EVICT_HIGH:g}",
            "MOONCAKE_OFFSET_LOW_RATIO": f"{EVICT_LOW:g}",
            **MOONCAKE_PACING}


MOONCAKE_STRICT_HOW = ("offset-allocator backend in strict persistence (every offload batch durable, CRC-32C per "
                       f"record, index recovered at start), one {{cap}} B file, FIFO {BAND}, 1 s heartbeat, "
                       "io_uring")


def _mooncake_probe(t: Tier, programs: tuple) -> Tier:
    t.error = probe_import("mooncake.store")
    for program in programs:
        if not t.error and shutil.which(program) is None:
            t.error = f"{program}: not found on PATH"
    if t.error:
        t.needs = (f"pip install mooncake-transfer-engine (the wheel ships mooncake.store and the "
                   f"{' and '.join(programs)} program{'s' if len(programs) > 1 else ''}); its 0.3.13.post1 "
                   "build loads libcudart.so.12 (nvidia-cuda-runtime-cu12's lib directory on LD_LIBRARY_PATH on a "
                   "CUDA 13 host), the driver's libcuda.so.1, libibverbs.so.1 and libnuma.so.1 (Debian: "
                   "libibverbs1 ibverbs-providers libnuma1)")
    return t


def tier_mooncake(s: TierSettings, strict: bool = False) -> Tier:
    """The real client embedded in the SGLang process (its DRAM segment and SSD offload go and come with the
    server); ``strict``: the same with the durable offset-allocator backend (``mooncake-strict``)."""
    name = "mooncake-strict" if strict else "mooncake"
    d = os.path.join(s.dir(name), "ssd")
    cap = int(s.disk_gb * GB)
    master = _mooncake_master(s)
    cfg = {"master_server_address": f"127.0.0.1:{master.port}", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
           "device_name": "", "local_hostname": "127.0.0.1",
           "global_segment_size": f"{s.mooncake_segment_gb:g}gb", "enable_ssd_offload": True, "ssd_offload_path": d,
           **_threshold(s)}
    args = _hicache(s) + ["--hicache-storage-backend", "mooncake"] + _extra(cfg)
    how = (MOONCAKE_STRICT_HOW if strict else MOONCAKE_OFFLOAD_HOW).format(cap=cap)
    env = _mooncake_strict_env(cap) if strict else _mooncake_offload_env(cap)
    return _mooncake_probe(Tier(
        name, args, f"Mooncake Store: mooncake_master --enable_offload=true on 127.0.0.1:{master.port}, TCP, "
        f"embedded real client with a {s.mooncake_segment_gb:g} GB DRAM segment (on top of the host pool "
        f"{s.host_gb} GB) and SSD offload to {d} ({how}), {_prefetch_how(s)}",
        env={**env, "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"}, services=[master],
        storage_dirs=[d]), ("mooncake_master",))


def tier_mooncake_standalone(s: TierSettings) -> Tier:
    """Mooncake Store with its Real Client as a process of its own (``mooncake_client``, holding the DRAM
    segment and the SSD offload) and SGLang as its Dummy Client (``standalone_storage``: the host pool is
    shared with the client): the deployment in which the segment outlives an SGLang restart."""
    d = os.path.join(s.dir("mooncake-standalone"), "ssd")
    cap = int(s.disk_gb * GB)
    master, client_port = _mooncake_master(s), s.free_port()
    client = Service("mooncake_client", [
        "mooncake_client", f"--master_server_address=127.0.0.1:{master.port}", "--host=127.0.0.1",
        f"--port={client_port}", "--protocol=tcp", "--metadata_server=P2PHANDSHAKE",
        f"--global_segment_size={s.mooncake_segment_gb:g}GB", "--enable_offload=true"], client_port,
        env={"MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": d, **_mooncake_offload_env(cap)})
    cfg = {"standalone_storage": True, "client_server_address": f"127.0.0.1:{client_port}", **_threshold(s)}
    args = _hicache(s) + ["--hicache-storage-backend", "mooncake"] + _extra(cfg)
    return _mooncake_probe(Tier(
        "mooncake-standalone", args,
        f"Mooncake Store, standalone: mooncake_master --enable_offload=true on 127.0.0.1:{master.port}, a "
        f"mooncake_client process on 127.0.0.1:{client_port} (TCP) holding the {s.mooncake_segment_gb:g} GB "
        f"DRAM segment and SSD offload to {d} ({MOONCAKE_OFFLOAD_HOW.format(cap=cap)}), SGLang "
        f"as its dummy client (standalone_storage, host pool {s.host_gb} GB shared with the client), "
        f"{_prefetch_how(s)}; the client outlives SGLang's restart", env={"MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"},
        services=[master, client], storage_dirs=[d]), ("mooncake_master", "mooncake_client"))


LMCACHE_L1_EVICTION_RATIO = 0.05


def _lmcache_tier(s: TierSettings, name: str, adapter: dict, adapter_how: str, storage: str) -> Tier:
    """A real ``lmcache server`` (multiprocess mode) with ``adapter`` as its L2 and SGLang's LMCache
    connector; ``storage`` is where its L2 lands."""
    root = s.dir(name)
    port = s.free_port()
    quiet = {"LMCACHE_TRACK_USAGE": "false"}  # its usage reports go to a public host: none from a benchmark
    # --l1-size-gb is GiB to LMCache (size_in_bytes = gb << 30): the host pool's bytes, as HiCache sizes its
    # pool in 10^9 B. Its L1 evicts at its default 80 % trigger; --eviction-ratio 0.05 (default 0.2 of the
    # keys) keeps it near that, not cycling down to 64 %.
    l1_gib = s.host_gb * GB / GIB
    server = Service("lmcache server", ["lmcache", "server", "--host", "127.0.0.1", "--port", str(port),
                                        "--l1-size-gb", f"{l1_gib:.6f}", "--eviction-policy", "LRU",
                                        "--eviction-ratio", f"{LMCACHE_L1_EVICTION_RATIO:g}",
                                        "--l2-adapter", json.dumps(adapter, separators=(",", ":"))], port,
                     env=quiet)
    yaml = os.path.join(root, "lmcache.yaml")
    t = Tier(name, ["--enable-lmcache", "--lmcache-config-file", yaml],
             f"LMCache multiprocess server on 127.0.0.1:{port}: L1 {s.host_gb} GB DRAM ({l1_gib:.3f} GiB, LRU) in "
             f"place of HiCache's host pool (--enable-lmcache excludes --enable-hierarchical-cache; L1 evicts at "
             f"LMCache's default 80 % trigger, {LMCACHE_L1_EVICTION_RATIO:g} of its keys at a time), {adapter_how}; "
             f"its own prefetch (no --hicache-storage-prefetch-policy"
             + ("" if s.prefetch_threshold is None else " or prefetch threshold") + ")",
             env=quiet, services=[server], storage_dirs=[storage],
             files={yaml: f"mp_host: 127.0.0.1\nmp_port: {port}\n"})
    # Its CUDA kernels load only on a GPU server, so a build against another torch fails there, not at
    # import of the connector: probe them too, for the exact error.
    t.error = (probe_import("lmcache.integration.sglang.unified_lmcache_mp_connector")
               or probe_import("lmcache.cuda_ops"))
    if not t.error and shutil.which("lmcache") is None:
        t.error = "lmcache: not found on PATH"
    if t.error:
        t.needs = ("an LMCache whose CUDA kernels (lmcache.cuda_ops) are built against this torch: pip install "
                   "lmcache, or where its wheel was built against another torch (an undefined c10 symbol above), "
                   "build it from its source release with this torch and a matching nvcc (docs/benchmarks.md, "
                   "'Running it'); its 'lmcache server' program serves the KV")
    return t


def _lmcache_eviction() -> dict:
    """LMCache's L2 eviction block in our GC's band: from 90 % of the cap, 5 % of it at a time."""
    return {"eviction_policy": "LRU", "trigger_watermark": EVICT_HIGH, "eviction_ratio": round(EVICT_HIGH - EVICT_LOW, 6)}


def tier_lmcache(s: TierSettings) -> Tier:
    d = os.path.join(s.dir("lmcache"), "fs")
    # fs_native: the plain fs adapter reads no capacity (LMCache 0.5.6's FSL2AdapterConfig takes base_path,
    # relative_tmp_dir, read_ahead_size and use_odirect only), so it would get unbounded disk; the native
    # one counts max_capacity_gb (GiB) and evicts once the adapter carries an eviction block.
    cap_gib = s.disk_gb * GB / GIB
    adapter = {"type": "fs_native", "base_path": d, "num_workers": s.io_threads, "use_odirect": True,
               "max_capacity_gb": round(cap_gib, 6), "eviction": _lmcache_eviction()}
    return _lmcache_tier(s, "lmcache", adapter,
                         f"fs_native L2 adapter in {d} ({s.io_threads} workers, O_DIRECT) capped at {s.disk_gb:g} GB "
                         f"({cap_gib:.3f} GiB, LRU {BAND})", d)


LMCACHE_CHUNK_TOKENS = 256  # the LMCache server's chunk (its --chunk-size default): one L2 object each
RAW_BLOCK_ALIGN = 4096  # raw_block's block_align and header_bytes defaults
RAW_BLOCK_NEEDS = ("the lmcache_rust_raw_block_io package (LMCache's raw_block I/O crate; LMCache 0.5.6 neither "
                   "builds nor pins it: pip install --pre lmcache-rust-raw-block-io, whose Python API matches the "
                   "0.5.6 crate's source)")


def tier_lmcache_raw_block(s: TierSettings) -> Tier:
    """LMCache's ``raw_block`` L2 adapter: one preallocated file of fixed slots, a header per slot, O_DIRECT
    and io_uring, its slot index checkpointed into the file and checked against the slot headers at start.

    - A slot holds one of the server's 256-token chunks: the chunk's bytes (``kv_bytes_per_token``: KV at the
      cache's dtype plus a DSA model's indexer row) rounded up to the 4 KiB alignment, plus the 4 KiB header.
      A payload larger than its slot is refused, not split; a smaller one still takes a whole slot.
    - The index checkpoint at its default 60 s: the server writes a last one when it stops (SIGTERM, as the
      harness stops its services), so a shorter interval would only cost snapshots under the index's lock.
    - Load and store workers: our I/O threads each (defaults 4 and 2), the thread budget ours reads with.
    - The file is preallocated to the disk budget, as our slabs are (du counts it whole); its 256 MiB index
      area is inside it."""
    d = os.path.join(s.dir("lmcache-raw-block"), "rb")
    path = os.path.join(d, "kv.raw")
    cap = int(s.disk_gb * GB)
    chunk = LMCACHE_CHUNK_TOKENS * s.kv_bytes_per_token
    slot = -(-chunk // RAW_BLOCK_ALIGN) * RAW_BLOCK_ALIGN + RAW_BLOCK_ALIGN
    adapter = {"type": "raw_block", "device_path": path, "slot_bytes": slot, "capacity_bytes": cap,
               "use_odirect": True, "io_engine": "io_uring", "num_load_workers": s.io_threads, "num_store_workers": s.io_threads, "eviction": _lmcache_eviction()}
    t = _lmcache_tier(s, "lmcache-raw-block", adapter,
                      f"raw_block L2 adapter: {path} preallocated to {s.disk_gb:g} GB (du counts it whole), "
                      f"{slot} B slots (a {LMCACHE_CHUNK_TOKENS}-token chunk + its header), O_DIRECT, io_uring, "
                      f"{s.io_threads} load and {s.io_threads} store workers, slot index checkpointed every 60 s "
                      f"and at stop, verified at start, LRU {BAND}", d)
    t.presized = {path: cap}
    if not t.error:
        t.error = probe_import("lmcache_rust_raw_block_io")
        t.needs = RAW_BLOCK_NEEDS if t.error else None
    if not s.kv_bytes_per_token and not t.error:
        t.error = "raw_block slots are sized from the model's KV bytes per token, which these settings lack"
        t.needs = "TierSettings.kv_bytes_per_token (bench_peers sets it from the model)"
    return t


def read_engines() -> tuple:
    from sglang_cp.l3.config import READ_ENGINES

    return READ_ENGINES


def tier_ours(s: TierSettings, engine: str) -> Tier:
    root = s.dir(f"cp-l3-{engine}")
    cfg = os.path.join(root, "l3.toml")
    threshold = _threshold(s)  # upstream's key, passed through --enable-cp-l3 into the config it declares
    args = _hicache(s) + ["--enable-cp-l3", "--cp-l3-config", cfg] + (_extra(threshold) if threshold else [])
    t = Tier(f"cp-l3-{engine}", args + ["--cp-l3-cold-start", "clear"],
             f"sglang-cp L3 (--enable-cp-l3), io.read_engine = {engine!r}, {s.io_threads} I/O threads, "
             + (f"io.gil_switch_interval_ms = {s.gil_switch_interval_ms:g}, " if s.gil_switch_interval_ms else "")
             + "slabs "
             f"preallocated to {s.disk_gb:g} GB in {root}/data (du counts them whole), backup_ack durable (data, "
             f"fdatasync, index commit before the ack), host pool {s.host_gb} GB, {_prefetch_how(s)}; "
             "cold start clear, restart load",
             storage_dirs=[os.path.join(root, "data"), os.path.join(root, "index")],
             restart_args=args + ["--cp-l3-cold-start", "load"])
    if engine == "native":
        from sglang_cp.l3 import native

        if native.library_path() is None:
            t.error = "io.read_engine = 'native': the sglang-cp native library is not built on this host"
            t.needs = "pip install sglang-cp from source (or python setup.py build_ext --inplace) on this host"
    return t


def all_tiers(s: TierSettings) -> list:
    return ([tier_no_hicache(s), tier_hicache_l2(s), tier_file(s), tier_nixl(s), tier_mooncake(s),
             tier_mooncake(s, strict=True), tier_mooncake_standalone(s), tier_lmcache(s), tier_lmcache_raw_block(s)]
            + [tier_ours(s, e) for e in read_engines()])


def fs_use(path: str) -> Optional[dict]:
    """The filesystem holding ``path``: total bytes, bytes an unprivileged writer may still use, and the
    percent in use as nixl's L3 cleaner computes it ((total - available) / total); None if unreadable."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    total, avail = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return {"total": total, "available": avail, "used_pct": 100.0 * (total - avail) / total if total else 0.0}


def cleaner_band(tier: Tier, fs: Optional[dict], budget_bytes: float) -> tuple:
    """(extra-config keys, warning) for a tier whose cleaner deletes its own files once their *filesystem*
    is a percent full (nixl's L3 cleaner; (None, None) for any other tier): the disk budget's eviction band
    (``EVICT_HIGH`` -> ``EVICT_LOW`` of ``budget_bytes``, as our GC and the other peers evict) in the
    filesystem's terms at the tier's start. Left at its defaults (80 -> 70 %), a disk other files already
    keep near 80 % full would have it delete every file it writes each tick: a handicap, not the tier.
    The warning says when the budget does not fit the filesystem (the band is then capped below 100 %)."""
    if tier.cleaner_high_pct is None or fs is None or not fs["total"]:
        return None, None
    share = 100.0 * budget_bytes / fs["total"]
    high, low = fs["used_pct"] + EVICT_HIGH * share, fs["used_pct"] + EVICT_LOW * share
    warning = None
    if high >= 99.0:
        warning = (f"{tier.name}: its filesystem is {fs['used_pct']:.0f} % used and the {budget_bytes / 1e9:g} GB "
                   f"budget does not fit it (the cleaner's band would end at {high:.0f} %): it will delete its own "
                   "files early (a handicap, not a property of the tier): free that disk or use another --work-dir")
        high, low = 99.0, min(low, 98.0)
    return {"l3_cleaner_high_watermark": round(high, 2), "l3_cleaner_low_watermark": round(low, 2)}, warning


def with_extra_config(tier: Tier, keys: dict) -> None:
    """Merge ``keys`` into the tier's ``--hicache-storage-backend-extra-config`` (replay and restart)."""
    for args in (tier.args, tier.restart_args):
        if args and EXTRA_FLAG in args:
            i = args.index(EXTRA_FLAG) + 1
            args[i] = json.dumps({**json.loads(args[i]), **keys}, separators=(",", ":"))


def du_bytes(paths: list) -> dict:
    """Allocated (st_blocks) and apparent bytes of every file under ``paths``."""
    alloc = apparent = files = 0
    for root in paths:
        for dirpath, _dirs, names in os.walk(root):
            for n in names:
                try:
                    st = os.lstat(os.path.join(dirpath, n))
                except OSError:
                    continue
                alloc += st.st_blocks * 512
                apparent += st.st_size
                files += 1
    return {"allocated": alloc, "apparent": apparent, "files": files}


def free_storage(tier: Tier) -> int:
    """Remove what the tier stored, once it has run, so the next tier finds the disk as this one did;
    returns the bytes freed."""
    freed = du_bytes(tier.storage_dirs)["allocated"]
    for d in tier.storage_dirs:
        shutil.rmtree(d, ignore_errors=True)
    return freed


def preallocate(path: str, size: int) -> None:
    """A new private file of ``size`` allocated bytes (not a sparse one: a peer that reads and writes it
    with O_DIRECT finds its blocks in place, as our slabs are preallocated)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def prepare(tier: Tier, s: TierSettings) -> None:
    """Empty the tier's storage, write its config files and preallocate the files it needs (0700
    directories, 0600 files)."""
    for d in tier.storage_dirs:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d, mode=0o700)
    for path, text in tier.files.items():
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
    for path, size in tier.presized.items():
        preallocate(path, size)
    if tier.name.startswith("cp-l3-"):
        engine = tier.name[len("cp-l3-"):]
        s.l3_toml(s.dir(tier.name), s.disk_gb, s.io_threads, engine, s.gil_switch_interval_ms)
