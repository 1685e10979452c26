/* Errors, clocks, the buffered socket reader and blocking send/receive helpers, used by every
 * other module. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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

int fmc_reader_fill(fmc_reader *r, size_t n)
{
    if (n > r->cap)
        return -1;
    if (r->end - r->start >= n)
        return 0;
    if (r->cap - r->start < n)
        reader_compact(r);
    while (r->end - r->start < n) {
        ssize_t got = recv(r->fd, r->buf + r->end, reader_room(r, n - (r->end - r->start)), 0);
        if (got > 0) {
            r->end += (size_t)got;
        } else if (got < 0 && errno == EINTR) {
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

int fmc_reader_read_into(fmc_reader *r, void *dst, size_t n)
{
    size_t have = r->end - r->start;
    size_t take = have < n ? have : n;
    if (take) {
        memcpy(dst, r->buf + r->start, take);
        r->start += take;
    }
    if (take == n)
        return 0;
    /* The rest is large or not here yet: read it straight into place. */
    return fmc_recv_all(r->fd, (uint8_t *)dst + take, n - take);
}

int fmc_reader_read_iov(fmc_reader *r, struct iovec *iov, int iovcnt)
{
    iovcnt = fmc_iov_merge(iov, iovcnt);
    while (iovcnt > 0 && r->end > r->start) {
        size_t take = r->end - r->start < iov->iov_len ? r->end - r->start : iov->iov_len;
        memcpy(iov->iov_base, r->buf + r->start, take);
        r->start += take;
        fmc_iov_advance(&iov, &iovcnt, take);
    }
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    while (iovcnt > 0) {
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)(iovcnt < FMC_IOV_MAX ? iovcnt : FMC_IOV_MAX);
        ssize_t got = recvmsg(r->fd, &msg, MSG_WAITALL);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return -1;
        fmc_iov_advance(&iov, &iovcnt, (size_t)got);
    }
    return 0;
}

int fmc_reader_skip(fmc_reader *r, size_t n)
{
    while (n) {
        size_t have = r->end - r->start;
        if (have == 0) {
            r->start = r->end = 0;
            ssize_t got = recv(r->fd, r->buf, r->cap, 0);
            if (got < 0 && errno == EINTR)
                continue;
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
static int sendv_loop(int fd, struct iovec *iov, int iovcnt, int flags, int64_t deadline_ms)
{
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    if (deadline_ms >= 0)
        flags |= MSG_DONTWAIT;
    while (iovcnt > 0) {
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)iovcnt;
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | flags);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (deadline_ms < 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
                return -1;
            int64_t left = deadline_ms - fmc_now_ms();
            struct pollfd pfd = {.fd = fd, .events = POLLOUT};
            if (left <= 0 || poll(&pfd, 1, (int)(left > 1000 ? 1000 : left)) < 0)
                return left <= 0 ? -2 : -1;
            continue;
        }
        fmc_iov_advance(&iov, &iovcnt, (size_t)n);
    }
    return 0;
}

int fmc_send_all(int fd, const void *buf, size_t len)
{
    struct iovec v = {.iov_base = (void *)buf, .iov_len = len};
    return len ? sendv_loop(fd, &v, 1, 0, -1) : 0;
}

int fmc_sendv_flags(int fd, struct iovec *iov, int iovcnt, int flags) { return sendv_loop(fd, iov, iovcnt, flags, -1); }

int fmc_sendv_all(int fd, struct iovec *iov, int iovcnt) { return sendv_loop(fd, iov, iovcnt, 0, -1); }

int fmc_socket_reset(int fd)
{
    struct pollfd pfd = {.fd = fd, .events = 0};
    return poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLERR | POLLHUP));
}

int fmc_sendv_deadline(int fd, struct iovec *iov, int iovcnt, int64_t deadline_ms)
{
    return sendv_loop(fd, iov, iovcnt, 0, deadline_ms < 0 ? 0 : deadline_ms);
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
