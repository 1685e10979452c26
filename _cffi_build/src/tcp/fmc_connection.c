/* One data connection to a peer (native preamble and authentication, naming and fencing, or
 * nothing for Mooncake's framing), and a cut stream's reconnection through it.  Both connecting
 * a peer (fmc_peer_connect.c) and a stream's last side out (fmc_stream.c) use it. */
#define _GNU_SOURCE
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

/* The native preamble (and, with a shared secret, the authentication exchange) under a deadline;
 * *caps: what the target answered it can do. */
static int native_preamble(fmc_peer *p, int fd, int timeout_ms, uint32_t *caps)
{
    fmc_socket_timeout(fd, SO_RCVTIMEO, timeout_ms);
    fmc_secret secret;
    pthread_mutex_lock(&p->engine->mu);
    secret = p->engine->secret;
    pthread_mutex_unlock(&p->engine->mu);
    *caps = 0;
    uint32_t flags = FMC_PREAMBLE_READ_ACKS | (p->engine->opts.vectors ? FMC_PREAMBLE_VECTORS : 0);
    int rc = fmc_auth_client(fd, &secret, flags, caps);
    memset(&secret, 0, sizeof secret);
    if (rc == FMC_OK) {
        pthread_mutex_lock(&p->mu);
        p->vectors = (*caps & FMC_CAP_VECTORS) != 0; /* one target: every stream gets the same */
        pthread_mutex_unlock(&p->mu);
    }
    return rc;
}

/* A request of the fence protocol (fmc_wire.h): name this connection, or fence a cut one. */
static int send_control(int fd, int opcode, uint64_t token)
{
    fmc_req q = {.opcode = (uint8_t)opcode, .addr = token};
    uint8_t out[FMC_REQ_SIZE];
    fmc_req_encode(out, &q);
    return fmc_send_all(fd, out, sizeof out);
}

/* Name a new connection (*token, 0 where the target has no fences) and, if `fenced` is a cut
 * connection's token, wait until the target has let go of it.  The socket's receive timeout
 * (set by the preamble) bounds the wait. */
static int name_and_fence(int fd, uint32_t caps, uint64_t fenced, uint64_t *token)
{
    *token = 0;
    if (!(caps & FMC_CAP_FENCE))
        return FMC_OK;
    uint64_t t = 0;
    while (t == 0)
        if (fmc_random_bytes(&t, sizeof t) < 0)
            return FMC_ERR_SOCKET;
    if (send_control(fd, FMC_WIRE_OP_NAME, t) < 0)
        return FMC_ERR_SOCKET;
    *token = t;
    if (!fenced)
        return FMC_OK;
    uint8_t in[FMC_RESP_SIZE];
    fmc_resp a;
    if (send_control(fd, FMC_WIRE_OP_FENCE, fenced) < 0 || fmc_recv_all(fd, in, sizeof in) < 0)
        return FMC_ERR_SOCKET;
    fmc_resp_decode(in, &a);
    return a.id == 0 && a.status == FMC_OK && a.len == 0 ? FMC_OK : FMC_ERR_SOCKET;
}

/* A stream's socket, ready for its sides: its blocking calls time out every FMC_STALL_TICK_MS,
 * so that the I/O pool's worker in one tells a peer that stalls (fmc_pool_stall, fmc_stream.c);
 * a caller's deadline sets its own timeouts and puts these back. */
static int stall_ticks(int fd)
{
    fmc_socket_timeout(fd, SO_RCVTIMEO, FMC_STALL_TICK_MS);
    fmc_socket_timeout(fd, SO_SNDTIMEO, FMC_STALL_TICK_MS);
    return fd;
}

/* One data connection to the peer, ready for requests: connected, the preamble exchanged (none
 * for Mooncake's framing), named, and, with `fenced` set, the target rid of that cut connection.
 * Returns the fd, or a negative code with the error set.  `*slot`, if given, holds the fd while
 * the target is waited for, so that a kill can interrupt it (fmc_stream_reconnect). */
