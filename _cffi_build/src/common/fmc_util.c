/* Errors, clocks, the buffered socket reader and blocking send/receive helpers, used by every
 * other module. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "fmc_internal.h"

static __thread char fmc_errbuf[512];

void fmc_set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fmc_errbuf, sizeof fmc_errbuf, fmt, ap);
    va_end(ap);
}

const char *fmc_last_error(void) { return fmc_errbuf; }

int64_t fmc_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t fmc_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void fmc_deadline_ts(int64_t timeout_ms, struct timespec *ts)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += timeout_ms / 1000;
    ts->tv_nsec += (timeout_ms % 1000) * 1000000;
    if (ts->tv_nsec >= 1000000000) {
        ts->tv_sec += 1;
        ts->tv_nsec -= 1000000000;
    }
}

void fmc_cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
}

/* ------------------------------------------------------------------ buffered reader */

int fmc_reader_init(fmc_reader *r, int fd, size_t cap)
{
    r->fd = fd;
    r->cap = cap;
    r->max_read = 0;
    r->deadline_ms = 0;
    r->base_timeout_ms = 0;
    r->timed_out = 0;
    r->start = r->end = 0;
    r->buf = malloc(cap);
    return r->buf ? 0 : FMC_ERR_MEMORY;
}

void fmc_reader_free(fmc_reader *r)
{
    free(r->buf);
    r->buf = NULL;
}

/* Bytes one recv may take: the free space, capped by max_read (but at least `need`). */
static size_t reader_room(const fmc_reader *r, size_t need)
{
    size_t room = r->cap - r->end;
    size_t want = r->max_read > need ? r->max_read : need;
    return r->max_read && want < room ? want : room;
}

static void reader_compact(fmc_reader *r)
{
    if (r->start == 0)
        return;
    size_t n = r->end - r->start;
    if (n)
        memmove(r->buf, r->buf + r->start, n);
    r->start = 0;
    r->end = n;
}

/* This thread's stall accounting (fmc_stall_hook_set), and the hook a stall under way began
 * with (called again when it ends).  Blocking calls that wait out their socket's timeout with no
 * byte moved ask stall_goes_on whether to wait again. */
static __thread void (*stall_hook)(int begins);
static __thread void (*stall_begun)(int begins);
static __thread int64_t stall_limit_ms = FMC_STALL_MS;

void fmc_stall_hook_set(void (*hook)(int begins), int64_t limit_ms)
{
    stall_hook = hook;
    stall_limit_ms = hook ? limit_ms : FMC_STALL_MS;
}

/* A blocking socket call waited out the socket's timeout without a byte moving; *since is when
 * that began (0: it just did).  1 while the call should go on waiting (less than the thread's
 * limit so far), and the thread's stall begins then. */
static int stall_goes_on(int64_t *since)
{
    int64_t now = fmc_now_ms();
    if (!*since)
        *since = now;
    if (stall_limit_ms && now - *since >= stall_limit_ms)
        return 0;
    if (stall_hook && !stall_begun) {
        stall_begun = stall_hook;
        stall_begun(1);
    }
    return 1;
}

int fmc_send_stall_goes_on(int64_t *since) { return stall_hook && stall_goes_on(since); }

/* The end of a blocking socket call: a stall it began is over.  Returns rc. */
int fmc_stall_over(int rc)
{
    if (stall_begun) {
        void (*hook)(int) = stall_begun;
        stall_begun = NULL;
        hook(0);
    }
    return rc;
}

/* A blocking recv of the reader that gave up with EAGAIN (served connections and streams have a
 * short receive timeout, so that a pool worker can tell a stall, and the serve pool can park a
 * write whose payload stalls, see fmc_reader_read_region_some) is tried again until the
 * thread's stall limit passes without a byte, or until the reader's deadline (r->timed_out is
 * then set); *since is when the stall began (0: not stalled). */
static int keep_waiting(fmc_reader *r, int64_t *since)
{
    if (errno != EAGAIN && errno != EWOULDBLOCK)
        return 0;
    int64_t now = fmc_now_ms();
    if (r->deadline_ms && now >= r->deadline_ms) {
        r->timed_out = 1;
        return 0;
    }
    return stall_goes_on(since);
}

