"""Hook point: HiCache host-pool memory (``sglang.srt.mem_cache.pool_host``).

Upstream symbols hooked, and why each:

- ``pool_host.common.get_allocator_from_storage`` (AROUND): the one function every
  host pool (MLA target/draft KV, DSA indexer, ...) calls to get its
  ``HostTensorAllocator``; with ``--enable-cp-shared-physical-l2-hicache`` it returns
  ours, whose ``allocate`` makes hugetlbfs slabs (``sglang_cp.l2``) and never falls
  back to anonymous memory (upstream's ``alloc_mmap`` logs and falls back).
- ``pool_host.base.HostKVCache._allocate_host_buffer`` and
  ``pool_host.dsa.DSAIndexerPoolHost.init_kv_buffer`` (AROUND): the allocator only sees
  ``dims``; these are the last places that know the pool's layout and page size, so
  they hand the pool's own allocator (ours, one per pool) the page unit for the
  duration of the call (slab boundaries must not cut a page) and, afterwards, the
  splitter its transfers use (``CpHugepageHostTensorAllocator.geometry`` / ``.slab_splitter``:
  our object holds our state; nothing is hung on upstream's pool).
- ``pool_host.base.HostKVCache._allocate_host_buffer`` and
  ``pool_host.dsa.DSAIndexerPoolHost.__init__`` also open the scope in which
  ``pool_host.base.host_memory_budget_bytes`` (AROUND) skips upstream's psutil RAM
  check: hugepages are carved out of RAM, so ``available`` already excludes them and
  the check refuses pools that fit; the hugetlbfs preflight replaces it. That scope is a
  ``ContextVar`` set and reset in the one frame that calls upstream: the budget function
  takes only a byte count and also serves upstream's host-pool auto-sizing and other
  pools, whose checks must stay real, so nothing but the calling frame can say "this
  check is for a hugetlbfs pool". It is never read after that call returns.
- ``pool_host.common._cuda_host_register`` / ``_cuda_host_unregister`` (AROUND):
  upstream registers layer_first pools in one call (page-first in chunks); for our
  buffers each slab is exactly one registration.
- ``HostKVCache.load_to_device_per_layer_physical`` /
  ``backup_from_device_all_layer_physical`` (AROUND): for memcpy-based io backends
  (``direct``), index groups are split so no copy straddles two slabs. The ``kernel``
  backend is a gather kernel addressing host memory through UVA per page unit; it
  never issues a copy over a slab boundary (verified on the H200 by
  test/gpu/test_l2_hugepage.py), so it is left alone and pays no host sync.

Every hook checks ``--enable-cp-shared-physical-l2-hicache`` at call time and falls
through to upstream when it is off. Seed items served: "hugetlbfs-backed L2 slab with a
statvfs capacity preflight", "skip the psutil RAM check for hugepage-backed pools",
"split host cache into page-aligned slabs <= SGLANG_CP_HICACHE_MAX_SLAB_GB, one
cudaHostRegister each, no transfer straddles a slab".
"""

from __future__ import annotations

import logging
import threading
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from sglang_cp import args as cp_args
from sglang_cp.integration.hookspec import HookSpec

logger = logging.getLogger(__name__)

_PH = "sglang.srt.mem_cache.pool_host"
REGISTERED_RANGES_ATTR = "_sglang_cuda_host_registered_ranges"  # upstream's name (common.py)
# Storage backends that bring their own host allocator (upstream common.py).
_FOREIGN_ALLOCATORS = ("mooncake", "mori", "shm", "tensorcast")


@dataclass(frozen=True)
class PoolGeometry:
    label: str
    layout: str
    unit_bytes: int  # bytes of one page unit: a slab boundary must not cut one


_SKIP_RAM_CHECK: ContextVar[bool] = ContextVar("sglang_cp_l2_skip_ram", default=False)
_cores: dict = {}
_cores_lock = threading.Lock()


def active_flags():
    """Our flags when the hugepage L2 is on in this process, else None."""
    try:
        from sglang.srt.runtime_context import get_server_args

        server_args = get_server_args()
    except Exception:
        return None
    flags = cp_args.flags_of(server_args)
    if not flags.enable_cp_shared_physical_l2_hicache:
        return None
    return flags, server_args


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return 0


