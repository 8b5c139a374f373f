/* The io_uring read engine of the L3 store (io.read_engine = "uring"): the native engine's checks and
 * per-page statuses (cpl3_native.h), with a run's reads kept in flight together on one io_uring.
 *
 * Why: the native engine (read_pages.c) has one pread in the device per I/O thread, so filling a fast
 * drive takes 8-16 threads per rank, and at CP=8 that is 64-128 threads on a host whose cores the
 * server's schedulers need. Here one thread keeps up to `nslots` requests in flight, with one
 * io_uring_enter per round of submissions and completions (not per page): threads are needed only for
 * the CPU work (CRC32C and the copy into the caller's page), not to make queue depth.
 *
 * How (no liburing: the raw syscalls and the rings of <linux/io_uring.h>, mmap'ed):
 *  - a ring owns `nslots` landing slots of `slot_bytes`, allocated here (huge-page aligned, faulted in)
 *    and registered with IORING_REGISTER_BUFFERS where the memlock limit allows (READ_FIXED: no page
 *    pinning per request), else read with plain READ. The ring frees them only once no read of its is
 *    in the kernel.
 *  - a page is read as pieces: its head [T, extent) (the payload past the last whole piece and the
 *    header block), then its body pieces [k*piece, (k+1)*piece) below T, T = (aligned payload / piece)
 *    * piece. Small pages are one request.
 *  - completions are processed in request order: the head's header must name exactly the blob the
 *    index points at (else the page stops: no copy), then each body piece is checksummed (CRC32C chained
 *    in order) and copied into the caller's page through the gate, then the head's payload part; a page
 *    counts only if the CRC matches. The caller's memory is written only between cpl3_gate_enter and
 *    _leave, so nothing reaches it once the caller's bound closed the gate.
 *
 * Guards (the ways io_uring readers have delivered wrong bytes silently):
 *  - SHORT READ: a completion with fewer bytes than asked is never accepted: a multiple of 512 B is
 *    resubmitted for the rest, anything else (0: end of file) is CPL3_SHORT_READ.
 *  - STALE COMPLETION: user_data holds the batch generation, the landing slot and the request index; a
 *    completion counts only if it is the user_data of a request of this batch in flight now. Anything
 *    else (a read of an earlier batch that outlived it, a duplicate) only gives its slot back.
 *  - LATE READ: a slot whose read is in the kernel is never handed to another request, in this batch
 *    or a later one; it comes back when that read's completion is reaped. When the gate closes, the
 *    batch stops submitting, cancels its reads and waits for them up to `drain_s`; a read still in the
 *    kernel after that keeps its slot (the ring works on with fewer) until it completes.
 * cpl3_uring_test_inject fakes each fault for the tests that show its guard at work (a truncated
 * completion, a replayed user_data, a cancel never sent); nothing but those tests calls it.
 *
 * One ring per read I/O thread (sglang_cp/l3/native/uring.py takes one per call): a ring is not safe to
 * share between threads without a lock, and the CPU work that follows each completion is what the
 * threads are for. No Python headers: called through ctypes. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "cpl3_native.h"

#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#endif
#endif
#if defined(IORING_FEAT_EXT_ARG) && defined(__NR_io_uring_setup) && defined(__NR_io_uring_enter)
#define HAVE_URING 1
#endif

/* cpl3_uring_stats: what Python shows in the store's stats (sglang_cp/l3/native/uring.py STATS). */
enum { ST_ENTERS, ST_READS, ST_SHORT_RESUBMITS, ST_STALE, ST_CANCELS, ST_LATE, ST_REGISTERED, ST_INFLIGHT,
       ST_FREE_SLOTS, ST_N };
/* cpl3_uring_test_inject modes (tests only). */
enum { INJ_NONE, INJ_SHORT, INJ_SHORT_ODD, INJ_REPLAY, INJ_NO_CANCEL };

#ifdef HAVE_URING