/* Before a blocking recv of a reader with a deadline: the socket's receive timeout set to what
 * is left of it (a recv that got part of what it waited for returns it at the timeout, and the
 * next one must not wait a whole timeout again).  0 once it has passed (r->timed_out set). */
static int deadline_left(fmc_reader *r)
{
    if (!r->deadline_ms)
        return 1;
    int64_t left = r->deadline_ms - fmc_now_ms();
    if (left <= 0) {
        r->timed_out = 1;
        return 0;
    }
    fmc_socket_timeout(r->fd, SO_RCVTIMEO, left);
    return 1;
}

void fmc_reader_set_deadline(fmc_reader *r, int64_t deadline_ms)
{
    if (!deadline_ms && r->deadline_ms) /* the receive timeout it set goes too */
        fmc_socket_timeout(r->fd, SO_RCVTIMEO, r->base_timeout_ms);
    r->deadline_ms = deadline_ms;
    r->timed_out = 0;
}

static int fill(fmc_reader *r, size_t n);

int fmc_reader_fill(fmc_reader *r, size_t n) { return fmc_stall_over(fill(r, n)); }

static int fill(fmc_reader *r, size_t n)
{
    int64_t since = 0;
    if (n > r->cap)
        return -1;
    if (r->end - r->start >= n)
        return 0;
    if (r->cap - r->start < n)
        reader_compact(r);
    while (r->end - r->start < n) {
        if (!deadline_left(r))
            return -1;
        ssize_t got = recv(r->fd, r->buf + r->end, reader_room(r, n - (r->end - r->start)), 0);
        if (got > 0) {
            r->end += (size_t)got;
            since = 0;
        } else if (got < 0 && (errno == EINTR || keep_waiting(r, &since))) {
            continue;
        } else {
            return -1;
        }
    }
    return 0;
}

int fmc_reader_try_more(fmc_reader *r)
{
    reader_compact(r);
    if (r->end == r->cap)
        return 1;
    for (;;) {
        ssize_t got = recv(r->fd, r->buf + r->end, reader_room(r, 0), MSG_DONTWAIT);
        if (got > 0) {
            r->end += (size_t)got;
            return 1;
        }
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        return -1;
    }
}

/* recv straight into dst until *left bytes came (counting them down): 0; -1 on a broken
 * connection; EFAULT where the kernel could not write dst; with `park`, FMC_READ_PARKED when the
 * socket's receive timeout passed without a byte (see keep_waiting otherwise). */
static int recv_into(fmc_reader *r, uint8_t *dst, size_t *left, int park)
{
    int64_t since = 0;
    while (*left) {
        if (!deadline_left(r))
            return -1;
        ssize_t got = recv(r->fd, dst, *left, MSG_WAITALL);
        if (got > 0) {
            dst += got;
            *left -= (size_t)got;
            since = 0;
        } else if (got < 0 && park && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return FMC_READ_PARKED;
        } else if (got < 0 && (errno == EINTR || keep_waiting(r, &since))) {
            continue;
        } else {
            return got < 0 && errno == EFAULT ? EFAULT : -1;
        }
    }
    return 0;
}

int fmc_reader_read_into(fmc_reader *r, void *dst, size_t n)
{
    size_t have = r->end - r->start;
    size_t take = have < n ? have : n;
    if (take) {
        memcpy(dst, r->buf + r->start, take);
        r->start += take;
    }
    /* The rest is large or not here yet: read it straight into place. */
    size_t left = n - take;
    return fmc_stall_over(recv_into(r, (uint8_t *)dst + take, &left, 0) == 0 ? 0 : -1);
}

/* ---------------------------------------------- checked copies into registered memory */

/* 0: not tried yet; 1: process_vm_writev works on ourselves; -1: the kernel (or a sandbox's
 * seccomp filter) refuses it, and buffered bytes are copied with memcpy, unchecked. */
static int pvm_state;

size_t fmc_copy_checked(void *dst, const void *src, size_t n)
{
    if (__atomic_load_n(&pvm_state, __ATOMIC_RELAXED) >= 0) {
        struct iovec local = {.iov_base = (void *)src, .iov_len = n}, remote = {.iov_base = dst, .iov_len = n};
        ssize_t got = process_vm_writev(getpid(), &local, 1, &remote, 1, 0); /* not cached: fork */
        if (got >= 0 || errno == EFAULT) {
            __atomic_store_n(&pvm_state, 1, __ATOMIC_RELAXED);
            return got > 0 ? (size_t)got : 0;
        }
        if (errno != ENOSYS && errno != EPERM && errno != ESRCH)
            return 0; /* ENOMEM: as refused */
        __atomic_store_n(&pvm_state, -1, __ATOMIC_RELAXED);
    }
    memcpy(dst, src, n);
    return n;
}

