/* Shared declarations of the L3 store's native library (built by the package build into
 * sglang_cp/l3/_native, loaded with ctypes by sglang_cp/l3/native.py). */
#ifndef CPL3_NATIVE_H
#define CPL3_NATIVE_H
#include <stddef.h>
#include <stdint.h>

uint32_t cpl3_crc32c_raw(uint32_t state, const void *buf, size_t n);
uint32_t cpl3_crc32c(uint32_t value, const void *buf, size_t n);
void cpl3_stage_pages(uint64_t n, const uint64_t *dsts, const uint64_t *srcs, uint64_t nbytes, uint32_t *crcs);
struct iovec;
void cpl3_write_runs(int fd, uint64_t n, const uint64_t *offsets, const uint64_t *iov_counts,
                     const struct iovec *iovs, int64_t *results);

/* The read engines' shared contract (read_pages.c, read_uring.c): a page of a read, its outcome, and
 * the operation's permission to write the caller's pages. Mirrored in sglang_cp/l3/native.py. */
#define CPL3_ALIGN 4096u
#define CPL3_HEADER_BYTES 64u

/* One page of a read. Python fills offset..digest and reads status/detail. */
typedef struct {
    uint64_t offset;  /* file offset of the slot */
    uint64_t dst;     /* address of the caller's page (page_bytes writable bytes) */
    uint32_t slot;
    uint32_t reserved;
    uint8_t digest[16];
    int32_t status;   /* out: CPL3_* below */
    int32_t detail;   /* out: errno (READ_ERROR), bytes read (SHORT_READ), which field (FOREIGN) */
} cpl3_read_item;

enum {
    CPL3_OK = 1,
    CPL3_READ_ERROR = -1,
    CPL3_SHORT_READ = -2,
    CPL3_BAD_MAGIC = -3,
    CPL3_HEADER_CRC = -4,
    CPL3_BAD_VERSION = -5,
    CPL3_FOREIGN = -6,
    CPL3_CRC_MISMATCH = -7,
    CPL3_CANCELLED = -8,
};

/* The caller's permission to write its pages: one per operation, shared by all its runs. */
typedef struct {
    int32_t closed;
    int32_t copying;
} cpl3_gate;

/* read_pages.c: enter/leave the gate around a copy into the caller's memory (enter returns 0 once it
 * is closed), the copy itself, and the check that a header names exactly the expected blob. */
int cpl3_gate_enter(cpl3_gate *g);
void cpl3_gate_leave(cpl3_gate *g);
void cpl3_copy_out(uint8_t *dst, const uint8_t *src, size_t n);
int cpl3_check_header(const uint8_t *h, uint32_t tag, uint32_t rank, uint32_t slot, uint64_t length,
                      const uint8_t digest[16], uint32_t *payload_crc, int32_t *detail);

#endif