#define UD_CANCEL (1ull << 63)  /* the completion of one of our cancels (its read's own is what counts) */
#define GEN_MASK 0x7fffffu     /* 23 bits of generation, 16 of slot, 24 of request index */
#define MAX_REQS (1u << 24)
#define MAX_SLOTS 65535u
#define SLICE_NS 10000000L      /* waits are cut in 10 ms slices to look at the gate */
/* Bytes passed to the kernel per io_uring_enter. Where a read completes inside the enter (a RAM-backed
 * device, tmpfs: the kernel copies in the submitting thread), the pieces are then checksummed and copied
 * out while they are still in this core's cache (L2 is 1-2 MiB on current server cores) instead of after
 * the whole queue depth landed; where reads complete later (a drive), it only takes a few submit-only
 * enters to reach the queue depth. */
#define SUBMIT_BYTES (2u << 20)

typedef struct {
    int fd;
    uint32_t sq_entries, cq_entries, sq_local, pending;  /* pending: SQEs not yet passed to the kernel */
    uint32_t *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len, sqes_len;
    uint8_t *map, *buf;             /* the landing mapping, and its huge-page aligned start */
    size_t map_len;
    uint64_t slot_bytes;
    uint32_t nslots, nfree, gen;
    uint64_t *slot_ud;              /* user_data of the read in the kernel into each slot; 0: none */
    uint32_t *free;                 /* slots no request owns and no read targets */
    int registered, inject;
    uint64_t first_ud, inject_ud;   /* the last batch's first read (what INJ_REPLAY replays) */
    uint32_t first_len, inject_len;
    uint64_t stats[ST_N];
} cpl3_uring;

enum { R_WAIT, R_FLIGHT, R_RESUB, R_LANDED, R_FAILED, R_SKIP, R_DRAINED };

typedef struct {
    uint64_t off, ud;               /* file offset of the piece; user_data while its read is in the kernel */
    uint32_t page, start, len, done, slot, retries;
    uint8_t state, has_slot, head, last;
    int32_t status, detail;         /* a failed read's outcome */
} req_t;

typedef struct {
    cpl3_uring *R;
    req_t *reqs;
    uint32_t nreq, next, proc, flight, gen, nresub, *resub, cap;  /* cap: SQEs per enter */
    int fd, closing;
    uint32_t tag, rank, crc, want;
    int64_t cur_head;               /* the request whose slot holds the current page's header block */
    uint64_t page_bytes;
    cpl3_read_item *items;
    uint8_t *failed;                /* per page: stop reading it */
    cpl3_gate *gate;
} batch_t;

static uint64_t make_ud(uint32_t gen, uint32_t slot, uint32_t idx) {
    return (uint64_t)(gen & GEN_MASK) << 40 | (uint64_t)slot << 24 | idx;
}
static uint32_t ud_slot(uint64_t ud) { return (uint32_t)(ud >> 24) & 0xffffu; }
static uint32_t ud_idx(uint64_t ud) { return (uint32_t)ud & (MAX_REQS - 1); }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* io_uring_enter: submit `to_submit`, and with `wait` block for one completion at most `wait_ns`.
 * Returns the SQEs consumed or -errno (-ETIME: the wait ran out). */
static int enter(cpl3_uring *R, uint32_t to_submit, int wait, long wait_ns) {
    struct __kernel_timespec ts = {wait_ns / 1000000000L, wait_ns % 1000000000L};
    struct io_uring_getevents_arg arg;
    memset(&arg, 0, sizeof arg);
    arg.sigmask_sz = _NSIG / 8;
    arg.ts = (uint64_t)(uintptr_t)&ts;
    unsigned flags = IORING_ENTER_EXT_ARG | (wait ? IORING_ENTER_GETEVENTS : 0);
    R->stats[ST_ENTERS]++;
    __atomic_store_n(R->sq_tail, R->sq_local, __ATOMIC_RELEASE);  /* the SQEs filled in since the last enter */
    long rc = syscall(__NR_io_uring_enter, R->fd, to_submit, wait ? 1 : 0, flags, &arg, sizeof arg);
    if (rc < 0) return -errno;
    R->pending -= (uint32_t)rc < R->pending ? (uint32_t)rc : R->pending;
    return (int)rc;
}

