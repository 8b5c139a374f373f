/* The write path's staging copy (sglang_cp/l3/submit.py): a run of the caller's pages copied into their
 * staging slots and each copy's CRC32C computed, in one call. One call is one GIL release through ctypes
 * for the whole run. Beside a Python thread that never pauses (a GPU server's scheduler) every release
 * costs the caller up to CPython's switch interval (5 ms by default) to get the GIL back, and a page's
 * copy and checksum were two such releases per page: the backup then ran at two pages per 10 ms
 * whatever the drive. */
#include <string.h>

#include "cpl3_native.h"

/* Copied, then checksummed while the chunk is still in this core's cache. */
#define STAGE_CHUNK ((size_t)256 << 10)

void cpl3_stage_pages(uint64_t n, const uint64_t *dsts, const uint64_t *srcs, uint64_t nbytes, uint32_t *crcs) {
    for (uint64_t i = 0; i < n; i++) {
        uint8_t *dst = (uint8_t *)(uintptr_t)dsts[i];
        const uint8_t *src = (const uint8_t *)(uintptr_t)srcs[i];
        uint32_t state = ~0u;
        for (uint64_t off = 0; off < nbytes; off += STAGE_CHUNK) {
            size_t len = nbytes - off < STAGE_CHUNK ? (size_t)(nbytes - off) : STAGE_CHUNK;
            memcpy(dst + off, src + off, len);
            state = cpl3_crc32c_raw(state, dst + off, len);
        }
        crcs[i] = ~state;
    }
}