def core_allocator(flags, server_args):
    """One engine-independent allocator per process and configuration."""
    from sglang_cp.l2.allocator import HugepageHostAllocator, HugepageL2Config

    config = HugepageL2Config(
        hugetlbfs_dir=flags.cp_shared_l2_hugetlbfs_dir,
        max_slab_gb=flags.cp_hicache_max_slab_gb,
        namespace=f"p{getattr(server_args, 'port', 0)}",
        rank=_rank(),
    )
    with _cores_lock:
        if config not in _cores:
            _cores[config] = HugepageHostAllocator(config)
        return _cores[config]


@lru_cache(maxsize=1)
def _allocator_class():
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator

    class CpHugepageHostTensorAllocator(HostTensorAllocator):
        """Upstream's allocator interface over sglang_cp.l2's hugetlbfs slabs; one per host pool
        (upstream asks ``get_allocator_from_storage`` once per pool). Besides the shared slab
        allocator (``core``) it holds what the pool's hooks know and the allocator does not:

        - ``geometry``: the pool's page unit and layout, set by the pool's allocation hook
          for the duration of that one call (None otherwise: a request then is refused);
        - ``slab_splitter``: how the pool's memcpy transfers are cut at slab boundaries, set
          once its buffer exists (None: nothing to split)."""

        def __init__(self, core):
            super().__init__()
            self.core = core
            self.geometry: Optional[PoolGeometry] = None
            self.slab_splitter = None

        def allocate(self, dims, dtype, device):
            if device != "cpu":
                raise ValueError(f"HiCache host pools live in host memory; got device={device!r}")
            geometry = self.geometry
            if geometry is None:
                from sglang_cp.l2.errors import SlabPlanError

                raise SlabPlanError(
                    f"a host buffer {tuple(dims)} {dtype} was requested outside a known pool "
                    f"(supported with --enable-cp-shared-physical-l2-hicache: MLA KV incl. "
                    f"packed draft layers, DSA indexer; layouts layer_first, page_first, "
                    f"page_first_direct); drop the flag for this model"
                )
            self.dtype, self.dims = dtype, dims
            return self.core.allocate(
                tuple(dims), dtype, label=geometry.label, layout=geometry.layout, unit_bytes=geometry.unit_bytes
            )

    return CpHugepageHostTensorAllocator


def is_ours(allocator) -> bool:
    return type(allocator).__name__ == "CpHugepageHostTensorAllocator" and hasattr(allocator, "core")


# ---------------------------------------------------------------- allocator choice
def get_allocator_around(original, allocator_type, *args, **kwargs):
    active = active_flags()
    if active is None:
        return original(allocator_type, *args, **kwargs)
    if allocator_type in _FOREIGN_ALLOCATORS:
        from sglang_cp.l2.errors import HugepageL2Error

        raise HugepageL2Error(
            f"--enable-cp-shared-physical-l2-hicache allocates the HiCache host pools from "
            f"hugetlbfs, but the storage backend wants its own {allocator_type!r} host "
            f"allocator; drop one of the two"
        )
    return _allocator_class()(core_allocator(*active))


# ---------------------------------------------------------------- pool geometry
_LAYER_FIRST = "layer_first"
_PAGE_MAJOR_TOKEN_ROWS = ("page_first",)  # axis 0 indexed by token
_PAGE_MAJOR_PAGE_ROWS = ("page_first_direct",)  # axis 0 indexed by page


def mla_geometry(pool) -> Optional[tuple[PoolGeometry, object]]:
    """(geometry, token-axis factory) of an MLA host pool, None if unsupported."""
    from sglang_cp.l2.transfer_split import TokenAxis

    row = pool.kv_cache_dim * pool.dtype.itemsize  # one token of one layer
    ps, layers, layout = pool.page_size, pool.layer_num, pool.layout
    label = f"{getattr(pool, 'pool_label', 'kv')}-mla"
    if layout == _LAYER_FIRST:
        unit = ps * row
        axis = lambda: TokenAxis(layers, pool.size * row, row, 1)  # noqa: E731
    elif layout in _PAGE_MAJOR_TOKEN_ROWS:
        unit = ps * row * layers
        axis = lambda: TokenAxis(1, pool.size * row * layers, row * layers, 1)  # noqa: E731
    elif layout in _PAGE_MAJOR_PAGE_ROWS:
        unit = ps * row * layers
        axis = lambda: TokenAxis(1, pool.page_num * unit, unit, ps)  # noqa: E731
    else:
        return None
    return PoolGeometry(label, layout, unit), axis