static struct io_uring_sqe *sqe_get(cpl3_uring *R) {
    uint32_t head = __atomic_load_n(R->sq_head, __ATOMIC_ACQUIRE);
    if (R->sq_local - head >= R->sq_entries) return NULL;
    uint32_t i = R->sq_local & *R->sq_mask;
    struct io_uring_sqe *s = &R->sqes[i];
    memset(s, 0, sizeof *s);
    R->sq_array[i] = i;
    R->sq_local++;
    R->pending++;
    return s;  /* published to the kernel by enter() */
}

static void ring_unmap(cpl3_uring *R) {
    if (R->sqes && R->sqes != MAP_FAILED) munmap(R->sqes, R->sqes_len);
    if (R->cq_map && R->cq_map != MAP_FAILED && R->cq_map != R->sq_map) munmap(R->cq_map, R->cq_map_len);
    if (R->sq_map && R->sq_map != MAP_FAILED) munmap(R->sq_map, R->sq_map_len);
    if (R->fd >= 0) close(R->fd);
}

/* A ring with `nslots` landing slots of `slot_bytes`, or NULL with *err = errno: EPERM/ENOSYS where
 * io_uring is refused (seccomp, kernel.io_uring_disabled), EOPNOTSUPP on kernels before 5.11 (no
 * IORING_FEAT_EXT_ARG: waits could not be bounded), EINVAL for arguments out of range. */
void *cpl3_uring_open(uint32_t nslots, uint64_t slot_bytes, int32_t *err) {
    *err = 0;
    if (nslots < 2 || nslots > MAX_SLOTS || slot_bytes == 0 || slot_bytes % CPL3_ALIGN) { *err = EINVAL; return NULL; }
    cpl3_uring *R = calloc(1, sizeof *R);
    if (!R) { *err = ENOMEM; return NULL; }
    R->fd = -1;
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    /* COOP_TASKRUN: completions are posted when we next enter the kernel, not by interrupting the CRC
     * and copy work; SUBMIT_ALL: one bad SQE does not stop the rest of a submission (5.18+, else none). */
    uint32_t entries = 2 * nslots;  /* room for a cancel per read in flight */
#if defined(IORING_SETUP_COOP_TASKRUN) && defined(IORING_SETUP_SUBMIT_ALL)
    p.flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SUBMIT_ALL;
    R->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (R->fd < 0 && errno == EINVAL) {
        memset(&p, 0, sizeof p);
        R->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    }
#else
    R->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
#endif
    if (R->fd < 0) { *err = errno; free(R); return NULL; }
    if (!(p.features & IORING_FEAT_EXT_ARG)) { *err = EOPNOTSUPP; goto fail; }
    R->sq_entries = p.sq_entries;
    R->cq_entries = p.cq_entries;
    R->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
    R->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP)
        R->sq_map_len = R->cq_map_len = R->sq_map_len > R->cq_map_len ? R->sq_map_len : R->cq_map_len;
    R->sq_map = mmap(NULL, R->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, R->fd, IORING_OFF_SQ_RING);
    if (R->sq_map == MAP_FAILED) { *err = errno; goto fail; }
    R->cq_map = (p.features & IORING_FEAT_SINGLE_MMAP) ? R->sq_map
        : mmap(NULL, R->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, R->fd, IORING_OFF_CQ_RING);
    if (R->cq_map == MAP_FAILED) { *err = errno; goto fail; }
    R->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    R->sqes = mmap(NULL, R->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, R->fd, IORING_OFF_SQES);
    if (R->sqes == MAP_FAILED) { *err = errno; goto fail; }
    uint8_t *sq = R->sq_map, *cq = R->cq_map;
    R->sq_head = (uint32_t *)(sq + p.sq_off.head);
    R->sq_tail = (uint32_t *)(sq + p.sq_off.tail);
    R->sq_mask = (uint32_t *)(sq + p.sq_off.ring_mask);
    R->sq_array = (uint32_t *)(sq + p.sq_off.array);
    R->cq_head = (uint32_t *)(cq + p.cq_off.head);
    R->cq_tail = (uint32_t *)(cq + p.cq_off.tail);
    R->cq_mask = (uint32_t *)(cq + p.cq_off.ring_mask);
    R->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    R->sq_local = *R->sq_tail;

    /* Landing slots: whole huge pages (physically contiguous where THP allows, so a request is a few
     * device segments), advised before the first touch and faulted in now (first touch is slow on VMs). */
    size_t huge = 2u << 20, size = ((size_t)nslots * slot_bytes + huge - 1) / huge * huge;
    R->map = mmap(NULL, size + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (R->map == MAP_FAILED) { R->map = NULL; *err = errno; goto fail; }
    R->map_len = size + huge;
    R->buf = (uint8_t *)(((uintptr_t)R->map + huge - 1) & ~(uintptr_t)(huge - 1));
#ifdef MADV_HUGEPAGE
    madvise(R->buf, size, MADV_HUGEPAGE);
#endif
    for (size_t o = 0; o < size; o += CPL3_ALIGN) R->buf[o] = 0;
    struct iovec iov = {R->buf, (size_t)nslots * slot_bytes};
    /* Refused above RLIMIT_MEMLOCK without CAP_IPC_LOCK, or above 1 GiB: plain READ then. */
    R->registered = syscall(__NR_io_uring_register, R->fd, IORING_REGISTER_BUFFERS, &iov, 1) == 0;
    R->stats[ST_REGISTERED] = (uint64_t)R->registered;
    R->slot_bytes = slot_bytes;
    R->nslots = nslots;
    R->slot_ud = calloc(nslots, sizeof *R->slot_ud);
    R->free = malloc(nslots * sizeof *R->free);
    if (!R->slot_ud || !R->free) { *err = ENOMEM; goto fail; }
    for (uint32_t s = 0; s < nslots; s++) R->free[s] = nslots - 1 - s;
    R->nfree = nslots;
    return R;
fail:
    ring_unmap(R);
    if (R->map) munmap(R->map, R->map_len);
    free(R->slot_ud);
    free(R->free);
    free(R);
    return NULL;
}