/* Drop the n bytes that were meant for memory the kernel refused: FMC_READ_REFUSED, or -1 when
 * the connection broke meanwhile. */
static int refuse_rest(fmc_reader *r, size_t n)
{
    return fmc_reader_skip(r, n) < 0 ? -1 : FMC_READ_REFUSED;
}

/* read_region, and read_region_some when `parked` is given: then a wait for the payload that
 * gives up (the socket's receive timeout) returns FMC_READ_PARKED with *parked bytes landed. */
static int read_region(fmc_reader *r, void *dst, size_t n, size_t *parked)
{
    size_t have = r->end - r->start;
    size_t take = have < n ? have : n;
    if (take) {
        size_t copied = fmc_copy_checked(dst, r->buf + r->start, take);
        r->start += take;
        if (copied < take)
            return refuse_rest(r, n - take);
    }
    size_t left = n - take;
    int rc = recv_into(r, (uint8_t *)dst + take, &left, parked != NULL);
    if (rc == FMC_READ_PARKED)
        *parked = n - left;
    else if (rc == EFAULT) /* TCP leaves bytes it could not copy in the socket (ones copied into
                            * the writable part of a failed chunk count as not received): skip them all */
        return refuse_rest(r, left);
    return rc;
}

int fmc_reader_read_region(fmc_reader *r, void *dst, size_t n) { return fmc_stall_over(read_region(r, dst, n, NULL)); }

int fmc_reader_read_region_some(fmc_reader *r, void *dst, size_t n, size_t *landed)
{
    *landed = n;
    return fmc_stall_over(read_region(r, dst, n, landed));
}

/* Read `want` bytes into the iovecs (consumed): the buffered ones with one checked copy, the
 * rest with scatter recvmsg.  0 when all landed, -1 on a broken connection, FMC_READ_REFUSED
 * when the kernel refused a destination: *done then says how many bytes landed before it, and
 * the bytes from there on are still unread (in the buffer or the socket). */
static int read_iov_until_refused(fmc_reader *r, struct iovec *iov, int iovcnt, size_t *done)
{
    *done = 0;
    size_t have = r->end - r->start;
    if (have && iovcnt > 0) {
        struct iovec remote[FMC_IOV_MAX];
        int k = 0;
        size_t take = 0;
        for (; k < iovcnt && k < FMC_IOV_MAX && take < have; k++) {
            size_t part = iov[k].iov_len < have - take ? iov[k].iov_len : have - take;
            remote[k] = (struct iovec){.iov_base = iov[k].iov_base, .iov_len = part};
            take += part;
        }
        size_t copied = 0;
        if (__atomic_load_n(&pvm_state, __ATOMIC_RELAXED) > 0) {
            struct iovec local = {.iov_base = r->buf + r->start, .iov_len = take};
            ssize_t got = process_vm_writev(getpid(), &local, 1, remote, (unsigned long)k, 0);
            copied = got > 0 ? (size_t)got : 0;
        } else {
            for (int i = 0; i < k; i++) { /* first use, or no process_vm_writev: one by one */
                size_t c = fmc_copy_checked(remote[i].iov_base, r->buf + r->start + copied, remote[i].iov_len);
                copied += c;
                if (c < remote[i].iov_len)
                    break;
            }
        }
        r->start += copied;
        *done += copied;
        fmc_iov_advance(&iov, &iovcnt, copied);
        if (copied < take)
            return FMC_READ_REFUSED;
    }
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    int64_t since = 0;
    while (iovcnt > 0) {
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)(iovcnt < FMC_IOV_MAX ? iovcnt : FMC_IOV_MAX);
        if (!deadline_left(r))
            return -1;
        ssize_t got = recvmsg(r->fd, &msg, MSG_WAITALL);
        if (got < 0 && (errno == EINTR || keep_waiting(r, &since)))
            continue;
        since = 0;
        if (got < 0 && errno == EFAULT)
            return FMC_READ_REFUSED;
        if (got <= 0)
            return -1;
        *done += (size_t)got;
        fmc_iov_advance(&iov, &iovcnt, (size_t)got);
    }
    return 0;
}

