/* Zero-copy sends: vmsplice the payload pages into a pipe, splice the pipe into the socket.
 * The socket then holds references to those pages instead of a copy, and the receiver's recv
 * copies straight out of them: one copy per byte on loopback instead of two, 20-35 % more
 * throughput for large transfers on a small machine.
 *
 * The pages are read when the receiver copies them, after the send returned, so a caller may
 * only hand over memory that stays put until the receiver has its copy:
 * - write payloads (fmc_stream.c): the caller leaves its source alone until the call completes,
 *   and completion comes only after the target has read every byte;
 * - read answers (fmc_server.c): the target keeps the regions pinned until the initiator
 *   acknowledges the answers, and resets the connection before letting unacknowledged ones go
 *   (the protocol is in fmc_wire.h).
 * GPU sources (their staging buffer is reused by the next round) and rounds with little payload
 * (three syscalls instead of one do not pay off) are copied.  A vector's small payloads go
 * through the pipe together, one vmsplice for as many as it holds.
 *
 * Where the kernel refuses (no vmsplice in a sandbox, a socket type splice cannot feed), the
 * first failure turns the feature off for the process and the bytes go out with sendmsg.
 * An engine's zerocopy option (FLAGCX_MC_ZEROCOPY=0) turns it off for that engine.  Connections to
 * other hosts always copy: over a lossy, reordering link zero-copy sends cost twice the spurious
 * retransmissions (fmc_stream.c, stream_zc). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "fmc_internal.h"

#define ZC_PIPE_BYTES (1 << 20) /* the most a pipe takes unprivileged (fs.pipe-max-size) */

static int zc_state; /* 0: usable so far; -1: the kernel refused, off for the process */

int fmc_zc_usable(void) { return __atomic_load_n(&zc_state, __ATOMIC_RELAXED) >= 0; }

int fmc_zc_enabled(const fmc_engine *e) { return e->opts.zerocopy && fmc_zc_usable(); }

static void zc_turn_off(void) { __atomic_store_n(&zc_state, -1, __ATOMIC_RELAXED); }

static int unsupported(int err) { return err == EINVAL || err == ENOSYS || err == EOPNOTSUPP || err == EBADF; }

/* Zero-copy sends go through a pipe of the sending thread (an I/O or serve pool worker, or a
 * caller sending inline), not of the connection: helper fds follow the threads, which the pools
 * bound, not the peers.  A send that succeeded leaves the pipe empty; one that failed may leave
 * pages in it, so it is closed then (and opened again on next use); it is closed when its
 * thread ends. */
static __thread int thread_pipe[2] = {-1, -1};
static pthread_key_t thread_pipe_key;
static pthread_once_t thread_pipe_once = PTHREAD_ONCE_INIT;

static void pipe_close(int pipefd[2])
{
    for (int i = 0; i < 2; i++)
        if (pipefd[i] >= 0) {
            close(pipefd[i]);
            pipefd[i] = -1;
        }
}

static void thread_pipe_close(void *unused)
{
    (void)unused;
    pipe_close(thread_pipe);
}

static void thread_pipe_key_make(void) { pthread_key_create(&thread_pipe_key, thread_pipe_close); }

static int pipe_ready(int pipefd[2])
{
    if (pipefd[0] >= 0)
        return 1;
    if (pipe2(pipefd, O_CLOEXEC) != 0) {
        pipefd[0] = pipefd[1] = -1;
        return 0;
    }
    fcntl(pipefd[1], F_SETPIPE_SZ, ZC_PIPE_BYTES); /* a smaller pipe only costs more syscalls */
    pthread_once(&thread_pipe_once, thread_pipe_key_make);
    pthread_setspecific(thread_pipe_key, pipefd); /* non-NULL: the destructor runs at thread exit */
    return 1;
}

/* Bytes that sit in the pipe when splice turns out not to work here: read them back out (the
 * pipe holds page references, so this is an ordinary copy) and send them. */
static int drain_pipe_plainly(int fd, int pipefd[2], size_t left, int flags, int64_t deadline_ms)
{
    char buf[16384];
    while (left) {
        ssize_t r = read(pipefd[0], buf, left < sizeof buf ? left : sizeof buf);
        if (r <= 0) {
            if (r < 0 && errno == EINTR)
                continue;
            return -1;
        }
        struct iovec v = {.iov_base = buf, .iov_len = (size_t)r};
        int rc = fmc_sendv_flags(fd, &v, 1, flags, deadline_ms);
        if (rc < 0)
            return rc;
        left -= (size_t)r;
    }
    return 0;
}

/* A blocking socket's sends give up after SO_SNDTIMEO (EAGAIN, or a short count): what is left
 * until deadline_ms, at least 1 ms.  splice() into a socket has no non-blocking mode of its own
 * (it follows the socket's O_NONBLOCK, which the stream's receive side must not see), so this is
 * how a zero-copy send keeps a caller's deadline (fmc_sendv_zc puts the socket's own timeout
 * back after it). */
