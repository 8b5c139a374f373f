/* Power-loss model for the L3 crash test (LD_PRELOAD into the writer process; test only).
 *
 * SIGKILL keeps the page cache and whatever the device accepted, so a kill alone cannot tell a store
 * that flushes from one that does not. This shim sits under every write of the files it tracks (the
 * slabs and LMDB's data.mdb, by path suffix) at the libc boundary, so it sees the Python store's
 * pwritev/fdatasync and LMDB's own pwrite/writev/fdatasync alike. Before each write it appends an undo
 * record (the bytes it is about to overwrite, and the file size) to a journal; when fdatasync/fsync of
 * the file returns 0 it appends which writes that flush covered: those that had completed before the
 * flush began. Writes through an O_DSYNC/O_SYNC descriptor are covered when they return. A file created
 * by an open is covered once its directory is fsynced. After the SIGKILL the harness undoes every write
 * and creation no flush covered (l3_powerloss.py), which is what a power loss may do.
 *
 * Environment: L3_POWERLOSS_JOURNAL=<file> (required), L3_POWERLOSS_MATCH=<suffix>,<suffix>,...
 *
 * Journal records (little endian): header {u32 magic 'PLJ1', u32 type, u64 id, u64 dev, u64 ino,
 * i64 a, i64 b, i64 c, u32 extra_len, u32 pad} followed by extra_len bytes:
 *   W (1): a=offset, b=length, c=file size before; extra = old bytes of [a, min(a+b, c))
 *   T (2): a=old size, b=new size (ftruncate/posix_fallocate); extra = old bytes of [b, a) if shrinking
 *   S (3): extra = u64 ids of the writes this flush of (dev, ino) covered
 *   C (4): dev/ino of the parent directory; extra = the created file's absolute path
 *   D (5): fsync of the directory (dev, ino) returned 0
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAGIC 0x314a4c50u
#define MAX_FD 65536
#define MAX_INODES 256
#define MAX_SHRINK (64L << 20)

struct rec {
    uint32_t magic, type;
    uint64_t id, dev, ino;
    int64_t a, b, c;
    uint32_t extra_len, pad;
};

struct inode {
    dev_t dev;
    ino_t ino;
    int rfd;            /* buffered read-only fd: reads the bytes a write is about to replace */
    uint64_t *done;     /* ids of completed writes no flush has covered yet */
    size_t ndone, cap;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int jfd = -2;
static uint64_t next_id = 1;
static struct inode inodes[MAX_INODES];
static int ninodes;
static short fd_inode[MAX_FD];      /* inode index + 1; 0: untracked */
static char fd_dsync[MAX_FD];
static char match[1024];

#define REAL(name) static __typeof__(name) *real_##name; if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)

static int real_open_(const char *p, int flags, mode_t m) {
    static int (*f)(const char *, int, ...);
    if (!f) f = dlsym(RTLD_NEXT, "open");
    return f(p, flags, m);
}

static ssize_t real_write_(int fd, const void *b, size_t n) {
    static ssize_t (*f)(int, const void *, size_t);
    if (!f) f = dlsym(RTLD_NEXT, "write");
    return f(fd, b, n);
}

static void die(const char *what) {
    char msg[256];
    int n = snprintf(msg, sizeof msg, "l3_powerloss: %s (errno %d)\n", what, errno);
    real_write_(2, msg, n > 0 ? (size_t)n : 0);
    abort();
}

static void init_locked(void) {
    if (jfd != -2) return;
    const char *j = getenv("L3_POWERLOSS_JOURNAL");
    const char *m = getenv("L3_POWERLOSS_MATCH");
    snprintf(match, sizeof match, "%s", m ? m : ".slab,/data.mdb");
    jfd = -1;
    if (j && *j) {
        jfd = real_open_(j, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (jfd < 0) die("cannot open the journal");
    }
}

static void put_all(const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t w = real_write_(jfd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) die("journal write failed");
        p += w;
        n -= (size_t)w;
    }
}

static void emit(uint32_t type, uint64_t id, uint64_t dev, uint64_t ino, int64_t a, int64_t b, int64_t c,
                 const void *extra, uint32_t elen) {
    struct rec r = {MAGIC, type, id, dev, ino, a, b, c, elen, 0};
    char *buf = malloc(sizeof r + elen);
    if (!buf) die("out of memory");
    memcpy(buf, &r, sizeof r);
    if (elen) memcpy(buf + sizeof r, extra, elen);
    put_all(buf, sizeof r + elen);  /* one write per record: a torn record can only be the last */
    free(buf);
}

