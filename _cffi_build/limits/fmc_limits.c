/* Physical limits for the benchmark: what the hardware and kernel give without any engine.
 *
 * Every baseline moves `total` bytes in `block`-sized pieces through buffers of `span` bytes (the
 * working set of one batch of the engine's workload), so caches treat both alike, and writes the
 * throughput in GB/s (1e9 bytes per second) through `gbps_out`.  Nothing here is used by the
 * engine: this file is built into a module of its own (build_limits.py), with the core's socket
 * helpers (fmc_util.c) so that the raw socket is opened and tuned as the engine's streams are.
 *
 *   fmc_baseline_memcpy  memcpy of each block, one thread
 *   fmc_baseline_tcp     loopback TCP, `streams` connections, a sender and a receiver thread each;
 *                        senders gather blocks into sendmsg calls of about 1 MiB (as the engine's
 *                        streams do), receivers read as much as the socket has
 *   fmc_baseline_tcp_calls  the same sockets as synchronous calls: each batch split over up to
 *                        `streams` connections, answered, and waited for before the next
 *   fmc_baseline_pvm     process_vm_writev from this process into a forked child, up to 1024
 *                        blocks per call, back-to-back blocks joined into one range per side
 *   fmc_baseline_tcp_staged  the same sockets in pinned buffers, with the bytes they carry also
 *                        copied device to host and host to device beside them (two threads keeping
 *                        pace with the receivers): the three legs of GPU memory over TCP at once
 *   fmc_baseline_cuda_d2d  device-to-device copies through the CUDA driver API, loaded with dlopen
 *                        (FMC_ERR_NOT_IMPLEMENTED where there is no driver): each batch's copies
 *                        queued on a stream and waited for, as a synchronous transfer must, or
 *                        queued back to back with one wait at the end
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "limits_cdefs.h"

#define BL_GATHER_BYTES (1u << 20) /* bytes a raw sender hands to one sendmsg */
#define BL_GATHER_IOVS 256
#define BL_PVM_IOVS 1024           /* IOV_MAX */
#define BL_MAX_STREAM_BUF (64ull << 20)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int check_shape(uint64_t block, uint64_t span, uint64_t total, const double *gbps_out)
{
    if (block == 0 || span < block || total == 0 || gbps_out == NULL) {
        fmc_set_error("baseline: need block > 0, span >= block, total > 0 and an output (got %llu, %llu, %llu)",
                      (unsigned long long)block, (unsigned long long)span, (unsigned long long)total);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (span > (1ull << 40) || total > (1ull << 50)) {
        fmc_set_error("baseline: span or total too large");
        return FMC_ERR_INVALID_ARGUMENT;
    }
    return 0;
}

/* Anonymous memory with every page touched (huge pages where the kernel gives them), or NULL. */
static uint8_t *map_touched(uint64_t len, int byte)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        fmc_set_error("baseline: cannot map %llu bytes: %s", (unsigned long long)len, strerror(errno));
        return NULL;
    }
#ifdef MADV_HUGEPAGE
    /* In huge pages, as the engines' registered memory ends up (fmc_hugepages.c): a limit
     * measured in 4 KiB pages would credit the engine with the page size, not its own work. */
    madvise(p, len, MADV_HUGEPAGE);
#endif
    memset(p, byte, len);
    return p;
}

static int set_gbps(uint64_t bytes, double seconds, double *gbps_out)
{
    *gbps_out = seconds > 0 ? (double)bytes / seconds / 1e9 : 0.0;
    return 0;
}

/* ------------------------------------------------------------------ memcpy */

int fmc_baseline_memcpy(uint64_t block, uint64_t span, uint64_t total, double *gbps_out)
{
    int rc = check_shape(block, span, total, gbps_out);
    if (rc < 0)
        return rc;
    uint64_t nblocks = span / block;
    uint8_t *src = map_touched(nblocks * block, 0x5a);
    uint8_t *dst = src ? map_touched(nblocks * block, 0) : NULL;
    if (dst == NULL) {
        if (src)
            munmap(src, nblocks * block);
        return FMC_ERR_MEMORY;
    }
    uint64_t moved = 0, i = 0;
    double t0 = now_s();
    while (moved < total) {
        uint64_t n = total - moved < block ? total - moved : block;
        memcpy(dst + i * block, src + i * block, n);
        moved += n;
        i = i + 1 == nblocks ? 0 : i + 1;
    }
    double t1 = now_s();
    rc = dst[0] == 0x5a ? 0 : FMC_ERR_MEMORY; /* also keeps the copies from being optimised away */
    munmap(src, nblocks * block);
    munmap(dst, nblocks * block);
    if (rc < 0) {
        fmc_set_error("baseline: memcpy did not copy");
        return rc;
    }
    return set_gbps(moved, t1 - t0, gbps_out);
}

/* ------------------------------------------------------------------ loopback TCP */

typedef struct {
    int fd;              /* sender: connected socket; receiver: accepted socket */
    uint8_t *buf;        /* ring of `buf_len` bytes the thread reads from or writes into */
    uint64_t buf_len;
    uint64_t block;
    uint64_t bytes;      /* to move on this stream */
    struct bl_gate *gate;
    uint64_t *received;  /* receiver: bytes received by every stream, for DMA that keeps pace */
    int failed;
} bl_stream_end;