static int read_regions(fmc_reader *r, const struct iovec *iov, int iovcnt, uint8_t *refused);

int fmc_reader_read_regions(fmc_reader *r, const struct iovec *iov, int iovcnt, uint8_t *refused)
{
    return fmc_stall_over(read_regions(r, iov, iovcnt, refused));
}

static int read_regions(fmc_reader *r, const struct iovec *iov, int iovcnt, uint8_t *refused)
{
    struct iovec run[FMC_IOV_MAX];
    int i = 0;       /* the first entry not wholly landed */
    size_t off = 0;  /* bytes of it that did */
    if (iovcnt > FMC_IOV_MAX)
        return -1;
    memset(refused, 0, (size_t)iovcnt);
    while (i < iovcnt) {
        /* All the entries left, merged where they continue one another (one page-table walk
         * per range for the kernel). */
        int n = 0;
        for (int j = i; j < iovcnt; j++)
            run[n++] = j == i ? (struct iovec){.iov_base = (uint8_t *)iov[j].iov_base + off, .iov_len = iov[j].iov_len - off}
                              : iov[j];
        n = fmc_iov_merge(run, n);
        size_t done = 0;
        int rc = read_iov_until_refused(r, run, n, &done);
        if (rc <= 0)
            return rc;
        /* Refused somewhere at or after `done` bytes: entries wholly before it landed.  The
         * kernel may report the refusal a little before the refused entry (a chunk of the
         * socket's data spanning two destinations fails whole), so the entry holding that point
         * is read on its own: it is refused only if it fails alone. */
        done += off;
        while (i < iovcnt && done >= iov[i].iov_len) {
            done -= iov[i].iov_len;
            i++;
        }
        if (i == iovcnt)
            return 0;
        rc = fmc_reader_read_region(r, (uint8_t *)iov[i].iov_base + done, iov[i].iov_len - done);
        if (rc < 0)
            return -1;
        refused[i] = rc == FMC_READ_REFUSED;
        i++;
        off = 0;
    }
    return 0;
}

static int skip(fmc_reader *r, size_t n);

int fmc_reader_skip(fmc_reader *r, size_t n) { return fmc_stall_over(skip(r, n)); }

static int skip(fmc_reader *r, size_t n)
{
    int64_t since = 0;
    while (n) {
        size_t have = r->end - r->start;
        if (have == 0) {
            r->start = r->end = 0;
            if (!deadline_left(r))
                return -1;
            ssize_t got = recv(r->fd, r->buf, r->cap, 0);
            if (got < 0 && (errno == EINTR || keep_waiting(r, &since)))
                continue;
            since = 0;
            if (got <= 0)
                return -1;
            r->end = (size_t)got;
            continue;
        }
        size_t take = have < n ? have : n;
        r->start += take;
        n -= take;
    }
    return 0;
}

/* ------------------------------------------------------------------ blocking I/O */