static int matches(const char *path) {
    size_t pl = strlen(path);
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%s", match);
    for (char *save = NULL, *s = strtok_r(tmp, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
        size_t sl = strlen(s);
        if (sl && pl >= sl && !strcmp(path + pl - sl, s)) return 1;
    }
    return 0;
}

static void track_open(const char *path, int flags, int fd, int created) {
    if (fd < 0 || fd >= MAX_FD) return;
    pthread_mutex_lock(&mu);
    init_locked();
    fd_inode[fd] = 0;
    if (jfd < 0 || !matches(path)) goto out;
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) goto out;
    int k;
    for (k = 0; k < ninodes; k++)
        if (inodes[k].dev == st.st_dev && inodes[k].ino == st.st_ino) break;
    if (k == ninodes) {
        if (ninodes == MAX_INODES) die("too many tracked files");
        int rfd = real_open_(path, O_RDONLY | O_CLOEXEC, 0);
        if (rfd < 0) die("cannot reopen a tracked file for reading");
        inodes[k] = (struct inode){st.st_dev, st.st_ino, rfd, NULL, 0, 0};
        ninodes++;
    }
    fd_inode[fd] = (short)(k + 1);
    fd_dsync[fd] = (flags & O_DSYNC) != 0;  /* O_SYNC includes the O_DSYNC bit */
    if (created) {
        char abs[PATH_MAX], dir[PATH_MAX];
        struct stat ds;
        if (!realpath(path, abs)) die("realpath of a created file");
        snprintf(dir, sizeof dir, "%s", abs);
        *strrchr(dir, '/') = 0;
        if (stat(dir[0] ? dir : "/", &ds)) die("stat of a created file's directory");
        emit(4, next_id++, ds.st_dev, ds.st_ino, 0, 0, 0, abs, (uint32_t)strlen(abs));
    }
out:
    pthread_mutex_unlock(&mu);
}

/* Before a write of [off, off+len) to fd: journal the old bytes. Returns the write's id, 0 if untracked. */
static uint64_t before_write(int fd, int64_t off, int64_t len) {
    if (fd < 0 || fd >= MAX_FD || !fd_inode[fd]) return 0;
    pthread_mutex_lock(&mu);
    struct inode *in = &inodes[fd_inode[fd] - 1];
    struct stat st;
    if (fstat(in->rfd, &st)) die("fstat of a tracked file");
    int64_t avail = st.st_size > off ? st.st_size - off : 0;
    if (avail > len) avail = len;
    char *old = avail ? malloc((size_t)avail) : NULL;
    if (avail && !old) die("out of memory");
    for (int64_t got = 0; got < avail;) {
        ssize_t r = pread(in->rfd, old + got, (size_t)(avail - got), off + got);
        if (r <= 0) die("cannot read the bytes a write replaces");
        got += r;
    }
    uint64_t id = next_id++;
    emit(1, id, in->dev, in->ino, off, len, st.st_size, old, (uint32_t)avail);
    free(old);
    pthread_mutex_unlock(&mu);
    return id;
}

static void covered_locked(struct inode *in, const uint64_t *ids, size_t n) {
    if (n) emit(3, 0, in->dev, in->ino, 0, 0, 0, ids, (uint32_t)(n * sizeof *ids));
}

static void after_write(int fd, uint64_t id) {
    if (!id) return;
    pthread_mutex_lock(&mu);
    if (fd_inode[fd]) {
        struct inode *in = &inodes[fd_inode[fd] - 1];
        if (fd_dsync[fd]) {
            covered_locked(in, &id, 1);
        } else {
            if (in->ndone == in->cap) {
                in->cap = in->cap ? 2 * in->cap : 1024;
                in->done = realloc(in->done, in->cap * sizeof *in->done);
                if (!in->done) die("out of memory");
            }
            in->done[in->ndone++] = id;
        }
    }
    pthread_mutex_unlock(&mu);
}

static int64_t iov_len(const struct iovec *iov, int n) {
    int64_t s = 0;
    for (int i = 0; i < n; i++) s += (int64_t)iov[i].iov_len;
    return s;
}

/* ---------------------------------------------------------------- opens */