int fmc_open_data_connection(fmc_peer *p, int64_t deadline, uint64_t fenced, uint64_t *token, fmc_stream *slot)
{
    *token = 0;
    int64_t left = deadline - fmc_now_ms();
    int fd = left > 0 ? fmc_tcp_connect_opts(p->host, p->data_port, (int)left, &p->engine->opts) : FMC_ERR_TIMEOUT;
    if (fd < 0) {
        if (fd == FMC_ERR_TIMEOUT)
            fmc_set_error("connecting to %s:%d timed out", p->host, p->data_port);
        return fd;
    }
    if (p->proto == FMC_PROTO_MOONCAKE) /* Mooncake's framing has no preamble */
        return stall_ticks(fd);
    if (slot) {
        pthread_mutex_lock(&slot->mu);
        int closing = __atomic_load_n(&p->closed, __ATOMIC_ACQUIRE);
        if (!closing)
            slot->fd = fd;
        pthread_mutex_unlock(&slot->mu);
        if (closing) {
            close(fd);
            fmc_set_error("peer %s:%d is closing", p->host, p->data_port);
            return FMC_ERR_SOCKET;
        }
    }
    left = deadline - fmc_now_ms();
    uint32_t caps = 0;
    int pr = left > 0 ? native_preamble(p, fd, (int)left, &caps) : FMC_ERR_TIMEOUT;
    if (pr == FMC_OK && name_and_fence(fd, caps, fenced, token) != FMC_OK) {
        fmc_set_error("data port %s:%d did not let go of a cut connection in time", p->host, p->data_port);
        pr = FMC_ERR_SOCKET;
    } else if (pr != FMC_OK && pr != FMC_ERR_NOT_IMPLEMENTED) { /* that one's error says why */
        fmc_set_error("data port %s:%d %s", p->host, p->data_port,
                      pr == FMC_ERR_REMOTE_REFUSED ? "does not speak the flagcx_mc native protocol"
                      : pr == FMC_ERR_REJECT_HANDSHAKE ? "failed shared-secret authentication (secrets differ, or only one side has one)"
                                                       : "did not answer the preamble in time");
        if (pr == FMC_ERR_TIMEOUT)
            pr = FMC_ERR_SOCKET;
    }
    if (slot) {
        pthread_mutex_lock(&slot->mu);
        slot->fd = -1;
        pthread_mutex_unlock(&slot->mu);
    }
    if (pr != FMC_OK) {
        close(fd);
        return pr;
    }
    return stall_ticks(fd);
}

void fmc_stream_reader_attach(fmc_reader *rd, int fd)
{
    rd->fd = fd;
    rd->start = rd->end = 0;
    rd->base_timeout_ms = FMC_STALL_TICK_MS;
}

/* Connect a stream cut by a cancel again.  Called by the last of its sides to leave the old
 * connection (so the stream's socket state is this worker's alone), with the cut
 * connection fenced at the target first.  A peer being closed interrupts it: the kill shuts the
 * socket being set up down.  Connecting is tried for the peer's connect timeout. */
int fmc_stream_reconnect(fmc_stream *st)
{
    fmc_peer *p = st->peer;
    int64_t deadline = fmc_now_ms() + (p->connect_timeout_ms > 0 ? p->connect_timeout_ms : 5000);
    uint64_t token = 0;
    int fd = fmc_open_data_connection(p, deadline, st->token, &token, st);
    if (fd < 0) {
        fmc_engine_log(p->engine, "could not reconnect a cut stream to %s:%d: %s", p->host, p->data_port,
                       fmc_last_error());
        return fd;
    }
    pthread_mutex_lock(&st->mu);
    int closing = __atomic_load_n(&p->closed, __ATOMIC_ACQUIRE);
    if (!closing) {
        st->fd = fd;
        st->token = token;
        fmc_stream_reader_attach(&st->rd, fd);
        st->zc_link = 0; /* copied sends until fmc_zc_fence_attach finds the new far end */
        st->target_fd = -1;
        st->dead = 0;
    }
    pthread_mutex_unlock(&st->mu);
    if (closing) {
        close(fd);
        return FMC_ERR_SOCKET;
    }
    if (p->proto == FMC_PROTO_NATIVE && fmc_socket_is_local(fd)) {
        fmc_stream *one = st;
        fmc_zc_fence_attach(p, &one, 1);
    }
    return FMC_OK;
}