void fmc_socket_timeout(int fd, int optname, int64_t ms)
{
    struct timeval tv = {.tv_sec = (time_t)(ms / 1000), .tv_usec = (suseconds_t)(ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, optname, &tv, sizeof tv);
}

int64_t fmc_socket_timeout_get(int fd, int optname)
{
    struct timeval tv = {0};
    socklen_t len = sizeof tv;
    if (getsockopt(fd, SOL_SOCKET, optname, &tv, &len) != 0)
        return 0;
    return (int64_t)tv.tv_sec * 1000 + tv.tv_usec / 1000;
}

/* Skip the n bytes a partial sendmsg (or vmsplice) took. */
void fmc_iov_advance(struct iovec **iovp, int *iovcnt, size_t n)
{
    struct iovec *iov = *iovp;
    while (*iovcnt > 0 && n >= iov->iov_len) {
        n -= iov->iov_len;
        iov++;
        (*iovcnt)--;
    }
    if (*iovcnt > 0 && n) {
        iov->iov_base = (uint8_t *)iov->iov_base + n;
        iov->iov_len -= n;
    }
    *iovp = iov;
}

int fmc_iov_merge(struct iovec *iov, int iovcnt)
{
    int m = 0;
    for (int i = 0; i < iovcnt; i++) {
        if (m > 0 && (uint8_t *)iov[m - 1].iov_base + iov[m - 1].iov_len == (uint8_t *)iov[i].iov_base)
            iov[m - 1].iov_len += iov[i].iov_len;
        else
            iov[m++] = iov[i];
    }
    return m;
}

/* The one sendmsg loop: sends every iovec (consuming iov), again after EINTR and partial sends.
 * deadline_ms < 0: blocking sends.  Otherwise each sendmsg is non-blocking and a full socket is
 * waited for in poll() until deadline_ms (fmc_now_ms clock): -2 once it passed.  -1 on error. */
static int sendv_until(int fd, struct iovec *iov, int iovcnt, int flags, int64_t deadline_ms);

/* Without a deadline a send blocks; on a socket with a send timeout (a served connection's or a
 * stream's), a timeout that passes with no byte taken is a stall, waited on until the thread's
 * stall limit on a thread with a stall hook (fmc_send_stall_goes_on). */
static int sendv_loop(int fd, struct iovec *iov, int iovcnt, int flags, int64_t deadline_ms)
{
    return fmc_stall_over(sendv_until(fd, iov, iovcnt, flags, deadline_ms));
}

static int sendv_until(int fd, struct iovec *iov, int iovcnt, int flags, int64_t deadline_ms)
{
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    int64_t since = 0;
    if (deadline_ms >= 0)
        flags |= MSG_DONTWAIT;
    while (iovcnt > 0) {
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)iovcnt;
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | flags);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return -1;
            if (deadline_ms < 0) {
                if (fmc_send_stall_goes_on(&since))
                    continue;
                return -1;
            }
            int64_t left = deadline_ms - fmc_now_ms();
            struct pollfd pfd = {.fd = fd, .events = POLLOUT};
            if (left <= 0 || poll(&pfd, 1, (int)(left > 1000 ? 1000 : left)) < 0)
                return left <= 0 ? -2 : -1;
            continue;
        }
        since = 0;
        fmc_iov_advance(&iov, &iovcnt, (size_t)n);
    }
    return 0;
}

int fmc_send_all(int fd, const void *buf, size_t len)
{
    struct iovec v = {.iov_base = (void *)buf, .iov_len = len};
    return len ? sendv_loop(fd, &v, 1, 0, -1) : 0;
}

int fmc_sendv_flags(int fd, struct iovec *iov, int iovcnt, int flags, int64_t deadline_ms)
{
    return sendv_loop(fd, iov, iovcnt, flags, deadline_ms);
}

int fmc_sendv_all(int fd, struct iovec *iov, int iovcnt) { return sendv_loop(fd, iov, iovcnt, 0, -1); }

int fmc_socket_reset(int fd)
{
    struct pollfd pfd = {.fd = fd, .events = 0};
    return poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLERR | POLLHUP));
}

int fmc_sendv_nowait(int fd, struct iovec **iov, int *iovcnt)
{
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    while (*iovcnt > 0) {
        msg.msg_iov = *iov;
        msg.msg_iovlen = (size_t)*iovcnt;
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
        }
        fmc_iov_advance(iov, iovcnt, (size_t)n);
    }
    return 0;
}

int fmc_recv_all(int fd, void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len) {
        ssize_t n = recv(fd, p, len, MSG_WAITALL);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            return -1;
        }
    }
    return 0;
}

/* CPUs this process may run on (its affinity mask, else the online ones). */
int fmc_usable_cpus(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int)online : 1;
}

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

int fmc_pidfd_open(int pid) { return (int)syscall(SYS_pidfd_open, pid, 0); }

int fmc_pidfd_getfd(int pidfd, int fd) { return (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0); }

/* The engine's spin_us: how long waiters poll before they sleep. */
int fmc_spin_us(const fmc_engine *e) { return e->opts.spin_us; }

/* Only small transfers are worth polling for.  A larger one takes a few hundred microseconds
 * or more, so one wake-up is a small share of it, while a poll that yields the CPU over and over
 * takes turns from the very threads moving its bytes when cores are few: on the 2-core VM,
 * polling after 4 MiB batches cost 10-30 % of their throughput (three times as many context
 * switches as sleeping). */
int fmc_spin_us_after(const fmc_engine *e, uint64_t bytes)
{
    return bytes <= FMC_SMALL_TRANSFER_BYTES ? fmc_spin_us(e) : 0;
}