static int open_common(const char *name, int dirfd, const char *path, int flags, mode_t mode) {
    int existed = 1;
    if (flags & O_CREAT) {
        struct stat st;
        existed = fstatat(dirfd, path, &st, AT_SYMLINK_NOFOLLOW) == 0;
    }
    int (*f)(int, const char *, int, ...) = NULL;
    int (*g)(const char *, int, ...) = NULL;
    int fd;
    if (dirfd == AT_FDCWD && strncmp(name, "openat", 6)) {
        g = dlsym(RTLD_NEXT, name);
        fd = g(path, flags, mode);
    } else {
        f = dlsym(RTLD_NEXT, name);
        fd = f(dirfd, path, flags, mode);
    }
    if (fd >= 0) {
        int saved = errno;
        char full[2 * PATH_MAX + 2];
        if (dirfd != AT_FDCWD && path[0] != '/') {
            char link[64], dir[PATH_MAX];
            snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
            ssize_t n = readlink(link, dir, sizeof dir - 1);
            dir[n > 0 ? n : 0] = 0;
            snprintf(full, sizeof full, "%s/%s", dir, path);
        } else {
            snprintf(full, sizeof full, "%s", path);
        }
        track_open(full, flags, fd, !existed);
        errno = saved;
    }
    return fd;
}

#define MODE_ARG mode_t mode = 0; if (flags & (O_CREAT | __O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }

int open(const char *path, int flags, ...) { MODE_ARG return open_common("open", AT_FDCWD, path, flags, mode); }
int open64(const char *path, int flags, ...) { MODE_ARG return open_common("open64", AT_FDCWD, path, flags, mode); }
int openat(int d, const char *path, int flags, ...) { MODE_ARG return open_common("openat", d, path, flags, mode); }
int openat64(int d, const char *path, int flags, ...) { MODE_ARG return open_common("openat64", d, path, flags, mode); }

int close(int fd) {
    REAL(close);
    if (fd >= 0 && fd < MAX_FD && fd_inode[fd]) {
        pthread_mutex_lock(&mu);
        fd_inode[fd] = 0;
        pthread_mutex_unlock(&mu);
    }
    return real_close(fd);
}

/* ---------------------------------------------------------------- writes */

ssize_t pwrite(int fd, const void *b, size_t n, off_t off) {
    REAL(pwrite);
    uint64_t id = before_write(fd, off, (int64_t)n);
    ssize_t r = real_pwrite(fd, b, n, off);
    after_write(fd, id);
    return r;
}

ssize_t pwrite64(int fd, const void *b, size_t n, off_t off) {
    REAL(pwrite64);
    uint64_t id = before_write(fd, off, (int64_t)n);
    ssize_t r = real_pwrite64(fd, b, n, off);
    after_write(fd, id);
    return r;
}

ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) {
    REAL(pwritev);
    uint64_t id = before_write(fd, off, iov_len(iov, cnt));
    ssize_t r = real_pwritev(fd, iov, cnt, off);
    after_write(fd, id);
    return r;
}

ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off_t off) {
    REAL(pwritev64);
    uint64_t id = before_write(fd, off, iov_len(iov, cnt));
    ssize_t r = real_pwritev64(fd, iov, cnt, off);
    after_write(fd, id);
    return r;
}

ssize_t pwritev2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) {
    REAL(pwritev2);
    uint64_t id = off >= 0 ? before_write(fd, off, iov_len(iov, cnt))
                           : before_write(fd, lseek(fd, 0, SEEK_CUR), iov_len(iov, cnt));
    if (flags & (RWF_DSYNC | RWF_SYNC)) die("RWF_DSYNC is not modelled");
    ssize_t r = real_pwritev2(fd, iov, cnt, off, flags);
    after_write(fd, id);
    return r;
}

ssize_t pwritev64v2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) {
    REAL(pwritev64v2);
    uint64_t id = off >= 0 ? before_write(fd, off, iov_len(iov, cnt))
                           : before_write(fd, lseek(fd, 0, SEEK_CUR), iov_len(iov, cnt));
    if (flags & (RWF_DSYNC | RWF_SYNC)) die("RWF_DSYNC is not modelled");
    ssize_t r = real_pwritev64v2(fd, iov, cnt, off, flags);
    after_write(fd, id);
    return r;
}

static int64_t cur_offset(int fd) {
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0 && (fl & O_APPEND)) {
        struct stat st;
        return fstat(fd, &st) ? 0 : st.st_size;
    }
    return lseek(fd, 0, SEEK_CUR);
}

