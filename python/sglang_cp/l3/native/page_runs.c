/* Whole pages in a run of token indices, checked while the caller keeps the GIL.
 *
 * Why C: a restore validates upstream's host indices (every group of page_size indices must be
 * s, s+1, ..., s+page_size-1 with s a multiple of page_size) before any byte moves. As torch ops that
 * took ~14 dispatcher calls, each releasing the GIL; beside a busy scheduler thread each release costs up
 * to CPython's 5 ms switch interval (60-100 ms per prefetch). This loop runs at ~1 ns per index and is
 * called through ctypes.PyDLL, which does not release the GIL (sglang_cp/l3/native/__init__.py). */
#include "cpl3_native.h"

/* Writes starts[g] = idx[g * page_size] for each of n_groups groups. Returns -1 when every group is a
 * whole page, else the first group that is not (its start misaligned or its indices not consecutive). */
int64_t cpl3_page_starts(const int64_t *idx, uint64_t n_groups, int64_t page_size, int64_t *starts) {
    if (page_size <= 0)
        return 0;
    for (uint64_t g = 0; g < n_groups; g++) {
        const int64_t *p = idx + g * (uint64_t)page_size;
        int64_t s = p[0];
        if (s % page_size != 0)
            return (int64_t)g;
        for (int64_t k = 1; k < page_size; k++)
            if (p[k] != s + k)
                return (int64_t)g;
        starts[g] = s;
    }
    return -1;
}