static uint8_t *slot_mem(cpl3_uring *R, uint32_t slot) { return R->buf + (uint64_t)slot * R->slot_bytes; }

static void give_slot(cpl3_uring *R, uint32_t slot) { R->free[R->nfree++] = slot; }

/* A request lets go of its landing slot. GUARD(late): the slot is free again only if no read of ours
 * targets it; else the completion of that read frees it (complete(), when it is reaped). */
static void release(cpl3_uring *R, req_t *r) {
    if (!r->has_slot) return;
    r->has_slot = 0;
    if (R->slot_ud[r->slot] == 0) give_slot(R, r->slot);
    else R->stats[ST_LATE]++;
}

/* One completion. `b` is the batch running now (NULL when none). */
static void complete(cpl3_uring *R, batch_t *b, uint64_t ud, int32_t res) {
    if (ud & UD_CANCEL) return;
    uint32_t s = ud_slot(ud), i = ud_idx(ud);
    int in_kernel = s < R->nslots && R->slot_ud[s] == ud;
    if (in_kernel) { R->slot_ud[s] = 0; R->stats[ST_INFLIGHT]--; }
    /* GUARD(stale): only the exact read in flight of a request of this batch counts. */
    if (!b || i >= b->nreq || b->reqs[i].ud != ud || b->reqs[i].state != R_FLIGHT) {
        R->stats[ST_STALE]++;
        if (in_kernel) give_slot(R, s);  /* a read whose batch is over: its slot is nobody's now */
        return;
    }
    req_t *r = &b->reqs[i];
    r->ud = 0;
    b->flight--;
    uint32_t want = r->len - r->done;
    if ((R->inject == INJ_SHORT && res > (int32_t)CPL3_ALIGN && (uint32_t)res == want) ||
        (R->inject == INJ_SHORT_ODD && res > 100 && (uint32_t)res == want)) {
        /* The kernel answered in full; pretend it stopped early, and that the bytes past it never came. */
        uint32_t cut = R->inject == INJ_SHORT ? CPL3_ALIGN : 100;
        res -= (int32_t)cut;
        memset(slot_mem(R, r->slot) + r->done + (uint32_t)res, 0xEE, cut);
        R->inject = INJ_NONE;
    }
    if (b->closing) { r->state = R_DRAINED; return; }  /* its page is cancelled whatever it read */
    if (res < 0) {
        if ((res == -EINTR || res == -EAGAIN) && r->retries++ < 8) {
            r->state = R_RESUB;
            b->resub[b->nresub++] = i;
        } else {
            r->state = R_FAILED;
            r->status = res == -ECANCELED ? CPL3_CANCELLED : CPL3_READ_ERROR;
            r->detail = -res;
        }
    } else if ((uint32_t)res > want) {  /* more than asked: not a read we understand */
        r->state = R_FAILED;
        r->status = CPL3_READ_ERROR;
        r->detail = EIO;
    } else if ((uint32_t)res < want) {  /* GUARD(short): never accept fewer bytes than asked */
        if (res > 0 && res % 512 == 0) {
            r->done += (uint32_t)res;
            r->state = R_RESUB;
            b->resub[b->nresub++] = i;
            R->stats[ST_SHORT_RESUBMITS]++;
        } else {
            r->state = R_FAILED;
            r->status = CPL3_SHORT_READ;
            r->detail = (int32_t)(r->start + r->done + (uint32_t)res);
        }
    } else {
        r->done = r->len;
        r->state = R_LANDED;
    }
}

