/* The native read engine of the L3 store (io.read_engine = "native"): read a run of slots, check each
 * blob's header and payload CRC32C, and copy the payload into the caller's page, in one pass per chunk.
 *
 * Why: the Python read path lands a whole slot in store memory, checksums it (a second pass over
 * memory) and copies it out (a third), each step a Python call under the GIL. Here each chunk of a
 * slot is read into a small buffer of the calling I/O thread, checksummed while it is still in the
 * core's cache, and copied out from there: the caller's page is written once and store memory is never
 * streamed through, and the whole run is one call that releases the GIL (ctypes).
 *
 * What stays as in the Python path (docs_internal/l3_store.md):
 *  - a page is reported good only after its header names exactly the expected blob (payload tag, rank,
 *    slot, length, key digest) and its payload CRC matches; the header is read first, so a foreign or
 *    damaged header costs no copy at all;
 *  - the caller's memory is written only between cpl3_gate_enter and _leave, and never once the gate is
 *    closed: cpl3_gate_close (called when the caller's bound passes, or when it returns) waits only for
 *    copies already under way, which are memory copies of one chunk, never for the disk. A read that
 *    comes back from the device after that lands in the engine's chunk buffer and goes nowhere.
 *  - a page whose bytes were partly copied and then failed (CRC, short read, closed gate) is a miss: the
 *    caller's page content is unspecified, as in the Python path.
 * No Python headers: called through ctypes. */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cpl3_native.h"

#define ALIGN CPL3_ALIGN
#define HEADER_BYTES CPL3_HEADER_BYTES
#define BLOB_VERSION 2u
static const uint8_t MAGIC[4] = {'C', 'P', 'L', '3'};

/* cpl3_read_item, its statuses and cpl3_gate: cpl3_native.h (shared with read_uring.c). */

int cpl3_gate_enter(cpl3_gate *g) {
    __atomic_add_fetch(&g->copying, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&g->closed, __ATOMIC_SEQ_CST)) {
        __atomic_sub_fetch(&g->copying, 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    return 1;
}

void cpl3_gate_leave(cpl3_gate *g) { __atomic_sub_fetch(&g->copying, 1, __ATOMIC_SEQ_CST); }

/* Close the gate: no copy starts after this, and it returns once the copies under way are done
 * (0), or -1 if one still runs after `timeout_s` (a chunk copy takes microseconds: a broken
 * invariant, which the caller raises). Sequentially consistent: a copier that saw the gate open has
 * already announced itself in `copying`, which this then sees. */
int cpl3_gate_close(cpl3_gate *g, double timeout_s) {
    __atomic_store_n(&g->closed, 1, __ATOMIC_SEQ_CST);
    struct timespec nap = {0, 20000}, t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (__atomic_load_n(&g->copying, __ATOMIC_SEQ_CST)) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) > timeout_s) return -1;
        nanosleep(&nap, NULL);
    }
    return 0;
}

/* Copy a checked chunk (in this core's cache) into the caller's page. Large copies use non-temporal
 * stores: the page is not read again on this core (upstream moves it to the GPU later), so pulling each
 * destination line into the cache first (what ordinary stores do) would only add a read of the whole
 * page from memory. The fence makes the stores globally visible before the page is reported good. */
#if defined(__x86_64__)
#include <emmintrin.h>
void cpl3_copy_out(uint8_t *dst, const uint8_t *src, size_t n) {
    if (n < 65536) { memcpy(dst, src, n); return; }
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32)), d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
    _mm_sfence();
}
#else
void cpl3_copy_out(uint8_t *dst, const uint8_t *src, size_t n) { memcpy(dst, src, n); }
#endif

/* One pread of exactly `len` bytes: the byte count, or -errno. */
static int64_t read_at(int fd, uint8_t *buf, size_t len, uint64_t off) {
    for (;;) {
        ssize_t n = pread(fd, buf, len, (off_t)off);
        if (n >= 0) return n;
        if (errno != EINTR) return -(int64_t)errno;
    }
}