/* Holds every thread until all exist (go) or thread creation failed (abort). */
typedef struct bl_gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state; /* 0 wait, 1 go, -1 abort */
} bl_gate;

static int gate_wait(bl_gate *g)
{
    pthread_mutex_lock(&g->mu);
    while (g->state == 0)
        pthread_cond_wait(&g->cv, &g->mu);
    int state = g->state;
    pthread_mutex_unlock(&g->mu);
    return state;
}

static void gate_open(bl_gate *g, int state)
{
    pthread_mutex_lock(&g->mu);
    g->state = state;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void *tcp_sender(void *arg)
{
    bl_stream_end *e = arg;
    struct iovec iov[BL_GATHER_IOVS];
    uint64_t pos = 0, left = e->bytes, in_block = 0; /* in_block: bytes of the current block sent */
    if (gate_wait(e->gate) < 0)
        return NULL;
    while (left) {
        int n = 0;
        uint64_t gathered = 0;
        while (left && n < BL_GATHER_IOVS && gathered < BL_GATHER_BYTES) {
            uint64_t len = e->block - in_block;
            if (len > left)
                len = left;
            if (len > e->buf_len - pos)
                len = e->buf_len - pos;
            iov[n].iov_base = e->buf + pos;
            iov[n].iov_len = len;
            n++;
            gathered += len;
            left -= len;
            pos = pos + len == e->buf_len ? 0 : pos + len;
            in_block = in_block + len == e->block ? 0 : in_block + len;
        }
        if (fmc_sendv_all(e->fd, iov, n) < 0) {
            e->failed = errno ? errno : EIO;
            break;
        }
    }
    shutdown(e->fd, SHUT_WR);
    return NULL;
}

static void *tcp_receiver(void *arg)
{
    bl_stream_end *e = arg;
    uint64_t pos = 0, left = e->bytes;
    if (gate_wait(e->gate) < 0)
        return NULL;
    while (left) {
        uint64_t want = left < e->buf_len - pos ? left : e->buf_len - pos;
        ssize_t n = recv(e->fd, e->buf + pos, want, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            e->failed = n < 0 ? errno : EPIPE;
            break;
        }
        left -= (uint64_t)n;
        pos = pos + (uint64_t)n == e->buf_len ? 0 : pos + (uint64_t)n;
        if (e->received)
            __atomic_add_fetch(e->received, (uint64_t)n, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* DMA beside the sockets (fmc_baseline_tcp_staged), defined with the CUDA baselines below. */
typedef struct bl_dma bl_dma;
static uint8_t *dma_buffer(uint64_t len, int byte);
static void dma_buffer_free(uint8_t *buf);
static int dma_start(bl_dma *d, bl_stream_end *ends, int streams, uint64_t buf_len, bl_gate *gate);
static int dma_finish(bl_dma *d);

/* The socket options of the raw socket's connections: an engine's defaults, with the congestion
 * control within this host that the caller's settings name (fmc_limits_set_local_cc). */
static fmc_options limit_opts = {.local_cc = "reno",
                                 .rto_min_us = FMC_RTO_MIN_US_DEFAULT,
                                 .delack_max_us = FMC_DELACK_MAX_US_DEFAULT};

int fmc_limits_set_local_cc(const char *cc)
{
    if (!cc || strlen(cc) >= sizeof limit_opts.local_cc)
        return FMC_ERR_INVALID_ARGUMENT;
    snprintf(limit_opts.local_cc, sizeof limit_opts.local_cc, "%s", cc);
    return 0;
}

/* One loopback connection to the listener `lfd` on `port`, both ends tuned as the engine's
 * streams are: 0, or an FMC_ERR_* code with the ends left at -1. */
static int connect_pair(int lfd, int port, int *client_fd, int *server_fd)
{
    int c = fmc_tcp_connect_opts("127.0.0.1", port, 5000, &limit_opts);
    if (c < 0)
        return c;
    int sv = accept(lfd, NULL, NULL);
    if (sv < 0) {
        fmc_set_error("baseline: accept failed: %s", strerror(errno));
        close(c);
        return FMC_ERR_SOCKET;
    }
    fmc_tune_socket_opts(c, &limit_opts);
    fmc_tune_socket_opts(sv, &limit_opts);
    *client_fd = c;
    *server_fd = sv;
    return 0;
}

static int tcp_check(int streams, uint64_t block, uint64_t span, uint64_t total, const double *gbps_out)
{
    int rc = check_shape(block, span, total, gbps_out);
    if (rc < 0)
        return rc;
    if (streams < 1 || streams > FMC_MAX_STREAMS) {
        fmc_set_error("baseline: streams must be in 1..%d", FMC_MAX_STREAMS);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    return 0;
}

static int tcp_run(int streams, uint64_t block, uint64_t span, uint64_t total, bl_dma *dma, double *gbps_out)
{
    int rc = tcp_check(streams, block, span, total, gbps_out);
    if (rc < 0)
        return rc;
    uint64_t buf_len = (span / (uint64_t)streams + 4095) & ~4095ull;
    if (buf_len < 4096)
        buf_len = 4096;
    if (buf_len > BL_MAX_STREAM_BUF)
        buf_len = BL_MAX_STREAM_BUF;
    uint64_t per_stream = (total + (uint64_t)streams - 1) / (uint64_t)streams;

    bl_stream_end ends[2 * FMC_MAX_STREAMS];
    pthread_t threads[2 * FMC_MAX_STREAMS];
    bl_gate gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    memset(ends, 0, sizeof ends);
    for (int i = 0; i < 2 * streams; i++)
        ends[i].fd = -1;
    int port = 0, started = 0;
    int lfd = fmc_tcp_listen("127.0.0.1", 0, 0, &port);
    if (lfd < 0)
        return lfd;
    rc = 0;
    for (int s = 0; s < streams && rc == 0; s++) {
        bl_stream_end *tx = &ends[2 * s], *rx = &ends[2 * s + 1];
        if ((rc = connect_pair(lfd, port, &tx->fd, &rx->fd)) < 0)
            break;
        tx->buf = dma ? dma_buffer(buf_len, 0x5a) : map_touched(buf_len, 0x5a);
        rx->buf = !tx->buf ? NULL : dma ? dma_buffer(buf_len, 0) : map_touched(buf_len, 0);
        if (rx->buf == NULL) {
            rc = FMC_ERR_MEMORY;
            break;
        }
        tx->buf_len = rx->buf_len = buf_len;
        tx->block = rx->block = block;
        tx->bytes = rx->bytes = per_stream;
    }
    close(lfd);
    double t0 = 0, t1 = 0;
    if (rc == 0) {
        for (int i = 0; i < 2 * streams; i++) {
            ends[i].gate = &gate;
            if (pthread_create(&threads[i], NULL, (i & 1) ? tcp_receiver : tcp_sender, &ends[i]) != 0)
                break;
            started++;
        }
        if (started < 2 * streams) {
            fmc_set_error("baseline: cannot start %d threads", 2 * streams);
            rc = FMC_ERR_MEMORY;
        }
        if (rc == 0 && dma)
            rc = dma_start(dma, ends, streams, buf_len, &gate);
        t0 = now_s();
        gate_open(&gate, rc == 0 ? 1 : -1);
        for (int i = 0; i < started; i++)
            pthread_join(threads[i], NULL);
        int dma_rc = dma ? dma_finish(dma) : 0; /* it copies what the sockets carried, then stops */
        t1 = now_s();
        if (rc == 0)
            rc = dma_rc;
        for (int i = 0; i < 2 * streams && rc == 0; i++) {
            if (ends[i].failed) {
                fmc_set_error("baseline: stream %d %s failed: %s", i / 2, (i & 1) ? "receiver" : "sender",
                              strerror(ends[i].failed));
                rc = FMC_ERR_SOCKET;
            }
        }
    }
    for (int i = 0; i < 2 * streams; i++) {
        if (ends[i].fd >= 0)
            close(ends[i].fd);
        if (ends[i].buf && dma)
            dma_buffer_free(ends[i].buf);
        else if (ends[i].buf)
            munmap(ends[i].buf, buf_len);
    }
    if (rc < 0)
        return rc;
    return set_gbps(per_stream * (uint64_t)streams, t1 - t0, gbps_out);
}

int fmc_baseline_tcp(int streams, uint64_t block, uint64_t span, uint64_t total, double *gbps_out)
{
    return tcp_run(streams, block, span, total, NULL, gbps_out);
}

/* ------------------------------------------------------------------ loopback TCP, call by call */

/* The floor of a synchronous transfer: each call's `span` bytes split evenly over k connections,
 * each share answered with BL_RPC_ANSWER bytes once it has all arrived, and the next call only
 * after every answer.  The shares are sent either by the calling thread itself, one after the
 * other (k = 1), or by k client threads that poll for the call instead of sleeping, so no thread
 * wake-up is paid on the calling side; the target's threads sleep in recv as any server does.
 * Every k of 1, 2, 4, ... up to `streams` is tried (threads only while k client plus k server
 * threads fit the `cpus` the caller may use: polling threads on too few CPUs measure the
 * scheduler) and the best is returned.  No engine that answers each call can beat this by
 * much; the raw socket, which streams without answers, can be far above it for calls of a few
 * hundred KiB. */
#define BL_RPC_ANSWER 16

typedef struct {
    int cfd, sfd;         /* the connection's two ends */
    uint8_t *src, *dst;   /* this share's bytes on each side */
    uint64_t share;
    uint64_t calls;
    _Atomic uint64_t go;   /* call number the client thread is to send */
    _Atomic uint64_t done; /* last call whose answer it has */
    _Atomic int stop;
    int failed;
} bl_rpc_conn;

static void bl_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    sched_yield();
#endif
}

static void *rpc_server(void *arg)
{
    bl_rpc_conn *c = arg;
    uint8_t answer[BL_RPC_ANSWER] = {0};
    for (uint64_t i = 0; i < c->calls; i++) {
        if (fmc_recv_all(c->sfd, c->dst, c->share) < 0 || fmc_send_all(c->sfd, answer, sizeof answer) < 0) {
            c->failed = errno ? errno : EPIPE;
            shutdown(c->sfd, SHUT_RDWR); /* the client's recv of this answer ends too */
            break;
        }
    }
    return NULL;
}

static void *rpc_client(void *arg)
{
    bl_rpc_conn *c = arg;
    uint8_t answer[BL_RPC_ANSWER];
    for (uint64_t seen = 0;;) {
        uint64_t go;
        while ((go = atomic_load_explicit(&c->go, memory_order_acquire)) == seen)
            if (atomic_load_explicit(&c->stop, memory_order_relaxed))
                return NULL;
            else
                bl_relax();
        seen = go;
        if (fmc_send_all(c->cfd, c->src, c->share) < 0 || fmc_recv_all(c->cfd, answer, sizeof answer) < 0) {
            c->failed = errno ? errno : EPIPE;
            atomic_store_explicit(&c->done, UINT64_MAX, memory_order_release);
            return NULL;
        }
        atomic_store_explicit(&c->done, go, memory_order_release);
    }
}

/* One split: k connections, `threads` says who sends.  Returns 0 and the seconds taken. */
static int rpc_run(int k, int threads, uint64_t span, uint64_t calls, uint8_t *src, uint8_t *dst, double *seconds)
{
    bl_rpc_conn conns[FMC_MAX_STREAMS];
    pthread_t servers[FMC_MAX_STREAMS], clients[FMC_MAX_STREAMS];
    int nserv = 0, ncli = 0, rc = 0;
    memset(conns, 0, sizeof conns);
    uint64_t share = span / (uint64_t)k;
    int port = 0;
    int lfd = fmc_tcp_listen("127.0.0.1", 0, 0, &port);
    if (lfd < 0)
        return lfd;
    for (int i = 0; i < k; i++)
        conns[i].cfd = conns[i].sfd = -1;
    for (int i = 0; i < k && rc == 0; i++) {
        bl_rpc_conn *c = &conns[i];
        c->share = i == k - 1 ? span - share * (uint64_t)(k - 1) : share;
        c->src = src + share * (uint64_t)i;
        c->dst = dst + share * (uint64_t)i;
        c->calls = calls;
        if ((rc = connect_pair(lfd, port, &c->cfd, &c->sfd)) < 0)
            break;
    }
    close(lfd);
    for (; nserv < k && rc == 0; nserv++)
        if (pthread_create(&servers[nserv], NULL, rpc_server, &conns[nserv]) != 0)
            break;
    for (; threads && ncli < k && rc == 0 && nserv == k; ncli++)
        if (pthread_create(&clients[ncli], NULL, rpc_client, &conns[ncli]) != 0)
            break;
    if (rc == 0 && (nserv < k || (threads && ncli < k))) {
        fmc_set_error("baseline: cannot start the call threads");
        rc = FMC_ERR_MEMORY;
    }
    double t0 = now_s();
    uint8_t answer[BL_RPC_ANSWER];
    for (uint64_t call = 1; call <= calls && rc == 0; call++) {
        if (threads) {
            for (int i = 0; i < k; i++)
                atomic_store_explicit(&conns[i].go, call, memory_order_release);
            for (int i = 0; i < k && rc == 0; i++) {
                uint64_t done;
                while ((done = atomic_load_explicit(&conns[i].done, memory_order_acquire)) < call)
                    bl_relax();
                if (done == UINT64_MAX)
                    rc = FMC_ERR_SOCKET;
            }
            continue;
        }
        for (int i = 0; i < k && rc == 0; i++)
            if (fmc_send_all(conns[i].cfd, conns[i].src, conns[i].share) < 0)
                rc = FMC_ERR_SOCKET;
        for (int i = 0; i < k && rc == 0; i++)
            if (fmc_recv_all(conns[i].cfd, answer, sizeof answer) < 0)
                rc = FMC_ERR_SOCKET;
        if (rc != 0)
            fmc_set_error("baseline: a call failed: %s", strerror(errno));
    }
    *seconds = now_s() - t0;
    for (int i = 0; i < ncli; i++)
        atomic_store_explicit(&conns[i].stop, 1, memory_order_relaxed);
    for (int i = 0; i < k; i++) /* a failed run leaves threads in recv: this ends them */
        if (rc != 0 && conns[i].cfd >= 0)
            shutdown(conns[i].cfd, SHUT_RDWR);
    for (int i = 0; i < ncli; i++)
        pthread_join(clients[i], NULL);
    for (int i = 0; i < nserv; i++)
        pthread_join(servers[i], NULL);
    for (int i = 0; i < k; i++) {
        if (conns[i].failed && (rc == 0 || rc == FMC_ERR_SOCKET)) {
            fmc_set_error("baseline: call connection %d failed: %s", i, strerror(conns[i].failed));
            rc = FMC_ERR_SOCKET;
        }
        if (conns[i].cfd >= 0)
            close(conns[i].cfd);
        if (conns[i].sfd >= 0)
            close(conns[i].sfd);
    }
    return rc;
}

int fmc_baseline_tcp_calls(int streams, int cpus, uint64_t block, uint64_t span, uint64_t total, double *gbps_out)
{
    int rc = tcp_check(streams, block, span, total, gbps_out);
    if (rc < 0)
        return rc;
    /* As many calls as the bench's timed loops make of this shape at most (1000), at least 2. */
    uint64_t calls = total / span < 2 ? 2 : total / span > 1000 ? 1000 : total / span;
    uint8_t *src = map_touched(span, 0x5a), *dst = src ? map_touched(span, 0) : NULL;
    if (!dst) {
        if (src)
            munmap(src, span);
        return FMC_ERR_MEMORY;
    }
    double best = 0;
    /* k = 1, 2, 4, ... and `streams` itself last when it is no power of two. */
    for (int k = 1; k <= streams && rc == 0; k = k < streams && k * 2 > streams ? streams : k * 2) {
        int threads = k > 1;
        if ((uint64_t)k > span || (threads && 2 * k > cpus))
            break;
        double seconds = 0;
        rc = rpc_run(k, threads, span, calls, src, dst, &seconds);
        double gbps = rc == 0 && seconds > 0 ? (double)(span * calls) / seconds / 1e9 : 0;
        best = gbps > best ? gbps : best;
    }
    munmap(src, span);
    munmap(dst, span);
    if (rc < 0)
        return rc;
    *gbps_out = best;
    return 0;
}

/* ------------------------------------------------------------------ process_vm_writev */

int fmc_baseline_pvm(uint64_t block, uint64_t span, uint64_t total, double *gbps_out)
{
    int rc = check_shape(block, span, total, gbps_out);
    if (rc < 0)
        return rc;
    uint64_t nblocks = span / block, len = nblocks * block;
    uint8_t *src = map_touched(len, 0x5a);
    uint8_t *dst = src ? map_touched(len, 0) : NULL;
    if (dst == NULL) {
        if (src)
            munmap(src, len);
        return FMC_ERR_MEMORY;
    }
    int ready[2], hold[2];
    if (pipe2(ready, O_CLOEXEC) < 0) {
        munmap(src, len);
        munmap(dst, len);
        fmc_set_error("baseline: pipe: %s", strerror(errno));
        return FMC_ERR_SOCKET;
    }
    if (pipe2(hold, O_CLOEXEC) < 0) {
        close(ready[0]);
        close(ready[1]);
        munmap(src, len);
        munmap(dst, len);
        fmc_set_error("baseline: pipe: %s", strerror(errno));
        return FMC_ERR_SOCKET;
    }
    pid_t pid = fork();
    if (pid == 0) {
        /* Child: own its copy of dst (break copy-on-write), say so, then wait for the parent to
         * close the hold pipe.  Only async-signal-safe calls from here on. */
        char c = 0, verdict;
        memset(dst, 1, len);
        close(ready[0]);
        close(hold[1]);
        if (write(ready[1], &c, 1) != 1)
            _exit(2);
        while (read(hold[0], &c, 1) > 0) {
        }
        verdict = dst[0] == 0x5a ? 0 : 3; /* the parent wrote the first block */
        _exit(verdict);
    }
    close(ready[1]);
    close(hold[0]);
    if (pid < 0) {
        close(ready[0]);
        close(hold[1]);
        munmap(src, len);
        munmap(dst, len);
        fmc_set_error("baseline: fork: %s", strerror(errno));
        return FMC_ERR_MEMORY;
    }
    munmap(dst, len); /* the child's copy at the same address is the destination */
    char c;
    ssize_t got;
    do {
        got = read(ready[0], &c, 1);
    } while (got < 0 && errno == EINTR);
    close(ready[0]);
    rc = got == 1 ? 0 : FMC_ERR_SOCKET;
    if (rc < 0)
        fmc_set_error("baseline: child did not start");

    struct iovec liov[BL_PVM_IOVS], riov[BL_PVM_IOVS];
    uint64_t moved = 0, i = 0;
    double t0 = now_s();
    while (rc == 0 && moved < total) {
        int n = 0;
        uint64_t want = 0;
        while (n < BL_PVM_IOVS && moved + want < total) {
            uint64_t piece = total - moved - want < block ? total - moved - want : block;
            liov[n].iov_base = src + i * block;
            riov[n].iov_base = dst + i * block;
            liov[n].iov_len = riov[n].iov_len = piece;
            want += piece;
            n++;
            i = i + 1 == nblocks ? 0 : i + 1;
            if (i == 0)
                break; /* one call never names the same remote block twice */
        }
        /* Back-to-back blocks as one range per side, as the engine hands them over: otherwise
         * the kernel pins pages once per block and the limit would be a slow way to call it. */
        unsigned long nl = (unsigned long)fmc_iov_merge(liov, n), nr = (unsigned long)fmc_iov_merge(riov, n);
        ssize_t done = process_vm_writev(pid, liov, nl, riov, nr, 0);
        if (done < 0 && errno == EINTR)
            continue;
        if (done != (ssize_t)want) {
            fmc_set_error("baseline: process_vm_writev moved %zd of %llu bytes: %s", done,
                          (unsigned long long)want, done < 0 ? strerror(errno) : "short write");
            rc = errno == EPERM ? FMC_ERR_NOT_IMPLEMENTED : FMC_ERR_SOCKET;
            break;
        }
        moved += want;
    }
    double t1 = now_s();
    close(hold[1]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    munmap(src, len);
    if (rc == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        fmc_set_error("baseline: the child did not see the written bytes (status %d)", status);
        rc = FMC_ERR_SOCKET;
    }
    if (rc < 0)
        return rc;
    return set_gbps(moved, t1 - t0, gbps_out);
}

/* ------------------------------------------------------------------ CUDA (driver API, dlopen) */

typedef int (*cu_init_fn)(unsigned);
typedef int (*cu_count_fn)(int *);
typedef int (*cu_device_get_fn)(int *, int);
typedef int (*cu_ctx_retain_fn)(void **, int);
typedef int (*cu_ctx_fn)(void *);
typedef int (*cu_sync_fn)(void);
typedef int (*cu_alloc_fn)(uint64_t *, size_t);
typedef int (*cu_free_fn)(uint64_t);
typedef int (*cu_peer_fn)(uint64_t, void *, uint64_t, void *, size_t);
typedef int (*cu_memset_fn)(uint64_t, unsigned char, size_t);
typedef int (*cu_stream_create_fn)(void **, unsigned);
typedef int (*cu_stream_fn)(void *);
typedef int (*cu_copy_async_fn)(uint64_t, uint64_t, size_t, void *);
typedef int (*cu_peer_async_fn)(uint64_t, void *, uint64_t, void *, size_t, void *);
static struct {
    pthread_once_t once;
    int rc;
    cu_count_fn count;
    cu_device_get_fn device_get;
    cu_ctx_retain_fn retain;
    cu_ctx_fn set_current;
    cu_sync_fn sync;
    cu_alloc_fn alloc;
    cu_free_fn free;
    cu_peer_fn peer;
    cu_memset_fn memset;
    cu_stream_create_fn stream_create;
    cu_stream_fn stream_destroy, stream_sync;
    cu_copy_async_fn copy_async;
    cu_peer_async_fn peer_async;
    int (*host_alloc)(void **, size_t, unsigned int); /* optional: the pinned copies' limit */
    int (*free_host)(void *);
} cu = {.once = PTHREAD_ONCE_INIT};

static void cu_load(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    cu.rc = FMC_ERR_NOT_IMPLEMENTED;
    if (h == NULL)
        return;
    cu_init_fn init = (cu_init_fn)dlsym(h, "cuInit");
    cu.count = (cu_count_fn)dlsym(h, "cuDeviceGetCount");
    cu.device_get = (cu_device_get_fn)dlsym(h, "cuDeviceGet");
    cu.retain = (cu_ctx_retain_fn)dlsym(h, "cuDevicePrimaryCtxRetain");
    cu.set_current = (cu_ctx_fn)dlsym(h, "cuCtxSetCurrent");
    cu.sync = (cu_sync_fn)dlsym(h, "cuCtxSynchronize");
    cu.alloc = (cu_alloc_fn)dlsym(h, "cuMemAlloc_v2");
    cu.free = (cu_free_fn)dlsym(h, "cuMemFree_v2");
    cu.peer = (cu_peer_fn)dlsym(h, "cuMemcpyPeer");
    cu.memset = (cu_memset_fn)dlsym(h, "cuMemsetD8_v2");
    cu.stream_create = (cu_stream_create_fn)dlsym(h, "cuStreamCreate");
    cu.stream_destroy = (cu_stream_fn)dlsym(h, "cuStreamDestroy_v2");
    cu.stream_sync = (cu_stream_fn)dlsym(h, "cuStreamSynchronize");
    cu.copy_async = (cu_copy_async_fn)dlsym(h, "cuMemcpyAsync");
    cu.peer_async = (cu_peer_async_fn)dlsym(h, "cuMemcpyPeerAsync");
    *(void **)&cu.host_alloc = dlsym(h, "cuMemHostAlloc");
    *(void **)&cu.free_host = dlsym(h, "cuMemFreeHost");
    if (!init || !cu.count || !cu.device_get || !cu.retain || !cu.set_current || !cu.sync || !cu.alloc ||
        !cu.free || !cu.peer || !cu.memset || !cu.stream_create || !cu.stream_destroy ||
        !cu.stream_sync || !cu.copy_async || !cu.peer_async || init(0) != 0)
        return;
    cu.rc = 0;
}

/* Load the driver and make `device`'s primary context current in this thread. */
static int cu_use(int device, void **ctx_out)
{
    pthread_once(&cu.once, cu_load);
    if (cu.rc < 0) {
        fmc_set_error("no usable CUDA driver (libcuda.so.1)");
        return cu.rc;
    }
    int count = 0, dev = 0;
    void *ctx = NULL;
    if (cu.count(&count) != 0 || device < 0 || device >= count) {
        fmc_set_error("CUDA device %d not present (%d devices)", device, count);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (cu.device_get(&dev, device) != 0 || cu.retain(&ctx, dev) != 0 || cu.set_current(ctx) != 0) {
        fmc_set_error("cannot open a context on CUDA device %d", device);
        return FMC_ERR_MEMORY;
    }
    if (ctx_out)
        *ctx_out = ctx;
    return 0;
}

/* wait_each_batch: every span's blocks (one batch of the workload) are queued on a
 * non-blocking stream and waited for before the next batch, which is what a synchronous
 * transfer call has to do; 0: all copies back to back, one wait at the end (the copy engine's
 * streaming rate, which no call that waits for its bytes can reach at one block per call). */
int fmc_baseline_cuda_d2d(int src_device, int dst_device, uint64_t block, uint64_t span, uint64_t total,
                          int wait_each_batch, double *gbps_out)
{
    int rc = check_shape(block, span, total, gbps_out);
    if (rc < 0)
        return rc;
    void *src_ctx = NULL, *dst_ctx = NULL, *stream = NULL;
    uint64_t nblocks = span / block, len = nblocks * block, src = 0, dst = 0;
    if ((rc = cu_use(dst_device, &dst_ctx)) < 0)
        return rc;
    if (cu.alloc(&dst, len) != 0) {
        fmc_set_error("cuMemAlloc of %llu bytes failed on device %d", (unsigned long long)len, dst_device);
        return FMC_ERR_MEMORY;
    }
    if ((rc = cu_use(src_device, &src_ctx)) < 0 || cu.alloc(&src, len) != 0 ||
        cu.stream_create(&stream, 1 /* CU_STREAM_NON_BLOCKING */) != 0) {
        if (src)
            cu.free(src);
        cu_use(dst_device, NULL);
        cu.free(dst);
        if (rc == 0)
            fmc_set_error("cannot allocate %llu bytes and a stream on device %d", (unsigned long long)len,
                          src_device);
        return rc < 0 ? rc : FMC_ERR_MEMORY;
    }
    cu.memset(src, 0x5a, len);
    cu.sync();
    uint64_t moved = 0, i = 0;
    int failed = 0;
    double t0 = now_s();
    while (moved < total && !failed) {
        uint64_t n = total - moved < block ? total - moved : block;
        if (src_device == dst_device)
            failed = cu.copy_async(dst + i * block, src + i * block, n, stream) != 0;
        else
            failed = cu.peer_async(dst + i * block, dst_ctx, src + i * block, src_ctx, n, stream) != 0;
        moved += n;
        i = i + 1 == nblocks ? 0 : i + 1;
        if (wait_each_batch && (i == 0 || moved == total))
            failed |= cu.stream_sync(stream) != 0;
    }
    failed |= cu.stream_sync(stream) != 0;
    double t1 = now_s();
    cu.stream_destroy(stream);
    cu.free(src);
    cu_use(dst_device, NULL);
    cu.free(dst);
    if (failed) {
        fmc_set_error("CUDA device-to-device copy failed");
        return FMC_ERR_MEMORY;
    }
    return set_gbps(moved, t1 - t0, gbps_out);
}

/* Copies between pinned host memory and `device`, one copy of the whole span per batch, waited
 * for before the next: the PCIe link's rate for a synchronous call of that size, which every
 * byte of GPU memory moved over TCP crosses once (to_device: host to device, else device to
 * host).  `block` only checks the shape: the link's limit does not depend on how the span is cut. */
int fmc_baseline_cuda_host(int device, int to_device, uint64_t block, uint64_t span, uint64_t total, double *gbps_out)
{
    int rc = check_shape(block, span, total, gbps_out);
    if (rc < 0)
        return rc;
    if ((rc = cu_use(device, NULL)) < 0)
        return rc;
    if (!cu.host_alloc || !cu.free_host) {
        fmc_set_error("the CUDA driver has no cuMemHostAlloc");
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    uint64_t len = span / block * block, dev = 0;
    void *host = NULL, *stream = NULL;
    if (cu.alloc(&dev, len) != 0 || cu.host_alloc(&host, len, 0x01 /* PORTABLE */) != 0 ||
        cu.stream_create(&stream, 1 /* CU_STREAM_NON_BLOCKING */) != 0) {
        if (host)
            cu.free_host(host);
        if (dev)
            cu.free(dev);
        fmc_set_error("cannot allocate %llu bytes of device and pinned host memory and a stream on device %d",
                      (unsigned long long)len, device);
        return FMC_ERR_MEMORY;
    }
    memset(host, 0x5a, len);
    cu.memset(dev, 0x5a, len);
    cu.sync();
    uint64_t moved = 0;
    int failed = 0;
    double t0 = now_s();
    while (moved < total && !failed) {
        uint64_t n = total - moved < len ? total - moved : len;
        uint64_t h = (uint64_t)(uintptr_t)host;
        failed = cu.copy_async(to_device ? dev : h, to_device ? h : dev, n, stream) != 0;
        failed |= cu.stream_sync(stream) != 0;
        moved += n;
    }
    double t1 = now_s();
    cu.stream_destroy(stream);
    cu.free_host(host);
    cu.free(dev);
    if (failed) {
        fmc_set_error("CUDA copy between pinned host memory and the device failed");
        return FMC_ERR_MEMORY;
    }
    return set_gbps(moved, t1 - t0, gbps_out);
}

/* ------------------------------------------------------------------ sockets with DMA beside them */

#define BL_DMA_PIECE (512u << 10) /* the engine's staging chunk */

typedef struct {
    bl_dma *d;
    int to_device;
} bl_dma_thread;

struct bl_dma {
    void *ctx;
    uint64_t dev_mem, dev_len;
    uint64_t received;     /* bytes every receiver took so far (bl_stream_end.received) */
    int sockets_done;      /* the sockets have finished: copy what is left, then stop */
    bl_stream_end *ends;
    int streams;
    uint64_t buf_len;
    bl_gate *gate;
    pthread_t threads[2];
    bl_dma_thread args[2];
    int started;
    int failed[2];
};

static uint8_t *dma_buffer(uint64_t len, int byte)
{
    void *p = NULL;
    if (cu.host_alloc(&p, len, 0x01 /* PORTABLE */) != 0)
        return NULL;
    memset(p, byte, len);
    return p;
}

static void dma_buffer_free(uint8_t *buf) { cu.free_host(buf); }

/* Copies, in staging-chunk pieces, as many bytes as the receivers have taken: device to host
 * into the senders' buffers (a staged write's gathers), or host to device out of the
 * receivers' buffers (its scatters), stream after stream.  The bytes a piece holds do not
 * matter here, only the traffic. */
static void *dma_main(void *arg)
{
    bl_dma_thread *t = arg;
    bl_dma *d = t->d;
    void *stream = NULL;
    int failed = cu.set_current(d->ctx) != 0 || cu.stream_create(&stream, 1 /* NON_BLOCKING */) != 0;
    if (gate_wait(d->gate) < 0 || failed) {
        d->failed[t->to_device] = failed;
        if (stream)
            cu.stream_destroy(stream);
        return NULL;
    }
    uint64_t copied = 0, pos = 0;
    int s = 0;
    for (;;) {
        uint64_t avail = __atomic_load_n(&d->received, __ATOMIC_ACQUIRE);
        if (copied >= avail) {
            if (__atomic_load_n(&d->sockets_done, __ATOMIC_ACQUIRE) &&
                copied >= __atomic_load_n(&d->received, __ATOMIC_ACQUIRE))
                break;
            sched_yield();
            continue;
        }
        uint64_t n = avail - copied;
        n = n < BL_DMA_PIECE ? n : BL_DMA_PIECE;
        n = n < d->buf_len - pos ? n : d->buf_len - pos;
        uint64_t host = (uint64_t)(uintptr_t)(d->ends[2 * s + t->to_device].buf + pos);
        uint64_t dev = d->dev_mem + (uint64_t)s * d->buf_len + pos;
        if (cu.copy_async(t->to_device ? dev : host, t->to_device ? host : dev, n, stream) != 0 ||
            cu.stream_sync(stream) != 0) {
            d->failed[t->to_device] = 1;
            break;
        }
        copied += n;
        if (++s == d->streams) {
            s = 0;
            pos = pos + n >= d->buf_len ? 0 : pos + n;
        }
    }
    cu.stream_destroy(stream);
    return NULL;
}

static int dma_start(bl_dma *d, bl_stream_end *ends, int streams, uint64_t buf_len, bl_gate *gate)
{
    d->ends = ends;
    d->streams = streams;
    d->buf_len = buf_len;
    d->gate = gate;
    d->received = 0;
    d->sockets_done = 0;
    for (int i = 0; i < streams; i++)
        ends[2 * i + 1].received = &d->received;
    d->dev_len = (uint64_t)streams * buf_len;
    if (cu.alloc(&d->dev_mem, d->dev_len) != 0) {
        d->dev_mem = 0;
        fmc_set_error("cannot allocate %llu bytes of device memory", (unsigned long long)d->dev_len);
        return FMC_ERR_MEMORY;
    }
    for (int i = 0; i < 2; i++) {
        d->args[i] = (bl_dma_thread){.d = d, .to_device = i};
        if (pthread_create(&d->threads[i], NULL, dma_main, &d->args[i]) != 0) {
            fmc_set_error("baseline: cannot start its copy threads");
            return FMC_ERR_MEMORY;
        }
        d->started++;
    }
    return 0;
}

static int dma_finish(bl_dma *d)
{
    __atomic_store_n(&d->sockets_done, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < d->started; i++)
        pthread_join(d->threads[i], NULL);
    if (d->dev_mem)
        cu.free(d->dev_mem);
    if (d->failed[0] || d->failed[1]) {
        fmc_set_error("CUDA copy beside the sockets failed");
        return FMC_ERR_MEMORY;
    }
    return 0;
}

int fmc_baseline_tcp_staged(int streams, int device, uint64_t block, uint64_t span, uint64_t total, double *gbps_out)
{
    bl_dma d;
    memset(&d, 0, sizeof d);
    int rc = tcp_check(streams, block, span, total, gbps_out);
    if (rc < 0 || (rc = cu_use(device, &d.ctx)) < 0)
        return rc;
    if (!cu.host_alloc || !cu.free_host) {
        fmc_set_error("the CUDA driver has no cuMemHostAlloc");
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    return tcp_run(streams, block, span, total, &d, gbps_out);
}