/* Reap every completion there is; returns how many. */
static int reap(cpl3_uring *R, batch_t *b) {
    int n = 0;
    if (R->inject == INJ_REPLAY && R->inject_ud && b) {
        uint64_t ud = R->inject_ud;
        R->inject = INJ_NONE;
        R->inject_ud = 0;
        complete(R, b, ud, (int32_t)R->inject_len);
        n++;
    }
    uint32_t head = *R->cq_head, tail = __atomic_load_n(R->cq_tail, __ATOMIC_ACQUIRE);
    while (head != tail) {
        struct io_uring_cqe *c = &R->cqes[head & *R->cq_mask];
        uint64_t ud = c->user_data;
        int32_t res = c->res;
        head++;
        __atomic_store_n(R->cq_head, head, __ATOMIC_RELEASE);
        complete(R, b, ud, res);
        n++;
        if (head == tail) tail = __atomic_load_n(R->cq_tail, __ATOMIC_ACQUIRE);
    }
    return n;
}

static int submit_read(batch_t *b, req_t *r, uint32_t i) {
    cpl3_uring *R = b->R;
    struct io_uring_sqe *s = sqe_get(R);
    if (!s) return 0;
    s->opcode = R->registered ? IORING_OP_READ_FIXED : IORING_OP_READ;
    s->fd = b->fd;
    s->off = r->off + r->done;
    s->addr = (uint64_t)(uintptr_t)(slot_mem(R, r->slot) + r->done);
    s->len = r->len - r->done;
    s->buf_index = 0;
    r->ud = s->user_data = make_ud(b->gen, r->slot, i);
    R->slot_ud[r->slot] = r->ud;
    R->stats[ST_INFLIGHT]++;
    R->stats[ST_READS]++;
    b->flight++;
    r->state = R_FLIGHT;
    if (i == 0 && !r->done) { R->first_ud = r->ud; R->first_len = r->len; }
    return 1;
}

/* Put free slots to work: resubmissions first (they hold slots already), then requests in order. */
static void fill(batch_t *b) {
    cpl3_uring *R = b->R;
    while (b->nresub) {
        if (R->pending >= b->cap || !submit_read(b, &b->reqs[b->resub[b->nresub - 1]], b->resub[b->nresub - 1]))
            return;
        b->nresub--;
    }
    while (b->next < b->nreq) {
        req_t *r = &b->reqs[b->next];
        if (b->failed[r->page]) {
            r->state = R_SKIP;
            b->next++;
            continue;
        }
        if (!R->nfree || R->pending >= b->cap ||
            R->sq_local - __atomic_load_n(R->sq_head, __ATOMIC_ACQUIRE) >= R->sq_entries)
            return;
        r->slot = R->free[--R->nfree];
        r->has_slot = 1;
        submit_read(b, r, b->next++);
    }
}

