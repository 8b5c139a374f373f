"""Hook point: upstream's own hugepage host allocation,
``sglang.srt.mem_cache.storage.mmap.mmap_allocator.alloc_mmap`` and
``sglang.srt.mem_cache.storage.mmap.mmap_allocator._alloc_hugepage``.

Why: with ``SGLANG_HUGEPAGE_SIZE=2MB|1GB`` (upstream's switch, independent of our
hugepage L2 flag) ``alloc_mmap`` falls back to 4 KiB pages when the hugetlb
mmap fails (no reserved pages, pool exhausted), when libc cannot be loaded, or
when the value is misspelt. It logs and serves the pool from 4 KiB pages: the
user who asked for hugepages gets a slower, differently-pinned pool and learns
it only from a log line. ``SGLANG_CP_HUGEPAGE_STRICT=1`` turns each of those
fallbacks into one startup error that names ``SGLANG_HUGEPAGE_SIZE``, what was
missing and the fix, before any 4 KiB memory is mapped: AROUND ``alloc_mmap``
(bad value, no libc) and AROUND ``_alloc_hugepage`` (the mmap failed: raised
as a non-``OSError`` so upstream's ``except OSError`` fallback cannot catch it).

Default off (behaviour-neutral): upstream's fallback is its documented contract
for every user of the plugin who did not ask for ours, and the fallback serves
correct bytes (it costs performance, not correctness). Decision and the items
left as upstream (the psutil budget check, one cudaHostRegister per
layer_first pool) are in docs_internal/upstream_audit.md, section 2.
"""

from __future__ import annotations

import os

from sglang_cp.integration.hookspec import HookSpec

ENV = "SGLANG_CP_HUGEPAGE_STRICT"
_SIZES = {"2MB": 2048, "1GB": 1048576}  # kB, as /sys/kernel/mm/hugepages names them


class HugepageStrictError(RuntimeError):
    """SGLANG_HUGEPAGE_SIZE asked for hugepages that cannot be had (strict mode)."""


def strict() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _requested() -> str:
    from sglang.srt.environ import envs

    return (envs.SGLANG_HUGEPAGE_SIZE.get() or "").strip().upper()


def free_hugepages(size: str, sysfs: str = "/sys/kernel/mm/hugepages") -> int | None:
    """Free pages of one hugepage size, or None where the kernel exposes no pool."""
    try:
        with open(os.path.join(sysfs, f"hugepages-{_SIZES[size]}kB", "free_hugepages")) as f:
            return int(f.read().strip())
    except (OSError, ValueError, KeyError):
        return None


def alloc_mmap_around(original, dims, dtype, *args, **kwargs):
    if strict():
        size = _requested()
        if size and size not in _SIZES:
            raise HugepageStrictError(
                f"SGLANG_HUGEPAGE_SIZE={size!r} is not '2MB' or '1GB' and {ENV}=1 refuses "
                "the 4 KiB fallback: set SGLANG_HUGEPAGE_SIZE=2MB or 1GB, or unset it"
            )
        if size:
            from sglang.srt.mem_cache.storage.mmap import mmap_allocator

            if mmap_allocator._libc is None:
                raise HugepageStrictError(
                    f"SGLANG_HUGEPAGE_SIZE={size} needs libc's mmap, which could not be "
                    f"loaded, and {ENV}=1 refuses the 4 KiB fallback: run with a glibc "
                    "userland or unset SGLANG_HUGEPAGE_SIZE"
                )
    return original(dims, dtype, *args, **kwargs)


def alloc_hugepage_around(original, n_bytes, alloc_bytes, extra_flags, *args, **kwargs):
    try:
        return original(n_bytes, alloc_bytes, extra_flags, *args, **kwargs)
    except OSError as e:
        if not strict():
            raise
        size = _requested()
        free = free_hugepages(size)
        need = -(-alloc_bytes // (_SIZES.get(size, 2048) * 1024))
        raise HugepageStrictError(
            f"SGLANG_HUGEPAGE_SIZE={size}: the hugetlb mmap of {alloc_bytes} bytes failed "
            f"({e}); {need} pages of {size} needed, "
            f"{'unknown' if free is None else free} free, and {ENV}=1 refuses the 4 KiB "
            f"fallback: reserve them (vm.nr_hugepages, or hugepages-{_SIZES.get(size, 2048)}kB/"
            "nr_hugepages in sysfs) or unset SGLANG_HUGEPAGE_SIZE"
        ) from e


_MMAP = "sglang.srt.mem_cache.storage.mmap.mmap_allocator"

HOOKS = (
    HookSpec(
        target=f"{_MMAP}.alloc_mmap",
        kind="around",
        fn=alloc_mmap_around,
        seed="002#26 no silent 4 KiB fallback for hugepage-backed host pools (upstream's SGLANG_HUGEPAGE_SIZE path)",
        why="the one entry of upstream's hugepage host allocation; decides the fallback for a bad value or no libc",
    ),
    HookSpec(
        target=f"{_MMAP}._alloc_hugepage",
        kind="around",
        fn=alloc_hugepage_around,
        seed="002#26 no silent 4 KiB fallback for hugepage-backed host pools (upstream's SGLANG_HUGEPAGE_SIZE path)",
        why="the hugetlb mmap whose OSError alloc_mmap turns into a 4 KiB fallback",
    ),
)