def dsa_geometry(pool) -> Optional[tuple[PoolGeometry, object]]:
    from sglang_cp.l2.transfer_split import TokenAxis

    stride, layers, ps = pool.indexer_page_stride_size, pool.layer_num, pool.page_size
    label = f"{getattr(pool.decl, 'pool_name', 'indexer')}"
    label = getattr(label, "value", label)
    label = f"{label}-dsa"
    if pool.layout == _LAYER_FIRST:
        axis = lambda: TokenAxis(layers, pool.indexer_page_num * stride, stride, ps)  # noqa: E731
        return PoolGeometry(label, pool.layout, stride), axis
    if pool.layout in ("page_first", "page_first_direct"):
        unit = stride * layers
        axis = lambda: TokenAxis(1, pool.indexer_page_num * unit, unit, ps)  # noqa: E731
        return PoolGeometry(label, pool.layout, unit), axis
    return None


def _install_splitter(allocator, buffer, axis_factory) -> None:
    from sglang_cp.l2.allocator import slabs_of
    from sglang_cp.l2.transfer_split import SlabSplitter, token_cuts

    mapping = slabs_of(buffer) if buffer is not None else None
    if mapping is None:
        return
    allocator.slab_splitter = SlabSplitter(token_cuts(mapping.plan, axis_factory()))


def _with_geometry(geometry_fn, pool, call):
    """Run upstream's allocation ``call`` of ``pool`` with its geometry on the pool's allocator
    (ours); an unknown geometry leaves None there, and the allocator refuses naming the pool."""
    found = geometry_fn(pool)
    geometry, axis = found if found is not None else (None, None)
    allocator = pool.allocator
    allocator.geometry = geometry
    try:
        return call(), axis
    finally:
        allocator.geometry = None


def allocate_host_buffer_around(original, self, *args, **kwargs):
    if not is_ours(getattr(self, "allocator", None)):
        return original(self, *args, **kwargs)
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    geometry_fn = mla_geometry if isinstance(self, MLATokenToKVPoolHost) else (lambda pool: None)
    skip = _SKIP_RAM_CHECK.set(True)
    try:
        result, axis = _with_geometry(geometry_fn, self, lambda: original(self, *args, **kwargs))
    finally:
        _SKIP_RAM_CHECK.reset(skip)
    if axis is not None:
        _install_splitter(self.allocator, getattr(self, "kv_buffer", None), axis)
    return result


def dsa_init_around(original, self, *args, **kwargs):
    if active_flags() is None:
        return original(self, *args, **kwargs)
    skip = _SKIP_RAM_CHECK.set(True)
    try:
        return original(self, *args, **kwargs)
    finally:
        _SKIP_RAM_CHECK.reset(skip)


def dsa_init_kv_buffer_around(original, self, *args, **kwargs):
    if not is_ours(getattr(self, "allocator", None)):
        return original(self, *args, **kwargs)
    result, axis = _with_geometry(dsa_geometry, self, lambda: original(self, *args, **kwargs))
    if axis is not None:
        _install_splitter(self.allocator, getattr(self, "index_k_with_scale_buffer", None), axis)
    return result


_logged_skip = [False]


def host_memory_budget_around(original, requested_bytes: int = 0, *args, **kwargs):
    if not _SKIP_RAM_CHECK.get():
        return original(requested_bytes, *args, **kwargs)
    if not _logged_skip[0]:
        _logged_skip[0] = True
        logger.info(
            "sglang-cp L2: skipping the psutil host-RAM check for hugetlbfs-backed HiCache "
            "pools; the hugetlbfs preflight checks them instead"
        )
    return requested_bytes


