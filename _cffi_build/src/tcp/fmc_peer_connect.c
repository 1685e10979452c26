/* Connecting a peer's data streams (each through fmc_connection.c): the first when the session
 * opens, more on the I/O pool as transfers come that would use them; and their health. */
#define _GNU_SOURCE
#include <stddef.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

int fmc_peer_set_protocol(fmc_peer *p, int proto)
{
    if (proto != FMC_PROTO_NATIVE && proto != FMC_PROTO_MOONCAKE) {
        fmc_set_error("unknown data-plane protocol %d", proto);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&p->mu);
    int connected = p->connected;
    if (!connected)
        p->proto = proto;
    pthread_mutex_unlock(&p->mu);
    if (connected) {
        fmc_set_error("the protocol of a connected peer cannot change");
        return FMC_ERR_INVALID_ARGUMENT;
    }
    return FMC_OK;
}

/* The peer's process, when it runs on this host: zero-copy sends to it are fenced through its
 * end of each connection (fmc_zc_fence.c).  Before connect. */
int fmc_peer_set_owner_pid(fmc_peer *p, int pid)
{
    pthread_mutex_lock(&p->mu);
    int connected = p->connected;
    if (!connected)
        p->owner_pid = pid > 0 ? pid : 0;
    pthread_mutex_unlock(&p->mu);
    if (connected) {
        fmc_set_error("the owner of a connected peer cannot change");
        return FMC_ERR_INVALID_ARGUMENT;
    }
    return FMC_OK;
}

/* Stream i takes connection fd and starts on the I/O pool; FMC_OK, or an error with fd closed
 * (the stream stays dead). */
static int stream_take(fmc_peer *p, int i, int fd, uint64_t token)
{
    fmc_stream *st = &p->streams[i];
    if (fmc_reader_init(&st->rd, fd, 64u << 10) != 0) {
        close(fd);
        return FMC_ERR_MEMORY;
    }
    fmc_stream_reader_attach(&st->rd, fd);
    if (p->vectors)
        st->rd.max_read = 8u << 10; /* read vectors' payloads stay in the socket until scattered */
    pthread_mutex_lock(&st->mu);
    st->fd = fd;
    st->token = token;
    st->dead = 0;
    pthread_mutex_unlock(&st->mu);
    if (p->proto == FMC_PROTO_NATIVE && fmc_socket_is_local(fd))
        fmc_zc_fence_attach(p, &st, 1);
    int rc = fmc_stream_start(st);
    if (rc != FMC_OK)
        fmc_stream_kill(st); /* no side runs it: the peer is not healthy, and close closes fd */
    return rc;
}

/* A peer connects its first stream only: a peer that only ever takes small calls (a control
 * message, a same-host peer's fallback) costs one connection at each end, and hundreds of
 * initiators reaching one target at once set up a fraction of the connections.  The others are
 * connected by the I/O pool as transfers come that would use them (fmc_peer_grow). */