static void fail_page(batch_t *b, uint32_t p, int32_t status, int32_t detail) {
    if (b->items[p].status == 0) {
        b->items[p].status = status;
        b->items[p].detail = detail;
    }
    b->failed[p] = 1;
    if (b->cur_head >= 0 && b->reqs[b->cur_head].page == p) {
        release(b->R, &b->reqs[b->cur_head]);
        b->cur_head = -1;
    }
}

/* The page's pieces all checked and copied: the head's payload part closes its CRC, then its copy. */
static void finish_page(batch_t *b, uint32_t p) {
    req_t *h = &b->reqs[b->cur_head];
    cpl3_read_item *it = &b->items[p];
    uint64_t part = b->page_bytes - h->start;
    uint8_t *m = slot_mem(b->R, h->slot);
    if (~cpl3_crc32c_raw(b->crc, m, part) != b->want) { fail_page(b, p, CPL3_CRC_MISMATCH, 0); return; }
    if (part) {
        if (!cpl3_gate_enter(b->gate)) { fail_page(b, p, CPL3_CANCELLED, 0); return; }
        cpl3_copy_out((uint8_t *)(uintptr_t)it->dst + h->start, m, part);
        cpl3_gate_leave(b->gate);
    }
    it->status = CPL3_OK;
    release(b->R, h);
    b->cur_head = -1;
}

static int settled(const req_t *r) { return r->state == R_LANDED || r->state == R_FAILED || r->state == R_SKIP; }

/* The next request in order, its read settled. */
static void process(batch_t *b, uint32_t i) {
    req_t *r = &b->reqs[i];
    uint32_t p = r->page;
    cpl3_read_item *it = &b->items[p];
    if (b->failed[p] || r->state != R_LANDED) {
        release(b->R, r);
        if (r->state == R_FAILED) fail_page(b, p, r->status, r->detail);
        return;
    }
    uint8_t *m = slot_mem(b->R, r->slot);
    if (r->head) {
        int32_t detail = 0;
        int rc = cpl3_check_header(m + (b->page_bytes - r->start), b->tag, b->rank, it->slot, b->page_bytes,
                                   it->digest, &b->want, &detail);
        if (rc != CPL3_OK) {
            release(b->R, r);
            fail_page(b, p, rc, detail);
            return;
        }
        b->crc = ~0u;
        b->cur_head = i;  /* keeps its slot: the payload's last part is checksummed after the body */
    } else {
        b->crc = cpl3_crc32c_raw(b->crc, m, r->len);
        if (!cpl3_gate_enter(b->gate)) {
            release(b->R, r);
            fail_page(b, p, CPL3_CANCELLED, 0);
            return;
        }
        cpl3_copy_out((uint8_t *)(uintptr_t)it->dst + r->start, m, r->len);
        cpl3_gate_leave(b->gate);
        release(b->R, r);
    }
    if (r->last) finish_page(b, p);
}

/* The gate closed (or the ring failed): submit nothing more, cancel this batch's reads in the kernel. */
static void begin_close(batch_t *b) {
    cpl3_uring *R = b->R;
    b->closing = 1;
    b->nresub = 0;
    for (uint32_t i = b->next; i < b->nreq; i++) b->reqs[i].state = R_SKIP;
    b->next = b->nreq;
    if (R->inject == INJ_NO_CANCEL) {
        R->inject = INJ_NONE;
        return;
    }
    for (uint32_t i = 0; i < b->nreq; i++) {
        if (b->reqs[i].state != R_FLIGHT) continue;
        struct io_uring_sqe *s = sqe_get(R);
        if (!s) {  /* the SQ is full of what we have not passed on yet: pass it on, then go on */
            enter(R, R->pending, 0, 0);
            if (!(s = sqe_get(R))) break;
        }
        s->opcode = IORING_OP_ASYNC_CANCEL;
        s->fd = -1;
        s->addr = b->reqs[i].ud;
        s->user_data = UD_CANCEL | b->reqs[i].ud;
        R->stats[ST_CANCELS]++;
    }
}