static uint32_t le32(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

/* The header layout of sglang_cp/l3/format/blob.py (<4sHHIIIIQ16sQI + header CRC32C). Returns CPL3_OK and the
 * payload CRC, or the reason the blob is not the one the index named. */
int cpl3_check_header(const uint8_t *h, uint32_t tag, uint32_t rank, uint32_t slot, uint64_t length,
                      const uint8_t digest[16], uint32_t *payload_crc, int32_t *detail) {
    if (memcmp(h, MAGIC, 4) != 0) return CPL3_BAD_MAGIC;
    if (cpl3_crc32c(0, h, HEADER_BYTES - 4) != le32(h + 60)) return CPL3_HEADER_CRC;
    if ((h[4] | h[5] << 8) != BLOB_VERSION || (h[6] | h[7] << 8) != HEADER_BYTES) return CPL3_BAD_VERSION;
    if (le32(h + 8) != tag || le32(h + 12) != rank || le64(h + 24) != length) { *detail = 1; return CPL3_FOREIGN; }
    if (le32(h + 16) != slot) { *detail = 2; return CPL3_FOREIGN; }
    if (memcmp(h + 32, digest, 16) != 0) { *detail = 3; return CPL3_FOREIGN; }
    *payload_crc = le32(h + 56);
    return CPL3_OK;
}

static int read_one(int fd, uint32_t tag, uint32_t rank, uint64_t page_bytes, uint64_t extent,
                    cpl3_read_item *it, uint8_t *chunk, uint64_t chunk_bytes, uint8_t *tail, cpl3_gate *gate) {
    uint64_t body = page_bytes / ALIGN * ALIGN;  /* the aligned part of the payload; the rest is in the tail */
    uint64_t tail_len = extent - body;
    uint8_t *dst = (uint8_t *)(uintptr_t)it->dst;
    int64_t n = read_at(fd, tail, tail_len, it->offset + body);
    if (n < 0) { it->detail = (int32_t)-n; return CPL3_READ_ERROR; }
    if ((uint64_t)n != tail_len) { it->detail = (int32_t)n; return CPL3_SHORT_READ; }
    uint32_t want = 0;
    int rc = cpl3_check_header(tail + (page_bytes - body), tag, rank, it->slot, page_bytes, it->digest, &want, &it->detail);
    if (rc != CPL3_OK) return rc;
    uint32_t s = ~0u;
    for (uint64_t off = 0; off < body; off += chunk_bytes) {
        uint64_t len = body - off < chunk_bytes ? body - off : chunk_bytes;
        n = read_at(fd, chunk, len, it->offset + off);
        if (n < 0) { it->detail = (int32_t)-n; return CPL3_READ_ERROR; }
        if ((uint64_t)n != len) { it->detail = (int32_t)(off + n); return CPL3_SHORT_READ; }
        s = cpl3_crc32c_raw(s, chunk, len);
        if (!cpl3_gate_enter(gate)) return CPL3_CANCELLED;
        cpl3_copy_out(dst + off, chunk, len);
        cpl3_gate_leave(gate);
    }
    s = cpl3_crc32c_raw(s, tail, page_bytes - body);
    if (~s != want) return CPL3_CRC_MISMATCH;
    if (page_bytes > body) {
        if (!cpl3_gate_enter(gate)) return CPL3_CANCELLED;
        cpl3_copy_out(dst + body, tail, page_bytes - body);
        cpl3_gate_leave(gate);
    }
    return CPL3_OK;
}

/* Read `n` pages of one slab (fd, O_DIRECT). `buf`: 4 KiB-aligned, chunk_bytes + 8192 bytes (a chunk
 * area and a tail area for the header block); chunk_bytes a multiple of 4 KiB. Each item's status is
 * set; pages after the gate closed are CPL3_CANCELLED. Returns the number of good pages, or -1 for
 * arguments that break the engine's contract (nothing is read then). */
int cpl3_read_pages(int fd, uint32_t tag, uint32_t rank, uint64_t page_bytes, uint64_t extent,
                    cpl3_read_item *items, uint64_t n, uint8_t *buf, uint64_t chunk_bytes, cpl3_gate *gate) {
    if (chunk_bytes == 0 || chunk_bytes % ALIGN || (uintptr_t)buf % ALIGN || extent % ALIGN ||
        extent < page_bytes + HEADER_BYTES || extent - page_bytes / ALIGN * ALIGN > 2 * ALIGN)
        return -1;
    uint8_t *tail = buf + chunk_bytes;
    int good = 0;
    for (uint64_t i = 0; i < n; i++) {
        cpl3_read_item *it = &items[i];
        it->detail = 0;
        if (__atomic_load_n(&gate->closed, __ATOMIC_SEQ_CST)) {
            it->status = CPL3_CANCELLED;
            continue;
        }
        it->status = read_one(fd, tag, rank, page_bytes, extent, it, buf, chunk_bytes, tail, gate);
        good += it->status == CPL3_OK;
    }
    return good;
}

/* Sizes the Python side checks its mirror of cpl3_read_item and cpl3_gate against at load. */
uint64_t cpl3_read_item_size(void) { return sizeof(cpl3_read_item); }
uint64_t cpl3_gate_size(void) { return sizeof(cpl3_gate); }