# ---------------------------------------------------------------- registration
def cuda_host_register_around(original, buffer, *args, **kwargs):
    from sglang_cp.l2.allocator import slabs_of

    mapping = slabs_of(buffer)
    if mapping is None:
        return original(buffer, *args, **kwargs)
    from sglang_cp.l2.registration import register_mapping

    ranges = register_mapping(mapping)
    # Upstream's unregister walks this list; ours below keeps it and the mapping in step.
    setattr(buffer, REGISTERED_RANGES_ATTR, list(ranges))
    return None


def cuda_host_unregister_around(original, buffer, *args, **kwargs):
    from sglang_cp.l2.allocator import slabs_of

    mapping = slabs_of(buffer)
    if mapping is None:
        return original(buffer, *args, **kwargs)
    from sglang_cp.l2.registration import unregister_mapping

    unregister_mapping(mapping)
    setattr(buffer, REGISTERED_RANGES_ATTR, list(mapping.registered))
    return None


# ---------------------------------------------------------------- transfers
def _splitter_of(pool):
    """The slab splitter our allocator holds for this pool (None for upstream's allocators)."""
    return getattr(getattr(pool, "allocator", None), "slab_splitter", None)


def backup_all_layer_around(original, self, device_pool, host_indices, device_indices, io_backend):
    splitter = _splitter_of(self)
    if splitter is None or splitter.trivial or io_backend == "kernel":
        return original(self, device_pool, host_indices, device_indices, io_backend)
    for h, d in splitter.split(host_indices, device_indices):
        original(self, device_pool, h, d, io_backend)
    return None


def load_per_layer_around(original, self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs):
    splitter = _splitter_of(self)
    if splitter is None or splitter.trivial or io_backend == "kernel":
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)
    for h, d in splitter.split(host_indices, device_indices):
        original(self, device_pool, h, d, layer_id, io_backend, **kwargs)
    return None


_SEED_SLAB = "split host cache into page-aligned slabs <= max slab GB; one cudaHostRegister each; no transfer straddles a slab"
_SEED_HUGETLBFS = "hugetlbfs-backed L2 slab with statvfs capacity preflight before ftruncate/mmap"
_SEED_PSUTIL = "gate the psutil host-memory check on the default allocator; hugetlbfs pools own their check"

HOOKS = (
    HookSpec(f"{_PH}.common.get_allocator_from_storage", "around", get_allocator_around, _SEED_HUGETLBFS,
             "every host pool gets its HostTensorAllocator here"),
    HookSpec(f"{_PH}.base.HostKVCache._allocate_host_buffer", "around", allocate_host_buffer_around, _SEED_SLAB,
             "last point that knows an MLA pool's layout and page size; also hosts the psutil check"),
    HookSpec(f"{_PH}.dsa.DSAIndexerPoolHost.__init__", "around", dsa_init_around, _SEED_PSUTIL,
             "the DSA indexer pool runs its own psutil check in __init__"),
    HookSpec(f"{_PH}.dsa.DSAIndexerPoolHost.init_kv_buffer", "around", dsa_init_kv_buffer_around, _SEED_SLAB,
             "where the DSA indexer pool allocates; it knows its page stride and layout"),
    HookSpec(f"{_PH}.base.host_memory_budget_bytes", "around", host_memory_budget_around, _SEED_PSUTIL,
             "the psutil RAM budget every host pool checks itself against"),
    HookSpec(f"{_PH}.common._cuda_host_register", "around", cuda_host_register_around, _SEED_SLAB,
             "upstream registers layer_first pools in one call; ours register one slab per call"),
    HookSpec(f"{_PH}.common._cuda_host_unregister", "around", cuda_host_unregister_around, _SEED_SLAB,
             "keep upstream's destroy() and our slab registrations in step"),
    HookSpec(f"{_PH}.base.HostKVCache.backup_from_device_all_layer_physical", "around", backup_all_layer_around,
             _SEED_SLAB, "every D2H backup of a host pool passes here with physical indices"),
    HookSpec(f"{_PH}.base.HostKVCache.load_to_device_per_layer_physical", "around", load_per_layer_around,
             _SEED_SLAB, "every H2D load of a host pool passes here with physical indices"),
)
