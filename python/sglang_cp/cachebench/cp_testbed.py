"""CP testbed: real gloo rank processes, each with a real upstream HiCache controller.

Used by ``sglang-cp cachebench``, the integration tests and ``bench_cp_l3.py``: the
product may not import from ``test/``, so the reusable rank setup lives here, next to
cachebench. A harness, not a hook: it drives upstream, it does not patch it.

Upstream symbols it builds and drives (sglang 0.5.23, paths under ``sglang/srt/``):
``server_args.prepare_server_args`` + ``ServerArgs.resolve_once`` (our flags select the
backend), ``runtime_context.publish`` / ``get_parallel().override_permanently``,
``mem_cache.memory_pool.MLATokenToKVPool``, ``mem_cache.allocator.paged.PagedTokenToKVPoolAllocator``,
``mem_cache.pool_host.mla.MLATokenToKVPoolHost``,
``mem_cache.pool_host.page_interleave.PageInterleaveHostPool`` (``PageInterleavePlacement``),
``mem_cache.pool_host.group.HostPoolGroup``,
``mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController``
(``write_storage``, ``prefetch``, ``allocate_storage_hit``, its ack queues) and
``mem_cache.utils.get_storage_hash_str``.

Every rank process:
- joins a gloo world (all ranks = one attention-CP group, as a CP prefill server),
- publishes real ``ServerArgs`` parsed through SGLang's parser with our plugin loaded
  (``--enable-cp-l3`` selects our backend exactly as on a server),
- builds upstream's device pool (``MLATokenToKVPool`` on CPU), upstream's host pool
  (``MLATokenToKVPoolHost``, GLM-5 MLA row shape), optionally striped by upstream's
  ``PageInterleaveHostPool`` (``--enable-kv-cache-sharding``), and upstream's
  ``HybridCacheController`` with the storage backend attached through upstream's
  ``StorageBackendFactory``,
- then drives the controller's own storage paths: ``write_storage`` -> backup thread,
  ``prefetch`` -> prefetch thread (hit query + the gloo MIN) -> ``allocate_storage_hit``
  -> transfer thread -> completion MINs.

Why not ``build_kv_only_stack``: it builds the host pool with ``pin_memory=True``, which
calls ``cudaHostRegister`` and cannot run without a GPU. We construct the same objects
with ``pin_memory=False`` (docs_internal/cp_l3_integration.md). The scheduler-thread
steps of ``UnifiedRadixCache`` (draining the hit queue, allocating the bounce, queueing
the transfer) are replayed here with the controller's own methods, in the same order.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
import time
import traceback
import types
import warnings

from sglang_cp.l3.recovery import DEFAULT_COLD_START

# Upstream's quantization modules warn at import on a host without CUDA ("Only CUDA, HIP and XPU support
# AWQ currently"): true, and irrelevant to ranks that run no quantized layer. The fork server imports
# this module first, so the notices do not reach cachebench's console.
warnings.filterwarnings("ignore", message=r"Only CUDA.* support", category=UserWarning)

GLM5_KV_LORA, GLM5_ROPE = 512, 64
PAGE = 64


def page_bytes_pattern(page_i: int, nbytes: int, salt: int = 0):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * (page_i + 1) + salt)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class Rank:
    def __init__(self, rank, world, rendezvous, l3_config, *, sharded, layers=4, host_pages=64,
                 cold_start=DEFAULT_COLD_START, extra_args=(), layout="page_first", model_name=None,
                 sidecars=False, backend="cp_l3", file_dir=None):
        import torch
        import torch.distributed as dist

        # A GPU server's scheduler process (which runs the HiCache controller and our backend) uses one
        # torch intra-op thread: upstream's ModelRunner.load_model calls torch.set_num_threads(1) off
        # CPU. Without it each rank's host-pool ops spun up one OpenMP thread per core, N ranks at once:
        # on a 16-core host at CP=8 the sharded prefetch allocation took 51 ms instead of under 1 ms.
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        self.rank, self.world, self.sharded = rank, world, sharded
        self.torch, self.dist = torch, dist

        from sglang.srt.plugins import load_plugins

        load_plugins()
        from sglang.srt.server_args import prepare_server_args

        argv = ["--model-path", "dummy", "--device", "cpu", "--page-size", str(PAGE),
                "--enable-hierarchical-cache", "--hicache-mem-layout", layout, *extra_args]
        if backend == "cp_l3":
            argv += ["--enable-cp-l3", "--cp-l3-config", l3_config, "--cp-l3-cold-start", cold_start]
        else:  # upstream's own backend, for side-by-side benchmarks
            argv += ["--hicache-storage-backend", backend,
                     "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": file_dir})]
        sa = prepare_server_args(argv)
        sa.resolve_once()
        from sglang.srt.arg_groups.overrides import resolved_view
        from sglang.srt.runtime_context import get_parallel, publish

        publish(sa, role="scheduler")
        # The parallel context a CP prefill scheduler has: TP = attention-CP = world.
        get_parallel().override_permanently(
            tp_size=world, attn_cp_size=world, attn_tp_size=1, moe_tp_size=world,
            tp_rank=rank, attn_cp_rank=rank, attn_tp_rank=0, pp_rank=0,
            attn_dp_rank=0, attn_dcp_rank=0, moe_ep_rank=0, moe_tp_rank=rank, moe_dp_rank=0)
        cfg = resolved_view(sa)
        extra = json.loads(cfg.hicache_storage_backend_extra_config)
        self.backend_name = cfg.hicache_storage_backend

        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        dev_tokens = host_pages * PAGE
        kv = MLATokenToKVPool(size=dev_tokens, page_size=PAGE, dtype=torch.bfloat16,
                              kv_lora_rank=GLM5_KV_LORA, qk_rope_head_dim=GLM5_ROPE, layer_num=layers,
                              device="cpu", enable_memory_saver=False)
        alloc = PagedTokenToKVPoolAllocator(size=dev_tokens, page_size=PAGE, dtype=torch.int64,
                                            device="cpu", kvcache=kv, need_sort=False)
        host = MLATokenToKVPoolHost(
            kv.get_device_pool_infos()[0].buffer_info, 1.0, 0, PAGE, layout, pin_memory=False,
            device="cpu", override_kv_cache_dim=kv.kv_cache_dim, device_capacity_tokens=dev_tokens,
            start_layer=kv.start_layer, end_layer=kv.end_layer, target_layer_num=layers,
            host_token_capacity=host_pages * PAGE)
        self.native_host = host
        if sharded:
            from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
            from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

            spec = PageShardSpec(shard_rank=rank, shard_size=world, page_size=PAGE,
                                 max_prefix_tokens=world * PAGE, chunk_tokens=PAGE)
            self.placement = PageInterleavePlacement(spec)
            host = PageInterleaveHostPool(host, self.placement)
        from sglang.srt.mem_cache.hicache_storage import PoolName

        self.PoolName = PoolName
        entries = [build_pool_entry(
            name=PoolName.KV, host_pool=host, device_pool=kv, layer_mapping={i: i for i in range(layers)},
            transfer_layer_id_max=layers, is_anchor=True)]
        # Sidecars in GLM-5 shapes: the DSA indexer-K cache (132 B/token/layer: FP8 K plus
        # its scale) and one MTP draft layer of FP8 MLA KV (656 B/token). They share the
        # anchor's (logical) page indices, as upstream's KV-derived sidecars do.
        self.sidecar_hosts = {}
        if sidecars:
            for name, width, n_layers in ((PoolName.INDEXER, 132, layers), (PoolName.DRAFT, 656, 1)):
                dev = MLATokenToKVPool(size=dev_tokens, page_size=PAGE, dtype=torch.uint8,
                                       kv_lora_rank=width - 4, qk_rope_head_dim=4, layer_num=n_layers,
                                       device="cpu", enable_memory_saver=False)
                side = MLATokenToKVPoolHost(
                    dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, PAGE, layout, pin_memory=False,
                    device="cpu", override_kv_cache_dim=width, device_capacity_tokens=dev_tokens,
                    start_layer=0, end_layer=n_layers - 1, target_layer_num=n_layers,
                    host_token_capacity=host_pages * PAGE, pool_label=name.value)
                self.sidecar_hosts[name] = side
                entries.append(build_pool_entry(
                    name=name, host_pool=side, device_pool=dev, layer_mapping={i: i for i in range(n_layers)},
                    transfer_layer_id_max=layers))
        self.group = HostPoolGroup(entries)
        world_group = dist.group.WORLD
        self.cc = HybridCacheController(
            alloc, self.group, PAGE, world_group, load_cache_event=threading.Event(),
            attn_cp_group=world_group, write_policy="write_through", io_backend="direct",
            storage_backend=self.backend_name, storage_backend_extra_config=extra,
            transfer_layer_id_max=layers, model_name=model_name)
        if sidecars and backend == "cp_l3":
            # Upstream's hybrid controller registers group entries with the backend at
            # attach (register_mem_host_pool_v2); our store opens once all are known.
            assert set(self.cc.storage_backend.payloads) == {"kv", "indexer", "draft"}
        self.backend = self.cc.storage_backend
        self.page_nbytes = host.get_data_page(0, flat=True).numel() * 2

    # ---------------------------------------------------------------- helpers
    def owner_of_page_start(self, start):
        if not self.sharded:
            return self.rank
        t = self.torch.tensor([start])
        return int(self.placement.owner_of(t)[0])

    def local_row(self, start):
        if not self.sharded:
            return start
        return int(self.placement.local_index(self.torch.tensor([start]))[0])

    def alloc_host(self, n_tokens, start_owner=None):
        if self.sharded:
            return self.group.alloc(n_tokens, start_owner=start_owner)
        return self.group.alloc(n_tokens)

    def _pools(self):
        yield 0, self.native_host
        for k, (_name, pool) in enumerate(sorted(self.sidecar_hosts.items(), key=lambda kv: kv[0].value)):
            yield k + 1, pool

    @staticmethod
    def _page_view(pool, row):
        """The page's bytes in upstream's flat order (a copy where the page is not contiguous: read only)."""
        view = pool.get_data_page(row, flat=True)
        return view.view(-1).view(__import__("torch").uint8)

    @staticmethod
    def _write_page(pool, row, pattern):
        """Write ``pattern(nbytes)`` (uint8, upstream's flat order) into the page at ``row``: in place where
        the page is contiguous in the pool, else through upstream's ``set_from_flat_data_page`` (layer_first,
        where the flat page is a copy and writing into it would change nothing)."""
        page = pool.get_data_page(row, flat=False)
        data = pattern(page.numel() * page.element_size())
        if page.is_contiguous():
            page.view(-1).view(__import__("torch").uint8).copy_(data)
        else:
            pool.set_from_flat_data_page(row, data.view(page.dtype))

    def fill(self, host_indices, n_pages, salt=0):
        """Write each logical page's pattern into this rank's rows (its stripe under sharding),
        for the target KV and every sidecar pool."""
        for i in range(n_pages):
            start = int(host_indices[i * PAGE])
            if self.owner_of_page_start(start) != self.rank:
                continue
            for k, pool in self._pools():
                row = self.local_row(start)
                self._write_page(pool, row, lambda n: page_bytes_pattern(i, n, salt + 97 * k))

    def check(self, host_indices, n_pages, salt=0):
        """(pages checked on this rank, pages equal in every payload) for this rank's stripe."""
        checked = equal = 0
        for i in range(n_pages):
            start = int(host_indices[i * PAGE])
            if self.owner_of_page_start(start) != self.rank:
                continue
            checked += 1
            ok = True
            for k, pool in self._pools():
                view = self._page_view(pool, self.local_row(start))
                ok &= self.torch.equal(view, page_bytes_pattern(i, view.numel(), salt + 97 * k))
            equal += int(ok)
        return checked, equal

    def zero_host(self):
        for _k, pool in self._pools():
            pool.kv_buffer.zero_()

    def sidecar_transfers(self):
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        return [PoolTransfer(name=name, indices_from_pool=self.PoolName.KV) for name in sorted(
            self.sidecar_hosts, key=lambda n: n.value)] or None

    def backup(self, tokens, host_indices, timeout=60, prior_hash=None, hashes=None):
        """Upstream's write_storage until the controller acks; returns completed tokens.
        ``prior_hash``: the storage hash of the page before ``tokens`` (a suffix backup)."""
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        if hashes is None:  # as the radix tree hashes nodes
            hashes = get_storage_hash_str(tokens, prior_hash, page_size=PAGE)
        op_id = self.cc.write_storage(host_indices, tokens, hash_value=hashes,
                                      extra_pools=self.sidecar_transfers())
        op = self.cc.ack_backup_queue.get(timeout=timeout)
        assert op.id == op_id
        return op.completed_tokens

    def prefetch(self, tokens, rid="r0", timeout=60, last_hash=None):
        """Upstream's prefetch end to end; returns (agreed hit tokens, completed tokens, host indices).
        ``last_hash``: storage hash of the page before ``tokens`` (prefix already in the host pool)."""
        handle = types.SimpleNamespace(rid=rid)
        op = self.cc.prefetch(handle, tokens, last_hash, extra_pools=self.sidecar_transfers())
        got = self.cc.prefetch_hit_queue.get(timeout=timeout)
        assert got is op
        hit = op.storage_hit_count
        if hit <= 0:
            return 0, 0, None
        host_indices, alloc_len = self.cc.allocate_storage_hit(
            op, hit, allow_partial=False, min_tokens=PAGE, evict_host=lambda n: 0)
        if host_indices is None:
            return hit, 0, None
        op.storage_hit_count = alloc_len
        op.hash_value = op.hash_value[: alloc_len // PAGE]
        op.host_indices = host_indices
        self.cc.prefetch_buffer.put(op)
        completed = 0
        deadline = time.monotonic() + timeout
        while True:
            ack = self.cc.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if ack.completed_req:
                break
        return hit, completed, host_indices

    def close(self):
        try:
            self.cc.detach_storage_backend()
        finally:
            self.dist.destroy_process_group()


_events = None  # the parent's queue, inside a rank process started by run_ranks
_rank_of_process = None


def emit(event) -> None:
    """From inside a rank process: hand ``event`` (picklable) to run_ranks' ``on_event``
    in the parent, e.g. progress ticks. A no-op outside run_ranks."""
    if _events is not None:
        _events.put(("event", _rank_of_process, event))


_POLL_S = 0.5          # how often run_ranks looks for a rank process that died
_RESULT_GRACE_S = 2.0  # how long a dead rank's result may still be in flight in the queue


class RankDied(RuntimeError):
    """A rank process exited without handing back a result; the others were stopped."""


# start="forkserver": the modules every rank imports (torch, upstream's server args and HiCache stack:
# 10-15 s of CPU per interpreter) are imported once, in the fork server, and each rank is a fork of it:
# still a new process per rank and per restart, with its own gloo group, plugin load and store, but
# without paying the imports again. load_plugins() stays in the rank (Rank.__init__), after the fork.
FORKSERVER_PRELOAD = ["sglang_cp.cachebench.cp_testbed", "torch", "torch.distributed", "sglang.srt.server_args",
                      "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
                      "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.pool_host.mla",
                      "sglang.srt.mem_cache.pool_host.page_interleave"]
_forkserver = None
# How cachebench starts its ranks: a restart is still "all ranks exit; new processes", without paying
# the imports again (cachebench --quick: the ranks' imports were most of its wall time on 2 cores).
RANK_START = "forkserver"


def _cuda_visible() -> bool:
    """A CUDA device is visible here (torch's own check: it does not initialize CUDA in this process)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _context(start: str):
    global _forkserver
    import multiprocessing as mp

    if start not in ("spawn", "forkserver"):
        raise ValueError(f"run_ranks: start must be 'spawn' or 'forkserver', got {start!r}")
    # On a host with a visible GPU the fork server's imports initialize CUDA (upstream's modules query the
    # device's capability at import), and a fork of a process that has initialized CUDA cannot use it
    # ("Cannot re-initialize CUDA in forked subprocess", on an H200 host): there every rank is spawned.
    if start == "spawn" or _cuda_visible():
        return mp.get_context("spawn")
    if _forkserver is None:
        _forkserver = mp.get_context("forkserver")
        _forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)
    return _forkserver


def run_ranks(world, target, args=(), timeout=240, on_event=None, start="spawn"):
    """Start ``world`` rank processes running ``target(rank, world, rendezvous, *args) -> dict``.
    ``on_event(rank, event)`` runs in the parent for every ``emit`` of a rank. ``start``: "spawn" (a
    fresh interpreter per rank) or "forkserver" (forks of one interpreter that imported the ranks'
    modules once; the environment of this call is applied in each rank; "spawn" where a GPU is visible)."""
    # The ranks meet through a file store in a private directory of this call, not a TCP port: a port
    # picked by bind + close can be taken by another process before rank 0 binds it (EADDRINUSE).
    with tempfile.TemporaryDirectory(prefix="cp-ranks-", ignore_cleanup_errors=True) as rdv_dir:
        return _run(world, target, args, timeout, on_event, f"file://{rdv_dir}/store", _context(start))


def _run(world, target, args, timeout, on_event, rendezvous, ctx):
    q = ctx.Queue()
    env = dict(os.environ)  # a fork server's children would otherwise see the server's, from its start
    procs = [ctx.Process(target=_entry, args=(target, r, world, rendezvous, args, q, env)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    dead_since = None  # when a rank process was first seen gone without its result
    try:
        while len(results) < world:
            try:
                # Short waits: between them, look for a rank process that died without a result (SIGKILL,
                # OOM, a crash in native code). Its peers are blocked in a collective it will never enter.
                msg = q.get(timeout=max(0.01, min(_POLL_S, deadline - time.monotonic())))
            except queue.Empty:
                gone = {r: p.exitcode for r, p in enumerate(procs) if r not in results and p.exitcode is not None}
                if gone:
                    # A result put just before exit may still be in the pipe: give it one more poll.
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since >= _RESULT_GRACE_S:
                        raise RankDied("; ".join(f"rank {r} exited with code {c} without a result"
                                                 for r, c in sorted(gone.items()))
                                       + f"; ranks {sorted(set(range(world)) - set(results) - set(gone))} were "
                                       "stopped (their collectives could never complete)") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} did not finish "
                                       f"within {timeout}s (hang)") from None
                continue
            if len(msg) == 3 and msg[0] == "event":
                if on_event is not None:
                    on_event(msg[1], msg[2])
                continue
            rank, res = msg
            results[rank] = res
            if "error" in res:
                # The other ranks are now blocked in a collective this one will never enter:
                # report the failure now instead of after the timeout.
                break
    finally:
        if len(results) < world:  # a failure or a hang: nobody is coming back
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    if errors:
        raise AssertionError("rank failures:\n" + "\n".join(f"rank {r}:\n{e}" for r, e in errors.items()))
    return [results[r] for r in range(world)]


def _entry(target, rank, world, rendezvous, args, q, env=None):
    global _events, _rank_of_process
    _events, _rank_of_process = q, rank
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    try:
        res = target(rank, world, rendezvous, *args)
    except BaseException:
        res = {"error": traceback.format_exc()}
    q.put((rank, res))
