/* Connecting a peer's data streams (native preamble, or none for Mooncake's framing), their
 * health, and closing them. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

/* The native preamble (and, with a shared secret, the authentication exchange) under a deadline. */
static int native_preamble(fmc_peer *p, int fd, int timeout_ms)
{
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    fmc_secret secret;
    pthread_mutex_lock(&p->engine->mu);
    secret = p->engine->secret;
    pthread_mutex_unlock(&p->engine->mu);
    uint32_t caps = 0;
    uint32_t flags = FMC_PREAMBLE_READ_ACKS | (p->engine->opts.vectors ? FMC_PREAMBLE_VECTORS : 0);
    int rc = fmc_auth_client(fd, &secret, flags, &caps);
    memset(&secret, 0, sizeof secret);
    if (rc == FMC_OK) {
        pthread_mutex_lock(&p->mu);
        p->vectors = (caps & FMC_CAP_VECTORS) != 0; /* one target: every stream gets the same */
        pthread_mutex_unlock(&p->mu);
    }
    struct timeval zero = {0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &zero, sizeof zero);
    return rc;
}

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
    int64_t deadline = fmc_now_ms() + timeout_ms;
    int fds[FMC_MAX_STREAMS];
    int rc = FMC_OK;
    int n = 0;
    for (; n < p->nstreams; n++) {
        int64_t left = deadline - fmc_now_ms();
        int fd = left > 0 ? fmc_tcp_connect_opts(p->host, p->data_port, (int)left, &p->engine->opts) : FMC_ERR_TIMEOUT;
        if (fd < 0) {
            if (fd == FMC_ERR_TIMEOUT)
                fmc_set_error("connecting to %s:%d timed out", p->host, p->data_port);
            rc = fd;
            break;
        }
        left = deadline - fmc_now_ms();
        int pr = FMC_OK; /* Mooncake's framing has no preamble */
        if (p->proto != FMC_PROTO_MOONCAKE)
            pr = left > 0 ? native_preamble(p, fd, (int)left) : FMC_ERR_TIMEOUT;
        if (pr == FMC_ERR_NOT_IMPLEMENTED) { /* no nonce for the authentication: the error says why */
            close(fd);
            rc = pr;
            break;
        }
        if (pr != FMC_OK) {
            close(fd);
            fmc_set_error("data port %s:%d %s", p->host, p->data_port,
                          pr == FMC_ERR_REMOTE_REFUSED ? "does not speak the flagcx_mc native protocol"
                          : pr == FMC_ERR_REJECT_HANDSHAKE ? "failed shared-secret authentication (secrets differ, or only one side has one)"
                                                           : "did not answer the preamble in time");
            rc = pr == FMC_ERR_TIMEOUT ? FMC_ERR_SOCKET : pr;
            break;
        }
        fds[n] = fd;
    }
    if (rc != FMC_OK) {
        for (int i = 0; i < n; i++)
            close(fds[i]);
        return rc;
    }
    for (int i = 0; i < p->nstreams; i++) {
        fmc_stream *st = &p->streams[i];
        st->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (st->wake_fd < 0 || fmc_reader_init(&st->rd, fds[i], 64u << 10) != 0) {
            close(fds[i]);
            continue; /* the stream stays dead: the peer is not healthy */
        }
        if (p->vectors)
            st->rd.max_read = 8u << 10; /* read vectors' payloads stay in the socket until scattered */
        pthread_mutex_lock(&st->mu);
        st->fd = fds[i];
        st->zc_link = fmc_socket_is_local(fds[i]);
        st->dead = 0;
        st->threads_alive = 2;
        pthread_mutex_unlock(&st->mu);
        if (pthread_create(&st->send_thread, NULL, fmc_stream_send_main, st) != 0) {
            st->threads_alive = 0;
            fmc_stream_kill(st);
            continue;
        }
        if (pthread_create(&st->recv_thread, NULL, fmc_stream_recv_main, st) != 0) {
            fmc_stream_kill(st);
            pthread_join(st->send_thread, NULL);
            st->threads_alive = 0;
            continue;
        }
        st->started = 1;
    }
    return fmc_peer_is_healthy(p) ? FMC_OK : FMC_ERR_MEMORY;
}

/* Called before every synchronous transfer, so it takes no lock: each flag is one int that its
 * writers change under their mutex, read here atomically.  A stream that dies right after this
 * fails the transfer itself, as it would with locks. */
int fmc_peer_is_healthy(fmc_peer *p)
{
    int ok = __atomic_load_n(&p->connected, __ATOMIC_ACQUIRE) && !__atomic_load_n(&p->closed, __ATOMIC_ACQUIRE);
    for (int i = 0; ok && i < p->nstreams; i++)
        ok = !__atomic_load_n(&p->streams[i].dead, __ATOMIC_ACQUIRE);
    return ok;
}

void fmc_peer_close(fmc_peer *p)
{
    pthread_mutex_lock(&p->mu);
    int was_closed = p->closed;
    p->closed = 1;
    pthread_mutex_unlock(&p->mu);
    if (was_closed)
        return;
    for (int i = 0; i < p->nstreams; i++) {
        fmc_stream *st = &p->streams[i];
        fmc_stream_kill(st);
        if (st->started) {
            pthread_join(st->send_thread, NULL);
            pthread_join(st->recv_thread, NULL);
        }
        pthread_mutex_lock(&st->mu);
        if (st->fd >= 0)
            close(st->fd);
        st->fd = -1;
        pthread_mutex_unlock(&st->mu);
    }
}