/* Read `n` pages of one slab (fd, O_DIRECT) on this ring: each item's status is set (as
 * cpl3_read_pages does; pages not done when the gate closes are CPL3_CANCELLED). `piece`: bytes per
 * body request, a multiple of 4 KiB with piece + 8 KiB <= the ring's slot_bytes. `drain_s`: how long
 * a closed batch waits for its cancelled reads. Returns the number of good pages; -1 for arguments that
 * break the engine's contract, -2 out of memory (nothing read then); -3 a broken invariant (the batch
 * could neither submit nor wait). */
int cpl3_uring_read(void *ring, int fd, uint32_t tag, uint32_t rank, uint64_t page_bytes, uint64_t extent,
                    cpl3_read_item *items, uint64_t n, uint64_t piece, cpl3_gate *gate, double drain_s) {
    cpl3_uring *R = ring;
    uint64_t body = page_bytes / CPL3_ALIGN * CPL3_ALIGN;
    if (!R || piece == 0 || piece % CPL3_ALIGN || piece + 2 * CPL3_ALIGN > R->slot_bytes || extent % CPL3_ALIGN ||
        extent < page_bytes + CPL3_HEADER_BYTES || extent - body > 2 * CPL3_ALIGN || !(drain_s >= 0))
        return -1;
    uint64_t T = body / piece * piece, per_page = 1 + T / piece;
    if (n > MAX_REQS / per_page) return -1;
    batch_t b;
    memset(&b, 0, sizeof b);
    b.R = R;
    b.nreq = (uint32_t)(n * per_page);
    b.reqs = calloc(b.nreq ? b.nreq : 1, sizeof *b.reqs);
    b.failed = calloc(n ? n : 1, 1);
    b.resub = malloc(R->nslots * sizeof *b.resub);
    if (!b.reqs || !b.failed || !b.resub) {
        free(b.reqs); free(b.failed); free(b.resub);
        return -2;
    }
    b.fd = fd; b.tag = tag; b.rank = rank; b.page_bytes = page_bytes; b.items = items; b.gate = gate;
    b.cur_head = -1;
    b.cap = SUBMIT_BYTES / piece > 2 ? SUBMIT_BYTES / (uint32_t)piece : 2;
    R->gen = (R->gen + 1) & GEN_MASK;
    if (!R->gen) R->gen = 1;
    b.gen = R->gen;
    if (R->inject == INJ_REPLAY) { R->inject_ud = R->first_ud; R->inject_len = R->first_len; }
    for (uint64_t p = 0, k = 0; p < n; p++) {
        items[p].status = 0;
        items[p].detail = 0;
        req_t *h = &b.reqs[k++];
        h->page = (uint32_t)p; h->head = 1; h->start = (uint32_t)T; h->len = (uint32_t)(extent - T);
        h->off = items[p].offset + T;
        for (uint64_t o = 0; o < T; o += piece) {
            req_t *r = &b.reqs[k++];
            r->page = (uint32_t)p; r->start = (uint32_t)o; r->len = (uint32_t)piece; r->off = items[p].offset + o;
        }
        b.reqs[k - 1].last = 1;
    }
    int broken = 0, abort_err = 0;
    double drain_end = 0;
    for (;;) {
        if (!b.closing && __atomic_load_n(&gate->closed, __ATOMIC_SEQ_CST)) {
            begin_close(&b);
            drain_end = now_s() + drain_s;
        }
        if (!b.closing) fill(&b);
        int got = reap(R, &b), moved = 0;
        if (!b.closing) {
            while (b.proc < b.nreq && settled(&b.reqs[b.proc])) { process(&b, b.proc++); moved = 1; }
            if (b.proc == b.nreq) break;
            if (moved) fill(&b);
        } else if (!b.flight || now_s() >= drain_end) {
            break;
        }
        /* More to submit than one enter takes: submit now, wait only once nothing more can go. */
        int more = !b.closing && R->pending >= b.cap && (b.nresub || (b.next < b.nreq && R->nfree));
        int wait = !got && !moved && !more;
        if (!wait && !R->pending) continue;
        if (wait && !R->pending && !R->stats[ST_INFLIGHT]) { broken = 1; break; }  /* nothing could ever come */
        long ns = SLICE_NS;
        if (b.closing) {
            double left = drain_end - now_s();
            ns = left <= 0 ? 0 : left < 1e-2 ? (long)(left * 1e9) + 1 : SLICE_NS;
        }
        int rc = enter(R, R->pending, wait, ns);
        if (rc < 0 && rc != -ETIME && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && !b.closing) {
            abort_err = -rc;  /* the ring itself failed: the pages not done are read errors */
            begin_close(&b);
            drain_end = now_s() + drain_s;
        }
    }
    if (R->pending) enter(R, R->pending, 0, 0);  /* cancels (and reads) filled in but not yet passed on */
    /* Reads still in the kernel keep their slots (release); the rest go back. */
    for (uint32_t i = 0; i < b.nreq; i++) release(R, &b.reqs[i]);
    for (uint64_t p = 0; p < n; p++) {
        if (items[p].status == 0) {
            items[p].status = abort_err ? CPL3_READ_ERROR : CPL3_CANCELLED;
            items[p].detail = abort_err;
        }
    }
    int good = 0;
    for (uint64_t p = 0; p < n; p++) good += items[p].status == CPL3_OK;
    free(b.reqs); free(b.failed); free(b.resub);
    return broken ? -3 : good;
}