static void send_timeout(int fd, int64_t deadline_ms)
{
    int64_t left = deadline_ms - fmc_now_ms();
    fmc_socket_timeout(fd, SO_SNDTIMEO, left < 1 ? 1 : left);
}

/* A run of payloads through the pipe, as many per vmsplice as the pipe holds (the small
 * payloads of a vector go together); `more`: other bytes of this round follow the run (a copied
 * fallback then sends with MSG_MORE).  With a deadline, the socket's send timeout is set
 * (fmc_sendv_zc) and a splice it cuts short is resumed with what is left of it, or gives up (-2)
 * once it has passed.  Splices never ask to cork (SPLICE_F_MORE), even with bytes to follow: a
 * corked spliced payload held the round up, so that two 128 KiB payloads of one round took 84
 * instead of 24 us to send (loopback, Linux 6.18), where the header that follows costs one small
 * packet at most. */
static int splice_run(int fd, struct iovec *iov, int cnt, int more, int pipefd[2], int64_t deadline_ms)
{
    cnt = fmc_iov_merge(iov, cnt);
    while (cnt > 0) {
        ssize_t in = vmsplice(pipefd[1], iov, (unsigned long)cnt, 0);
        if (in < 0) {
            if (errno == EINTR)
                continue;
            if (unsupported(errno))
                zc_turn_off();
            else if (errno != EFAULT)
                return -1;
            /* EFAULT: pages get_user_pages cannot take (VM_IO / PFNMAP mappings) that a plain
             * copy can still read; these payloads go by sendmsg, later ones try again. */
            return fmc_sendv_flags(fd, iov, cnt, more ? MSG_MORE : 0, deadline_ms);
        }
        fmc_iov_advance(&iov, &cnt, (size_t)in);
        size_t left = (size_t)in;
        int64_t since = 0; /* without a deadline: a send timeout with nothing moved is a stall */
        while (left) {
            ssize_t out = splice(pipefd[0], NULL, fd, NULL, left, SPLICE_F_MOVE);
            if (out < 0 && errno == EINTR)
                continue;
            if (out < 0 && deadline_ms < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
                fmc_send_stall_goes_on(&since))
                continue;
            if (out > 0)
                since = 0;
            if (out < 0 && unsupported(errno)) {
                zc_turn_off();
                int rc = drain_pipe_plainly(fd, pipefd, left, more || cnt > 0 ? MSG_MORE : 0, deadline_ms);
                if (rc < 0)
                    return rc;
                return cnt ? fmc_sendv_flags(fd, iov, cnt, more ? MSG_MORE : 0, deadline_ms) : 0;
            }
            int timed_out = deadline_ms >= 0 && (out < 0 ? errno == EAGAIN || errno == EWOULDBLOCK : (size_t)out < left);
            if (out > 0)
                left -= (size_t)out;
            if (timed_out && left) {
                if (fmc_now_ms() >= deadline_ms)
                    return -2;
                send_timeout(fd, deadline_ms);
                continue;
            }
            if (out <= 0)
                return -1; /* the connection dies; the pipe may hold pages: fmc_sendv_zc closes it */
        }
    }
    return 0;
}

static int sendv_zc(int fd, struct iovec *iov, int iovcnt, const uint8_t *zc, int pipefd[2], int64_t deadline_ms)
{
    int i = 0;
    while (i < iovcnt) {
        int j = i; /* [i, j): plain; [j, k): zero-copy */
        while (j < iovcnt && !zc[j])
            j++;
        int k = j;
        while (k < iovcnt && zc[k])
            k++;
        if (j < k && !(fmc_zc_usable() && pipe_ready(pipefd)))
            j = k; /* refused: the run joins the plain one */
        int rc = j > i ? fmc_sendv_flags(fd, iov + i, j - i, j < iovcnt ? MSG_MORE : 0, deadline_ms) : 0;
        if (rc == 0 && k > j)
            rc = splice_run(fd, iov + j, k - j, k < iovcnt, pipefd, deadline_ms);
        if (rc < 0)
            return rc;
        i = k;
    }
    return 0;
}

int fmc_sendv_zc(int fd, struct iovec *iov, int iovcnt, const uint8_t *zc, int64_t deadline_ms)
{
    int64_t own = 0; /* the socket's send timeout outside the deadline (a stream's stall tick) */
    if (deadline_ms >= 0) {
        own = fmc_socket_timeout_get(fd, SO_SNDTIMEO);
        send_timeout(fd, deadline_ms);
    }
    int rc = fmc_stall_over(sendv_zc(fd, iov, iovcnt, zc, thread_pipe, deadline_ms));
    if (deadline_ms >= 0)
        fmc_socket_timeout(fd, SO_SNDTIMEO, own);
    if (rc < 0)
        pipe_close(thread_pipe); /* pages spliced into it and never sent */
    return rc;
}