ssize_t write(int fd, const void *b, size_t n) {
    REAL(write);
    if (fd < 0 || fd >= MAX_FD || !fd_inode[fd]) return real_write(fd, b, n);
    uint64_t id = before_write(fd, cur_offset(fd), (int64_t)n);
    ssize_t r = real_write(fd, b, n);
    after_write(fd, id);
    return r;
}

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    REAL(writev);
    if (fd < 0 || fd >= MAX_FD || !fd_inode[fd]) return real_writev(fd, iov, cnt);
    uint64_t id = before_write(fd, cur_offset(fd), iov_len(iov, cnt));
    ssize_t r = real_writev(fd, iov, cnt);
    after_write(fd, id);
    return r;
}

/* Size changes: journal the old size (and the bytes a shrink drops). */
static uint64_t before_resize(int fd, int64_t new_size, int grow_only) {
    if (fd < 0 || fd >= MAX_FD || !fd_inode[fd]) return 0;
    pthread_mutex_lock(&mu);
    struct inode *in = &inodes[fd_inode[fd] - 1];
    struct stat st;
    if (fstat(in->rfd, &st)) die("fstat of a tracked file");
    if (grow_only && new_size < st.st_size) new_size = st.st_size;
    char *old = NULL;
    int64_t drop = st.st_size > new_size ? st.st_size - new_size : 0;
    if (drop > MAX_SHRINK) die("shrink too large to journal");
    if (drop) {
        old = malloc((size_t)drop);
        if (!old) die("out of memory");
        for (int64_t got = 0; got < drop;) {
            ssize_t r = pread(in->rfd, old + got, (size_t)(drop - got), new_size + got);
            if (r <= 0) die("cannot read the bytes a shrink drops");
            got += r;
        }
    }
    uint64_t id = next_id++;
    emit(2, id, in->dev, in->ino, st.st_size, new_size, 0, old, (uint32_t)drop);
    free(old);
    pthread_mutex_unlock(&mu);
    return id;
}

int ftruncate(int fd, off_t len) {
    REAL(ftruncate);
    uint64_t id = before_resize(fd, len, 0);
    int r = real_ftruncate(fd, len);
    after_write(fd, id);
    return r;
}

int ftruncate64(int fd, off_t len) {
    REAL(ftruncate64);
    uint64_t id = before_resize(fd, len, 0);
    int r = real_ftruncate64(fd, len);
    after_write(fd, id);
    return r;
}

int posix_fallocate(int fd, off_t off, off_t len) {
    REAL(posix_fallocate);
    uint64_t id = before_resize(fd, off + len, 1);
    int r = real_posix_fallocate(fd, off, len);
    after_write(fd, id);
    return r;
}

int posix_fallocate64(int fd, off_t off, off_t len) {
    REAL(posix_fallocate64);
    uint64_t id = before_resize(fd, off + len, 1);
    int r = real_posix_fallocate64(fd, off, len);
    after_write(fd, id);
    return r;
}

/* ---------------------------------------------------------------- flushes */

static int flush(int fd, int (*real)(int)) {
    struct stat st;
    if (fd >= 0 && fd < MAX_FD && !fd_inode[fd] && !fstat(fd, &st) && S_ISDIR(st.st_mode)) {
        int r = real(fd);
        if (!r) {
            pthread_mutex_lock(&mu);
            init_locked();
            if (jfd >= 0) emit(5, 0, st.st_dev, st.st_ino, 0, 0, 0, NULL, 0);
            pthread_mutex_unlock(&mu);
        }
        return r;
    }
    if (fd < 0 || fd >= MAX_FD || !fd_inode[fd]) return real(fd);
    /* The flush covers the writes that completed before it began. */
    pthread_mutex_lock(&mu);
    struct inode *in = &inodes[fd_inode[fd] - 1];
    size_t n = in->ndone;
    uint64_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) die("out of memory");
    memcpy(ids, in->done, n * sizeof *ids);
    in->ndone = 0;
    pthread_mutex_unlock(&mu);
    int r = real(fd);
    pthread_mutex_lock(&mu);
    if (!r) {
        covered_locked(in, ids, n);
    } else {  /* a failed flush covers nothing: those writes stay unflushed */
        for (size_t i = 0; i < n; i++) {
            if (in->ndone == in->cap) {
                in->cap = in->cap ? 2 * in->cap : 1024;
                in->done = realloc(in->done, in->cap * sizeof *in->done);
                if (!in->done) die("out of memory");
            }
            in->done[in->ndone++] = ids[i];
        }
    }
    pthread_mutex_unlock(&mu);
    free(ids);
    return r;
}

int fsync(int fd) { REAL(fsync); return flush(fd, real_fsync); }
int fdatasync(int fd) { REAL(fdatasync); return flush(fd, real_fdatasync); }