/* Close the ring. A read still in the kernel (one no cancel could stop) may land later: its landing
 * memory then stays mapped until the process exits (the kernel finishes the ring on its own). Returns
 * the number of such reads. */
int cpl3_uring_close(void *ring) {
    cpl3_uring *R = ring;
    if (!R) return 0;
    reap(R, NULL);
    int late = (int)R->stats[ST_INFLIGHT];
    ring_unmap(R);
    if (!late) munmap(R->map, R->map_len);
    free(R->slot_ud);
    free(R->free);
    free(R);
    return late;
}

/* Can this process use io_uring? 0, or the errno of the refusal: a ring is set up and a NOP goes
 * through io_uring_enter (a filter may allow one syscall and refuse the other). */
int cpl3_uring_probe(void) {
    int32_t err = 0;
    cpl3_uring *R = cpl3_uring_open(2, CPL3_ALIGN, &err);
    if (!R) return err;
    struct io_uring_sqe *s = sqe_get(R);
    s->opcode = IORING_OP_NOP;
    s->user_data = UD_CANCEL;
    int rc = enter(R, 1, 1, 1000000000L);
    if (rc < 0 && rc != -ETIME) err = -rc;
    else if (reap(R, NULL) != 1) err = ETIME;
    cpl3_uring_close(R);
    return err;
}

void cpl3_uring_stats(void *ring, uint64_t *out, uint64_t n) {
    cpl3_uring *R = ring;
    for (uint64_t i = 0; i < n && i < ST_N; i++) out[i] = i == ST_FREE_SLOTS ? R->nfree : R->stats[i];
}

/* Tests only: fake one fault on this ring's next occasion (INJ_* above). */
void cpl3_uring_test_inject(void *ring, int mode) { ((cpl3_uring *)ring)->inject = mode; }

#else /* no <linux/io_uring.h> with IORING_FEAT_EXT_ARG at build time: the engine reports itself refused */

void *cpl3_uring_open(uint32_t nslots, uint64_t slot_bytes, int32_t *err) {
    (void)nslots; (void)slot_bytes;
    *err = ENOSYS;
    return NULL;
}
int cpl3_uring_read(void *ring, int fd, uint32_t tag, uint32_t rank, uint64_t page_bytes, uint64_t extent,
                    cpl3_read_item *items, uint64_t n, uint64_t piece, cpl3_gate *gate, double drain_s) {
    (void)ring; (void)fd; (void)tag; (void)rank; (void)page_bytes; (void)extent; (void)items; (void)n;
    (void)piece; (void)gate; (void)drain_s;
    return -1;
}
int cpl3_uring_close(void *ring) { (void)ring; return 0; }
int cpl3_uring_probe(void) { return ENOSYS; }
void cpl3_uring_stats(void *ring, uint64_t *out, uint64_t n) { (void)ring; memset(out, 0, n * sizeof *out); }
void cpl3_uring_test_inject(void *ring, int mode) { (void)ring; (void)mode; }

#endif
