"""Hook point: the direct-I/O copies of the MLA host pool,
``sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost.load_to_device_per_layer`` and
``sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost.backup_from_device_all_layer``.

Why: with ``--hicache-io-backend direct`` these methods call sgl_kernel's
``transfer_kv_direct(..., page_size=self.page_size)`` (layer_first) and the
``*_direct_pf_lf`` / ``*_direct_lf_pf`` copies (page_first_direct), which copy
``page_size`` consecutive rows from the first index of each group. A torn or
misaligned group therefore copies the wrong rows without error; upstream checks
nothing on this path and no other hook covers it (``move_hybrid_indices`` is
not on every caller's path, e.g. the PD decode offload controller). Under
direct I/O ``HiCacheController.move_indices`` leaves the host indices on the CPU
and moves the device indices to the CPU, so both are validated here at no
device sync (BEFORE hook). Kernel I/O is left to ``move_hybrid_indices``
(seed_hicache_move_page_groups): here its indices are GPU tensors.

Page size: ``logical_page_size`` (the indices are logical slots; the methods
narrow them to this DCP rank's rows themselves). Layer-wise loads pass the same
tensors once per layer; ``compute.page_groups`` remembers a tensor that passed
(weak reference + in-place version), so it is checked once per transfer.

Seed item 000#3: "... and CUDA direct copy kernels to reject malformed (partial,
misaligned, non-contiguous) page groups before they reach native transfer code."

Gate: ``SGLANG_CP_VALIDATE_PAGE_GROUPS`` (default ``host``; ``0`` = upstream).
"""

from __future__ import annotations

from sglang_cp.compute import page_groups
from sglang_cp.integration.hookspec import HookSpec


def _validate(pool, host_indices, device_indices, io_backend):
    if io_backend != "direct":
        return
    mode = page_groups.validation_mode()
    if mode == "0":
        return
    ps = getattr(pool, "logical_page_size", None) or pool.page_size
    page_groups.check(host_indices, ps, name="host_indices", mode=mode)
    page_groups.check(device_indices, ps, name="device_indices", mode=mode)


def validate_direct_load(self, device_pool, host_indices, device_indices, layer_id, io_backend, *args, **kwargs):
    _validate(self, host_indices, device_indices, io_backend)


def validate_direct_backup(self, device_pool, host_indices, device_indices, io_backend, *args, **kwargs):
    _validate(self, host_indices, device_indices, io_backend)


_MLA = "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost"

HOOKS = (
    HookSpec(
        target=f"{_MLA}.load_to_device_per_layer",
        kind="before",
        fn=validate_direct_load,
        seed="000#3 validate_page_aligned_token_indices before CUDA direct copy kernels",
        why="direct I/O load calls transfer_kv_direct(page_size=...) with CPU indices here",
    ),
    HookSpec(
        target=f"{_MLA}.backup_from_device_all_layer",
        kind="before",
        fn=validate_direct_backup,
        seed="000#3 validate_page_aligned_token_indices before CUDA direct copy kernels",
        why="direct I/O backup calls transfer_kv_direct(page_size=...) with CPU indices here",
    ),
)