int fmc_peer_connect(fmc_peer *p, int timeout_ms)
{
    pthread_mutex_lock(&p->mu);
    int busy = p->connected || p->closed;
    p->connected = 1; /* claim: one connect per peer object */
    pthread_mutex_unlock(&p->mu);
    if (busy) {
        fmc_set_error("peer %s:%d is already connected or closed", p->host, p->data_port);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    p->connect_timeout_ms = timeout_ms;
    __atomic_store_n(&p->last_used_ms, fmc_now_ms(), __ATOMIC_RELAXED);
    uint64_t token;
    int fd = fmc_open_data_connection(p, fmc_now_ms() + timeout_ms, 0, &token, NULL);
    if (fd < 0)
        return fd;
    int rc = stream_take(p, 0, fd, token);
    if (rc == FMC_OK)
        atomic_store_explicit(&p->nready, 1, memory_order_release);
    return rc == FMC_OK && fmc_peer_is_healthy(p) ? FMC_OK : FMC_ERR_MEMORY;
}

/* Connect streams up to the wanted count (grow_want), in order, each usable as soon as it is up
 * (nready).  Runs on the I/O pool; a closing peer waits for it (p->growing) and stops it. */
static int connect_the_rest(fmc_peer *p)
{
    pthread_mutex_lock(&p->mu);
    int go = !p->closed;
    p->growing = go;
    pthread_mutex_unlock(&p->mu);
    if (!go)
        return 0;
    int reached = 1;
    int64_t deadline = fmc_now_ms() + (p->connect_timeout_ms > 0 ? p->connect_timeout_ms : 5000);
    for (int i = atomic_load(&p->nready); i < atomic_load(&p->grow_want); i++) {
        uint64_t token;
        int fd = fmc_open_data_connection(p, deadline, 0, &token, NULL);
        if (fd < 0) {
            fmc_engine_log(p->engine, "peer %s:%d keeps %d of its %d streams: %s", p->host, p->data_port, i,
                           p->nstreams, fmc_last_error());
            reached = 0;
            break;
        }
        pthread_mutex_lock(&p->mu);
        int closing = p->closed;
        pthread_mutex_unlock(&p->mu);
        if (closing) {
            close(fd);
            reached = 0;
            break;
        }
        if (stream_take(p, i, fd, token) != FMC_OK) {
            reached = 0;
            break;
        }
        atomic_store_explicit(&p->nready, i + 1, memory_order_release);
    }
    pthread_mutex_lock(&p->mu);
    p->growing = 0;
    pthread_cond_broadcast(&p->grow_cv);
    pthread_mutex_unlock(&p->mu);
    return reached;
}

static void grow_queue(fmc_peer *p);

static void grow_fire(fmc_pool_timer *t)
{
    fmc_peer *p = (fmc_peer *)((char *)t - offsetof(fmc_peer, grow));
    fmc_pool_blocking_begin(); /* connects, and maybe the peer's last release (closing it) */
    int reached = connect_the_rest(p);
    /* A larger transfer that came meanwhile wants more: once more, on the same queued flag and
     * reference, unless a stream could not be connected or the peer is closing (then the next
     * large transfer asks again). */
    if (reached && atomic_load(&p->nready) < atomic_load(&p->grow_want)) {
        fmc_io_pool_run_soon(&p->grow);
        fmc_pool_blocking_end();
        return;
    }
    atomic_store(&p->grow_queued, 0);
    if (reached && atomic_load(&p->nready) < atomic_load(&p->grow_want))
        grow_queue(p); /* wanted while the flag was still set: its fmc_peer_grow found it so */
    fmc_peer_release(p);
    fmc_pool_blocking_end();
}

static void grow_queue(fmc_peer *p)
{
    int idle = 0;
    if (!atomic_compare_exchange_strong(&p->grow_queued, &idle, 1))
        return; /* the queued run sees the new want */
    atomic_fetch_add(&p->refs, 1); /* the pool's, while grow_queued is set (fmc_peer_idle_ms) */
    p->grow.fire = grow_fire;
    fmc_io_pool_run_soon(&p->grow);
}

int fmc_peer_streams_ready(fmc_peer *p) { return atomic_load_explicit(&p->nready, memory_order_acquire); }

void fmc_peer_grow(fmc_peer *p, int want)
{
    if (want > p->nstreams)
        want = p->nstreams;
    int now = atomic_load(&p->grow_want);
    while (now < want && !atomic_compare_exchange_weak(&p->grow_want, &now, want))
        ;
    if (atomic_load_explicit(&p->nready, memory_order_acquire) < want)
        grow_queue(p);
}

/* Called before every synchronous transfer, so it takes no lock: each flag is one int that its
 * writers change under their mutex, read here atomically.  A stream that dies right after this
 * fails the transfer itself, as it would with locks. */
int fmc_peer_is_healthy(fmc_peer *p)
{
    int ok = __atomic_load_n(&p->connected, __ATOMIC_ACQUIRE) && !__atomic_load_n(&p->closed, __ATOMIC_ACQUIRE);
    int ready = atomic_load_explicit(&p->nready, memory_order_acquire);
    for (int i = 0; ok && i < ready; i++) /* a stream cut to come back still takes slices */
        ok = !__atomic_load_n(&p->streams[i].dead, __ATOMIC_ACQUIRE) ||
             __atomic_load_n(&p->streams[i].restart, __ATOMIC_ACQUIRE) ||
             __atomic_load_n(&p->streams[i].reconnecting, __ATOMIC_ACQUIRE);
    return ok;
}

/* How long the peer has gone unused: what the session cache's idle release asks (sessions.py).
 * A batch holds a reference on its peer until it is freed, so any more references than the
 * owner's mean a transfer in flight or not yet collected: busy, -1. */
int64_t fmc_peer_idle_ms(fmc_peer *p)
{
    /* The I/O pool's reference while it connects more streams is no transfer. */
    if (atomic_load(&p->refs) - atomic_load(&p->grow_queued) > 1)
        return -1;
    int64_t used = __atomic_load_n(&p->last_used_ms, __ATOMIC_RELAXED);
    int64_t idle = fmc_now_ms() - used;
    return idle > 0 ? idle : 0;
}
