/* The write path's pwritev of a group of runs (sglang_cp/l3/writer.py): each run of consecutive slots is
 * one pwritev, and a group of runs is one call. One call is one GIL release through ctypes for the whole
 * group: beside a Python thread that never pauses (a GPU server's scheduler) each return from the
 * kernel costs an I/O thread up to CPython's switch interval (5 ms by default) to get the GIL back, and
 * with GLM-5's 5.75 MB pages a run is one page, so page-by-page pwrites left the drive idle for part of
 * every write. The outcome of each run is its own: a failed run does not stop the ones after it (the
 * caller retries a failed run page by page, so one bad sector fails only its page). */
#include <errno.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "cpl3_native.h"

void cpl3_write_runs(int fd, uint64_t n, const uint64_t *offsets, const uint64_t *iov_counts,
                     const struct iovec *iovs, int64_t *results) {
    const struct iovec *iov = iovs;
    for (uint64_t i = 0; i < n; i++) {
        ssize_t r;
        do {
            r = pwritev(fd, iov, (int)iov_counts[i], (off_t)offsets[i]);
        } while (r < 0 && errno == EINTR);
        /* bytes written (the caller compares with the run's size: a short write fails the run), or -errno */
        results[i] = r < 0 ? -(int64_t)errno : (int64_t)r;
        iov += iov_counts[i];
    }
}
