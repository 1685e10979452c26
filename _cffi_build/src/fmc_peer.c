/* Initiator side: a peer is one remote engine, its region table and N persistent data streams.
 * Each stream has a sender thread (gathers queued slices into one sendmsg) and a receiver thread
 * (consumes answers in order, reads read-payloads straight into local memory).  A slice is only
 * declared finished once no thread touches its memory any more: that is what lets a timed-out
 * call return with its buffers free. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <stdio.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

#define FMC_DEFAULT_SLICE (1ull << 20)
#define FMC_MIN_SLICE (4ull << 10)

static void list_push(fmc_slice_list *l, fmc_slice *s)
{
    s->next = NULL;
    if (l->tail)
        l->tail->next = s;
    else
        l->head = s;
    l->tail = s;
}

static void list_append(fmc_slice_list *dst, fmc_slice_list *src)
{
    if (!src->head)
        return;
    if (dst->tail)
        dst->tail->next = src->head;
    else
        dst->head = src->head;
    dst->tail = src->tail;
    src->head = src->tail = NULL;
}

/* ------------------------------------------------------------------ stream threads */

static void wake_receiver(fmc_stream *st)
{
    uint64_t one = 1;
    if (st->wake_fd >= 0 && write(st->wake_fd, &one, sizeof one) < 0) {
        /* EAGAIN only: the counter is already non-zero, so the receiver wakes anyway */
    }
}

/* Called by each stream thread as it leaves; the last one out fails whatever is left, which is
 * safe because neither thread can touch slice memory any more. */
static void stream_thread_exit(fmc_stream *st)
{
    fmc_slice_list left = {0};
    pthread_mutex_lock(&st->mu);
    if (!st->dead) {
        st->dead = 1;
        if (st->fd >= 0)
            shutdown(st->fd, SHUT_RDWR);
    }
    pthread_cond_broadcast(&st->cv);
    wake_receiver(st);
    if (--st->threads_alive == 0) {
        while (st->sending_active) /* an inline sender still in sendmsg: shutdown ends it soon */
            pthread_cond_wait(&st->cv, &st->mu);
        /* Neither thread uses the socket any more: close it now, abortively.  After shutdown()
         * the receiver drains what is queued and a plain close() then sends only a FIN while our
         * window stays shut, which leaves a target blocked in sendmsg (read answers) on a
         * CLOSE-WAIT socket for minutes; the RST ends it at once.  kill/close read fd under mu. */
        if (st->fd >= 0) {
            struct linger lg = {.l_onoff = 1, .l_linger = 0};
            setsockopt(st->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
            close(st->fd);
            st->fd = -1;
        }
        list_append(&left, &st->receiving);
        list_append(&left, &st->inflight);
        list_append(&left, &st->answered); /* empty in practice: the sender drains it */
        list_append(&left, &st->pending);
    }
    pthread_mutex_unlock(&st->mu);
    fmc_slices_finish(left.head, FMC_ERR_SOCKET);
}

static void kill_locked(fmc_stream *st)
{
    st->dead = 1;
    if (st->fd >= 0)
        shutdown(st->fd, SHUT_RDWR);
    pthread_cond_broadcast(&st->cv);
    wake_receiver(st);
}

void fmc_stream_kill(fmc_stream *st)
{
    pthread_mutex_lock(&st->mu);
    kill_locked(st);
    pthread_mutex_unlock(&st->mu);
}

/* Remember whether the batch now queued is bulk (see fmc_stream's recv_in). */
static void note_batch_size(fmc_stream *st, const fmc_slice_list *list)
{
    if (list->head)
        st->bulk = list->head->batch->bytes > FMC_SMALL_TRANSFER_BYTES;
}

int fmc_stream_enqueue(fmc_stream *st, fmc_slice_list *list)
{
    pthread_mutex_lock(&st->mu);
    if (st->dead) {
        pthread_mutex_unlock(&st->mu);
        return FMC_ERR_SOCKET;
    }
    note_batch_size(st, list);
    list_append(&st->pending, list);
    pthread_cond_signal(&st->cv);
    pthread_mutex_unlock(&st->mu);
    return FMC_OK;
}

/* Consumed zero-copy answers are acknowledged with the next request, or on their own once this
 * many are owed (the target holds at most 256; fmc_server.c) or the stream has been idle for
 * ZC_ACK_IDLE_MS.  Back-to-back batches thus carry their acks for free, instead of waking the
 * sender thread, and the target's thread, at the end of every batch; an idle stream still
 * acknowledges well within unregister's 200 ms grace. */
#define ZC_ACK_EVERY 64
#define ZC_ACK_IDLE_MS 2

static int ack_due(const fmc_stream *st)
{
    return st->zc_owed && (st->zc_owed >= ZC_ACK_EVERY || st->zc_ack_idle);
}

/* The receive side, with st->mu held: an acknowledgement due while no round is running goes out
 * from the sender thread (a running round's end sees it and wakes that thread). */
static void send_ack_if_due_locked(fmc_stream *st)
{
    if (ack_due(st) && !st->sending_active)
        pthread_cond_signal(&st->cv);
}

typedef struct send_scratch {
    uint8_t hdr[FMC_IOV_MAX][FMC_REQ_SIZE];
    uint8_t ack[FMC_REQ_SIZE];
    uint8_t table[FMC_IOV_MAX][FMC_VEC_ENTRY_SIZE]; /* vector entries of the current sendmsg */
    struct iovec iov[FMC_IOV_MAX];
    uint8_t zc[FMC_IOV_MAX];        /* iov[i] may go out zero-copy (fmc_splice.c) */
    fmc_slice *writes[FMC_IOV_MAX]; /* write slices of the current sendmsg */
    uint64_t copy_dst[FMC_IOV_MAX], copy_src[FMC_IOV_MAX]; /* its GPU sources' staging copies */
    size_t copy_len[FMC_IOV_MAX];
} send_scratch;

/* A write payload that may leave zero-copy (fmc_splice.c): host memory (GPU sources are staged
 * in a buffer the next round reuses), large enough to pay for the extra syscalls, and to our own
 * targets, which check for a reset before it lands. */
static int zero_copy_payload(const fmc_stream *st, int local_dev, uint64_t len)
{
    return local_dev < 0 && len >= FMC_ZC_MIN_BYTES && st->peer->proto == FMC_PROTO_NATIVE;
}

/* Small slices of one batch travel as vectors when the target takes them: writes from host or
 * GPU memory (GPU sources are staged like any other, stage_gpu_sources), reads into host memory
 * only (a vector's payloads are scattered by one recvmsg, which cannot write GPU memory). */
static int vectorizable(const fmc_peer *p, const fmc_slice *s)
{
    return p->vectors && s->len <= FMC_VEC_ENTRY_MAX && (s->local_dev < 0 || s->batch->opcode == FMC_OP_WRITE);
}

/* How many slices from s on can form one vector, within this round's limits. */
static int vector_length(const fmc_peer *p, const fmc_slice *s, int niov, int nentries, size_t bytes)
{
    int is_write = s->batch->opcode == FMC_OP_WRITE, k = 0;
    for (const fmc_slice *x = s; x && k < FMC_VEC_MAX && x->batch == s->batch && vectorizable(p, x); x = x->next) {
        if (nentries + k + 1 > FMC_IOV_MAX || (is_write && niov + 2 + k + 1 > FMC_IOV_MAX) ||
            (k > 0 && bytes >= FMC_COALESCE_BYTES))
            break;
        if (is_write)
            bytes += x->len;
        k++;
    }
    return k;
}

/* One request header in the peer's framing; returns its length. */
static size_t encode_request(int proto, const fmc_slice *s, int is_write, uint8_t out[FMC_REQ_SIZE])
{
    if (proto == FMC_PROTO_MOONCAKE) {
        uint8_t op = (uint8_t)((is_write ? FMC_MC_OP_WRITE : FMC_MC_OP_READ) | FMC_MC_V2_FLAG);
        fmc_mc_hdr_encode(out, s->len, s->remote, op);
        return FMC_MC_HDR_SIZE;
    }
    fmc_req q = {.opcode = is_write ? FMC_WIRE_OP_WRITE : FMC_WIRE_OP_READ,
                 .key = s->key, .id = s->id, .addr = s->remote, .len = s->len};
    fmc_req_encode(out, &q);
    return FMC_REQ_SIZE;
}

/* GPU sources cannot go to sendmsg: copy them into the stream's host staging buffer and point
 * their iovecs there.  The round owns the staging buffer (sending_active). */
static int stage_gpu_sources(fmc_stream *st, send_scratch *sc, int niov, int nw)
{
    size_t need = 0;
    for (int i = 0; i < nw; i++)
        if (sc->writes[i]->local_dev >= 0)
            need += sc->writes[i]->len;
    if (!need)
        return 0;
    if (fmc_staging_reserve(&st->send_stage, need) != 0)
        return -1;
    /* Queue every copy of the round (runs of one device as one batch, contiguous sources merged
     * into one copy, since the staging side is contiguous), then wait once per device used. */
    size_t off = 0;
    int rc = 0, n = 0, run_dev = -1;
    uint64_t devices = 0; /* bit per GPU ordinal < 64 that got copies */
    for (int i = 0, v = 0; v < niov && i < nw; v++) {
        fmc_slice *s = sc->writes[i];
        if (sc->iov[v].iov_base != (void *)(uintptr_t)s->local || sc->iov[v].iov_len != s->len)
            continue; /* a header or a vector table */
        if (s->local_dev >= 0) {
            if (n > 0 && s->local_dev != run_dev) {
                rc |= fmc_cuda_copy_many_async(sc->copy_dst, sc->copy_src, sc->copy_len, n, run_dev);
                n = 0;
            }
            run_dev = s->local_dev;
            uint8_t *dst = st->send_stage.buf + off;
            sc->copy_dst[n] = (uint64_t)(uintptr_t)dst;
            sc->copy_src[n] = s->local;
            sc->copy_len[n++] = (size_t)s->len;
            devices |= 1ull << (s->local_dev & 63);
            sc->iov[v].iov_base = dst;
            off += s->len;
        }
        i++;
    }
    if (n > 0)
        rc |= fmc_cuda_copy_many_async(sc->copy_dst, sc->copy_src, sc->copy_len, n, run_dev);
    for (int d = 0; d < 64; d++)
        if ((devices >> d) & 1)
            rc |= fmc_cuda_wait(d);
    return rc == 0 ? 0 : -1;
}

/* One send round: gather queued slices (and owed acknowledgements) into one sendmsg and send
 * it.  Called with st->mu held, pending non-empty or an acknowledgement due, and no other round
 * in progress; returns with st->mu held.  The slices move
 * to `inflight` before the first byte leaves, because their answers may come back before
 * sendmsg returns.  deadline_ms < 0: block; otherwise give up at that time (-2). */
static int send_round(fmc_stream *st, int64_t deadline_ms)
{
    if (!st->scratch && !(st->scratch = malloc(sizeof *st->scratch)))
        return -1;
    send_scratch *sc = st->scratch;
    int niov = 0, nh = 0, nw = 0, nent = 0, nzc = 0;
    size_t bytes = 0;
    st->sending_active = 1;
    if (st->zc_owed && st->peer->proto == FMC_PROTO_NATIVE) {
        fmc_req ack = {.opcode = FMC_WIRE_OP_ACK, .len = st->zc_owed};
        fmc_req_encode(sc->ack, &ack);
        st->zc_owed = 0;
        st->zc_ack_idle = 0;
        sc->zc[niov] = 0;
        sc->iov[niov++] = (struct iovec){.iov_base = sc->ack, .iov_len = FMC_REQ_SIZE};
    }
    fmc_slice *first_sent = st->pending.head;
    while (st->pending.head && niov + 2 <= FMC_IOV_MAX && (bytes < FMC_COALESCE_BYTES || niov == 0)) {
        fmc_slice *s = st->pending.head;
        int is_write = s->batch->opcode == FMC_OP_WRITE;
        int k = niov + 3 <= FMC_IOV_MAX && vectorizable(st->peer, s) ? vector_length(st->peer, s, niov, nent, bytes) : 1;
        if (k >= 2) {
            /* One header, the table of k entries, then (writes) the k payloads. */
            uint8_t *table = sc->table[nent];
            uint64_t sum = 0;
            for (int j = 0; j < k; j++) {
                fmc_slice *x = st->pending.head;
                st->pending.head = x->next;
                list_push(&st->inflight, x);
                x->vec_n = j == 0 ? k : 1;
                fmc_vec_entry_encode(sc->table[nent++], x->key, x->remote, x->len);
                sum += x->len;
            }
            if (!st->pending.head)
                st->pending.tail = NULL;
            fmc_req q = {.opcode = is_write ? FMC_WIRE_OP_WRITEV : FMC_WIRE_OP_READV, .key = (uint32_t)k,
                         .id = s->id, .addr = 0, .len = sum};
            fmc_req_encode(sc->hdr[nh], &q);
            sc->zc[niov] = sc->zc[niov + 1] = 0;
            sc->iov[niov++] = (struct iovec){.iov_base = sc->hdr[nh++], .iov_len = FMC_REQ_SIZE};
            sc->iov[niov++] = (struct iovec){.iov_base = table, .iov_len = (size_t)k * FMC_VEC_ENTRY_SIZE};
            bytes += FMC_REQ_SIZE + (size_t)k * FMC_VEC_ENTRY_SIZE;
            int dev = -1; /* a GPU source's, if any (staged: the vector is copied) */
            const fmc_slice *y = s;
            for (int j = 0; is_write && j < k; j++, y = y->next) /* linked in order on `inflight` */
                dev = y->local_dev >= 0 ? y->local_dev : dev;
            int zc = is_write && zero_copy_payload(st, dev, sum);
            nzc += zc;
            for (fmc_slice *x = s; is_write && k--; x = x->next) {
                sc->zc[niov] = (uint8_t)zc;
                sc->iov[niov++] = (struct iovec){.iov_base = (void *)(uintptr_t)x->local, .iov_len = x->len};
                bytes += x->len;
                x->sending = 1;
                sc->writes[nw++] = x;
            }
            continue;
        }
        st->pending.head = s->next;
        if (!st->pending.head)
            st->pending.tail = NULL;
        list_push(&st->inflight, s);
        s->vec_n = 1;
        size_t hlen = encode_request(st->peer->proto, s, is_write, sc->hdr[nh]);
        sc->zc[niov] = 0;
        sc->iov[niov++] = (struct iovec){.iov_base = sc->hdr[nh++], .iov_len = hlen};
        bytes += hlen;
        if (is_write) {
            sc->zc[niov] = (uint8_t)zero_copy_payload(st, s->local_dev, s->len);
            nzc += sc->zc[niov];
            sc->iov[niov++] = (struct iovec){.iov_base = (void *)(uintptr_t)s->local, .iov_len = s->len};
            bytes += s->len;
            s->sending = 1;
            sc->writes[nw++] = s;
        }
    }
    if (first_sent && st->recv_parked && !st->caller_recv && !st->recv_in)
        wake_receiver(st); /* answers will come: before the first byte leaves */
    int fd = st->fd;
    pthread_mutex_unlock(&st->mu);
    int rc = stage_gpu_sources(st, sc, niov, nw);
    if (rc == 0 && deadline_ms >= 0)
        rc = fmc_sendv_deadline(fd, sc->iov, niov, deadline_ms);
    else if (rc == 0)
        rc = nzc && fmc_zc_enabled() ? fmc_sendv_zc(fd, sc->iov, niov, sc->zc, st->zc_pipe) : fmc_sendv_all(fd, sc->iov, niov);
    pthread_mutex_lock(&st->mu);
    /* sendmsg no longer reads these slices.  Nobody else finishes a slice while `sending` is
     * set, so the pointers are still valid; the ones already answered are ours to finish. */
    for (int i = 0; i < nw; i++)
        sc->writes[i]->sending = 0;
    st->sending_active = 0;
    /* Wake the sender thread only for queued work, and an exit path waiting to close fd: a
     * needless wake-up per inline call costs the caller a context switch on a small machine. */
    if (st->pending.head || st->dead || ack_due(st))
        pthread_cond_broadcast(&st->cv);
    if (st->answered.head) {
        fmc_slice *s = st->answered.head;
        st->answered.head = st->answered.tail = NULL;
        pthread_mutex_unlock(&st->mu);
        fmc_slices_finish(s, FMC_TASK_PENDING); /* each with its parked answer_status */
        pthread_mutex_lock(&st->mu);
    }
    return rc;
}

void *fmc_stream_send_main(void *arg)
{
    fmc_stream *st = arg;
    /* splice() has no MSG_NOSIGNAL: a peer gone mid-send must not raise SIGPIPE in the host
     * process (EPIPE is enough); a signal left pending on this thread dies with it. */
    sigset_t pipe_signal;
    sigemptyset(&pipe_signal);
    sigaddset(&pipe_signal, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_signal, NULL);
    pthread_mutex_lock(&st->mu);
    for (;;) {
        while (!st->dead && ((!st->pending.head && !ack_due(st)) || st->sending_active))
            pthread_cond_wait(&st->cv, &st->mu);
        if (st->dead)
            break;
        if (send_round(st, -1) < 0)
            break;
    }
    pthread_mutex_unlock(&st->mu);
    stream_thread_exit(st);
    return NULL;
}

/* Queue `list` and, when the stream is idle, send it from the calling thread: a small transfer
 * then costs no wake-up of the sender thread.  With `claim_recv` set, a caller that finds the
 * receive side idle too takes it (*claimed = 1) and must then call fmc_stream_caller_receive.
 * A send that cannot finish by the deadline cuts the stream (its slices then fail, reported as
 * a timeout). */
int fmc_stream_enqueue_inline(fmc_stream *st, fmc_slice_list *list, int64_t deadline_ms, int claim_recv, int *claimed)
{
    *claimed = 0;
    pthread_mutex_lock(&st->mu);
    if (st->dead) {
        pthread_mutex_unlock(&st->mu);
        return FMC_ERR_SOCKET;
    }
    int idle = !st->pending.head && !st->sending_active;
    note_batch_size(st, list);
    if (idle && claim_recv && st->recv_parked && !st->recv_in && !st->inflight.head && !st->caller_recv &&
        st->peer->proto == FMC_PROTO_NATIVE && fmc_reader_buffered(&st->rd) == 0)
        *claimed = st->caller_recv = 1;
    list_append(&st->pending, list);
    if (!idle) {
        pthread_cond_signal(&st->cv);
        pthread_mutex_unlock(&st->mu);
        return FMC_OK;
    }
    int rc = send_round(st, deadline_ms);
    if (st->pending.head)
        pthread_cond_signal(&st->cv);
    pthread_mutex_unlock(&st->mu);
    if (rc < 0)
        fmc_stream_kill(st);
    return rc == -2 ? FMC_ERR_TIMEOUT : FMC_OK; /* other failures surface through the slices */
}

static int remote_status(int32_t status)
{
    if (status == FMC_OK || status == FMC_ERR_REMOTE_REFUSED || status == FMC_ERR_ADDRESS_NOT_REGISTERED)
        return status;
    return FMC_ERR_SOCKET;
}

/* A read into GPU memory whose host-to-device copy is still running: the receiver reads the
 * next payload into the other staging buffer meanwhile.  The slice stays on st->receiving (so a
 * cancel cuts the stream) and is finished once its copy has landed. */
typedef struct {
    fmc_slice *s;
    int in_stage2;
} gpu_landing;

static void receiving_remove(fmc_stream *st, fmc_slice *x)
{
    fmc_slice **pp = &st->receiving.head, *prev = NULL;
    while (*pp && *pp != x) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (!*pp)
        return;
    *pp = x->next;
    if (st->receiving.tail == x)
        st->receiving.tail = prev;
}

/* Wait for the pending copy, then hand its slice to `done`.  Called without st->mu. */
static void land_pending(fmc_stream *st, gpu_landing *g, fmc_slice_list *done)
{
    if (!g->s)
        return;
    if (fmc_cuda_wait(g->s->local_dev) != FMC_OK)
        g->s->answer_status = FMC_ERR_DEVICE_NOT_FOUND;
    pthread_mutex_lock(&st->mu);
    receiving_remove(st, g->s);
    pthread_mutex_unlock(&st->mu);
    list_push(done, g->s);
    g->s = NULL;
}

/* A read's payload: straight into host memory, or into a staging buffer whose copy to the GPU
 * then runs while the next payload arrives (the previous pending one is landed first).  A
 * payload into host memory lands the pending one first, so `done` keeps answer order. */
static int receive_payload(fmc_stream *st, fmc_reader *rd, fmc_slice *s, gpu_landing *g, fmc_slice_list *done)
{
    if (s->local_dev < 0) {
        land_pending(st, g, done);
        return fmc_reader_read_into(rd, (void *)(uintptr_t)s->local, (size_t)s->len);
    }
    int use2 = g->s && !g->in_stage2;
    fmc_staging *stage = use2 ? &st->recv_stage2 : &st->recv_stage;
    if (fmc_staging_reserve(stage, (size_t)s->len) != 0 || fmc_reader_read_into(rd, stage->buf, (size_t)s->len) < 0)
        return -1;
    land_pending(st, g, done);
    if (fmc_cuda_copy_async(s->local, (uint64_t)(uintptr_t)stage->buf, (size_t)s->len, s->local_dev) != FMC_OK)
        return -1;
    g->s = s;
    g->in_stage2 = use2;
    return 1; /* lands later: land_pending finishes it */
}

/* The rest of a vector's answer `a` for the k slices on st->receiving (see fmc_wire.h): entry
 * statuses when it failed, then a read's payloads, scattered straight into place.  Sets each
 * slice's answer_status; -1 if the answer does not fit the request. */
static int receive_vector(fmc_stream *st, fmc_reader *rd, const fmc_resp *a, int k)
{
    int is_read = st->receiving.head->batch->opcode == FMC_OP_READ;
    uint64_t expect = 0;
    if (a->status != FMC_OK) {
        if (a->len < (uint64_t)k * 4 || fmc_reader_fill(rd, (size_t)k * 4) < 0)
            return -1;
        expect = (uint64_t)k * 4;
    }
    struct iovec iov[FMC_VEC_MAX];
    int n = 0, j = 0;
    for (fmc_slice *x = st->receiving.head; x; x = x->next, j++) {
        int32_t status = a->status == FMC_OK ? FMC_OK : (int32_t)fmc_get32(rd->buf + rd->start + 4 * (size_t)j);
        x->answer_status = remote_status(status);
        if (is_read && status == FMC_OK) {
            iov[n++] = (struct iovec){.iov_base = (void *)(uintptr_t)x->local, .iov_len = (size_t)x->len};
            expect += x->len;
        }
    }
    if (a->status != FMC_OK)
        rd->start += (size_t)k * 4;
    if (a->len != expect)
        return -1;
    return n ? fmc_reader_read_iov(rd, iov, n) : 0;
}

/* A zero-copy answer's bytes were copied out of the target's pages just now; a target that
 * reset the connection may have released them first (fmc_wire.h), so they cannot count. */
static int zc_answer_void(fmc_stream *st, const fmc_resp *a)
{
    if (!(a->flags & FMC_RESP_ZC))
        return 0;
    if (fmc_socket_reset(st->rd.fd)) {
        fmc_engine_log(st->peer->engine, "peer %s:%d reset the connection under a zero-copy read answer; "
                       "its reads fail", st->peer->host, st->peer->data_port);
        return 1;
    }
    return 0;
}

/* The next answer header in the peer's framing; -1 on EOF or an impossible status. */
static int read_answer(int proto, fmc_reader *rd, fmc_resp *a)
{
    if (proto == FMC_PROTO_MOONCAKE) {
        if (fmc_reader_fill(rd, FMC_MC_STATUS_SIZE) < 0)
            return -1;
        uint64_t v = fmc_get64(rd->buf + rd->start);
        rd->start += FMC_MC_STATUS_SIZE;
        if (v != FMC_MC_STATUS_OK && v != FMC_MC_STATUS_REJECTED)
            return -1;
        a->id = 0;
        a->flags = 0;
        a->len = 0;
        a->status = v == FMC_MC_STATUS_OK ? FMC_OK : FMC_ERR_REMOTE_REFUSED;
        return 0;
    }
    if (fmc_reader_fill(rd, FMC_RESP_SIZE) < 0)
        return -1;
    fmc_resp_decode(rd->buf + rd->start, a);
    rd->start += FMC_RESP_SIZE;
    return 0;
}

static void log_bad_answer(fmc_stream *st, const char *what)
{
    fmc_engine_log(st->peer->engine, "peer %s:%d sent %s; stream closed", st->peer->host, st->peer->data_port, what);
}

/* An answer header is already buffered: it can be taken without a syscall. */
static int answer_buffered(int proto, const fmc_reader *rd)
{
    return fmc_reader_buffered(rd) >= (proto == FMC_PROTO_MOONCAKE ? FMC_MC_STATUS_SIZE : FMC_RESP_SIZE);
}

/* Write answers already buffered for the slices at the head of `inflight`, taken the way the
 * receiver thread takes them (native framing; writes carry no payload back, so nothing needs
 * placing).  Called with st->mu held by the caller that owns the receive side.  Returns 1 to
 * keep polling, 0 to stop: nothing in flight, or an answer this path leaves to the thread (a
 * read's, or one that matches no request: the thread reports it). */
static int take_write_answers_locked(fmc_stream *st, fmc_slice_list *done)
{
    fmc_reader *rd = &st->rd;
    for (;;) {
        fmc_slice *s = st->inflight.head;
        if (!s || s->batch->opcode != FMC_OP_WRITE)
            return 0;
        if (fmc_reader_buffered(rd) < FMC_RESP_SIZE)
            return 1;
        fmc_resp a;
        fmc_resp_decode(rd->buf + rd->start, &a);
        int k = s->vec_n >= 2 ? s->vec_n : 1;
        size_t statuses = k >= 2 && a.status != FMC_OK ? (size_t)k * 4 : 0; /* see fmc_wire.h */
        if (a.id != s->id || a.len != statuses)
            return 0;
        if (fmc_reader_buffered(rd) < FMC_RESP_SIZE + statuses)
            return 1;
        const uint8_t *entry = rd->buf + rd->start + FMC_RESP_SIZE;
        for (int j = 0; j < k; j++, entry += 4) {
            fmc_slice *x = st->inflight.head;
            if (!x)
                return 0; /* cannot happen: a vector's slices enter `inflight` together */
            st->inflight.head = x->next;
            x->answer_status = remote_status(statuses ? (int32_t)fmc_get32(entry) : a.status);
            list_push(x->sending ? &st->answered : done, x);
        }
        if (!st->inflight.head)
            st->inflight.tail = NULL;
        rd->start += FMC_RESP_SIZE + statuses;
    }
}

/* The caller that claimed the receive side (fmc_stream_enqueue_inline) polls the socket for
 * its answers until batch `b` is finished or `until_us` passes, then hands the receive side
 * back.  On a 2-core machine this is what makes a small synchronous write cheap: only the
 * caller and the target's thread run, and no sleeping receiver needs waking. */
void fmc_stream_caller_receive(fmc_stream *st, fmc_batch *b, int64_t until_us)
{
    int got = 0;
    for (;;) {
        fmc_slice_list done = {0};
        pthread_mutex_lock(&st->mu);
        int more = !st->dead && take_write_answers_locked(st, &done);
        pthread_mutex_unlock(&st->mu);
        fmc_slices_finish(done.head, FMC_TASK_PENDING);
        if (!more || __atomic_load_n(&b->finished, __ATOMIC_ACQUIRE) || fmc_now_us() >= until_us)
            break;
        got = fmc_reader_try_more(&st->rd);
        if (got < 0)
            break; /* EOF or error: the thread reads it again and fails the stream */
        if (got == 0)
            sched_yield();
    }
    pthread_mutex_lock(&st->mu);
    st->caller_recv = 0;
    if (st->recv_parked && (st->inflight.head || st->recv_blind || got < 0))
        wake_receiver(st);
    pthread_mutex_unlock(&st->mu);
}

/* Park while nothing is in flight or a caller reads its own answers (see fmc_stream); 0 once
 * the stream is dead.  A peer that closes an idle stream kills it here, so the session cache
 * sees it as unhealthy and reconnects before the next transfer. */
static int receiver_park(fmc_stream *st)
{
    pthread_mutex_lock(&st->mu);
    while (!st->dead && (st->caller_recv || !st->inflight.head)) {
        int watch = !st->caller_recv; /* a caller that owns the socket sees its EOF itself */
        st->recv_parked = 1;
        st->recv_blind = !watch;
        st->recv_in = watch && st->bulk;
        int owed = st->zc_owed != 0;
        short events = (short)(POLLRDHUP | (st->recv_in ? POLLIN : 0));
        pthread_mutex_unlock(&st->mu);
        struct pollfd pf[2] = {{.fd = st->wake_fd, .events = POLLIN}, {.fd = st->rd.fd, .events = events}};
        int ready = poll(pf, watch ? 2 : 1, owed ? ZC_ACK_IDLE_MS : -1);
        if (ready < 0 && errno != EINTR)
            pf[1].revents = POLLERR;
        if (ready == 0) { /* idle with acknowledgements owed: the sender thread sends them */
            pthread_mutex_lock(&st->mu);
            st->zc_ack_idle = st->zc_owed != 0; /* a round may have sent them meanwhile */
            send_ack_if_due_locked(st);
            pthread_mutex_unlock(&st->mu);
        }
        uint64_t count;
        if (pf[0].revents && read(st->wake_fd, &count, sizeof count) < 0) {
            /* EAGAIN: another wake-up consumed it first */
        }
        pthread_mutex_lock(&st->mu);
        st->recv_parked = st->recv_blind = st->recv_in = 0;
        if (watch && pf[1].revents && !st->caller_recv && !st->inflight.head)
            kill_locked(st); /* closed (or sent bytes nobody asked for) while idle */
    }
    int alive = !st->dead;
    pthread_mutex_unlock(&st->mu);
    return alive;
}

/* Matches answers to in-flight slices, in order.  The answers already buffered are taken under
 * one hold of the stream lock and their slices finished together (one batch lock per run). */
void *fmc_stream_recv_main(void *arg)
{
    fmc_stream *st = arg;
    int proto = st->peer->proto;
    fmc_reader *rd = &st->rd;
    fmc_slice_list done = {0};
    gpu_landing gpu = {0};
    for (;;) {
        fmc_resp a;
        int park = !answer_buffered(proto, rd);
        if (park)
            land_pending(st, &gpu, &done); /* before this thread may block */
        fmc_slices_finish(done.head, FMC_TASK_PENDING);
        done.head = done.tail = NULL;
        if (park && !receiver_park(st))
            break;
        if (read_answer(proto, rd, &a) < 0)
            break;
        pthread_mutex_lock(&st->mu);
        int broken = 0;
        for (;;) {
            fmc_slice *s = st->inflight.head;
            if (s && s->vec_n >= 2 && gpu.s) {
                /* `receiving` is about to hold the vector: land the pending GPU read first. */
                pthread_mutex_unlock(&st->mu);
                land_pending(st, &gpu, &done);
                pthread_mutex_lock(&st->mu);
                s = st->inflight.head;
            }
            if (s && s->vec_n >= 2) {
                /* A vector's answer: its slices leave `inflight` together. */
                int k = s->vec_n;
                st->receiving.head = s;
                for (int j = 1; j < k && s; j++)
                    s = s->next;
                if (!s || st->receiving.head->id != a.id) {
                    st->receiving.head = NULL;
                    pthread_mutex_unlock(&st->mu);
                    log_bad_answer(st, "an answer that matches no request");
                    broken = 1;
                    break;
                }
                st->receiving.tail = s;
                st->inflight.head = s->next;
                if (!st->inflight.head)
                    st->inflight.tail = NULL;
                s->next = NULL;
                pthread_mutex_unlock(&st->mu);
                fmc_slices_finish(done.head, FMC_TASK_PENDING); /* not held while the payload comes */
                done.head = done.tail = NULL;
                if (receive_vector(st, rd, &a, k) < 0) {
                    log_bad_answer(st, "a vector answer that does not fit its request");
                    broken = 1; /* `receiving` stays set: the exit path fails it */
                    break;
                }
                if (zc_answer_void(st, &a)) {
                    broken = 1;
                    break;
                }
                pthread_mutex_lock(&st->mu);
                st->zc_owed += (a.flags & FMC_RESP_ZC) != 0;
                for (fmc_slice *x = st->receiving.head, *next; x; x = next) {
                    next = x->next;
                    list_push(x->sending ? &st->answered : &done, x);
                }
                st->receiving.head = st->receiving.tail = NULL;
                goto next_answer;
            }
            if (s && proto == FMC_PROTO_MOONCAKE) {
                /* Mooncake answers carry no id: in-order delivery is the match. */
                a.id = s->id;
                a.len = s->batch->opcode == FMC_OP_READ && a.status == FMC_OK ? s->len : 0;
            }
            int carries_data = s && s->batch->opcode == FMC_OP_READ && a.status == FMC_OK;
            if (!s || s->id != a.id || a.len != (carries_data ? s->len : 0)) {
                pthread_mutex_unlock(&st->mu);
                log_bad_answer(st, "an answer that matches no request");
                broken = 1;
                break;
            }
            st->inflight.head = s->next;
            if (!st->inflight.head)
                st->inflight.tail = NULL;
            s->answer_status = remote_status(a.status);
            if (a.len) {
                list_push(&st->receiving, s);
                pthread_mutex_unlock(&st->mu);
                fmc_slices_finish(done.head, FMC_TASK_PENDING); /* not held while the payload comes */
                done.head = done.tail = NULL;
                int got = receive_payload(st, rd, s, &gpu, &done);
                if (got < 0 || zc_answer_void(st, &a)) {
                    s->answer_status = FMC_ERR_SOCKET; /* a GPU landing finishes with this status */
                    broken = 1; /* `receiving` stays set: the exit path fails it */
                    break;
                }
                pthread_mutex_lock(&st->mu);
                st->zc_owed += (a.flags & FMC_RESP_ZC) != 0;
                if (got == 1) /* its copy to the GPU lands later */
                    goto next_answer;
                receiving_remove(st, s);
            }
            /* Answered while sendmsg may still read its bytes (a target that answers early, or
             * one whose answer overtook the end of a long gather): the sender finishes it. */
            list_push(s->sending ? &st->answered : &done, s);
        next_answer: /* take the next answer only if it is already here */
            if (!answer_buffered(proto, rd))
                break;
            if (read_answer(proto, rd, &a) < 0) {
                pthread_mutex_unlock(&st->mu);
                broken = 1;
                break;
            }
        }
        if (broken)
            break;
        send_ack_if_due_locked(st);
        pthread_mutex_unlock(&st->mu);
    }
    land_pending(st, &gpu, &done); /* no copy may still run into a slice the exit path fails */
    fmc_slices_finish(done.head, FMC_TASK_PENDING); /* answered before the stream broke */
    stream_thread_exit(st);
    return NULL;
}

/* ------------------------------------------------------------------ peer API */

int fmc_peer_create(fmc_engine *e, const char *host, int data_port, int nstreams, uint64_t slice_size,
                    fmc_peer **out)
{
    *out = NULL;
    if (!host || strlen(host) >= sizeof(((fmc_peer *)0)->host) || data_port <= 0 || data_port > 65535 ||
        nstreams < 1 || nstreams > FMC_MAX_STREAMS) {
        fmc_set_error("invalid peer parameters (host '%s', port %d, %d streams; 1..%d streams allowed)",
                      host ? host : "", data_port, nstreams, FMC_MAX_STREAMS);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (slice_size == 0)
        slice_size = FMC_DEFAULT_SLICE;
    if (slice_size < FMC_MIN_SLICE || slice_size > FMC_MAX_WIRE_LEN) {
        fmc_set_error("slice size %llu outside [%llu, %llu]", (unsigned long long)slice_size,
                      (unsigned long long)FMC_MIN_SLICE, (unsigned long long)FMC_MAX_WIRE_LEN);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    fmc_peer *p = calloc(1, sizeof *p);
    if (!p)
        return FMC_ERR_MEMORY;
    p->engine = e;
    strcpy(p->host, host);
    p->data_port = data_port;
    p->nstreams = nstreams;
    p->slice_size = slice_size;
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->sh_mu, NULL);
    pthread_cond_init(&p->sh_cv, NULL);
    atomic_init(&p->refs, 1);
    atomic_init(&p->next_id, 1);
    for (int i = 0; i < nstreams; i++) {
        fmc_stream *st = &p->streams[i];
        st->peer = p;
        st->index = i;
        st->fd = -1;
        st->dead = 1; /* until connected */
        pthread_mutex_init(&st->mu, NULL);
        pthread_cond_init(&st->cv, NULL);
        st->wake_fd = -1;
        st->zc_pipe[0] = st->zc_pipe[1] = -1;
    }
    *out = p;
    return FMC_OK;
}

static int find_locked(fmc_peer *p, uint64_t addr, uint64_t len, uint64_t *base, uint32_t *key);
static int region_index_locked(const fmc_peer *p, uint64_t addr, uint64_t len, int hint);

/* A mapping of a region that left the peer's table: a GPU range (device >= 0) or a shared one. */
typedef struct fmc_retired_map {
    uint64_t mapped, len;
    int device;
    struct fmc_retired_map *next;
} fmc_retired_map;

/* Undo a mapping of a peer's region: GPU (device >= 0) or shared memory of `len` bytes. */
static void unmap_region(uint64_t mapped, uint64_t len, int device)
{
    if (device >= 0)
        fmc_cuda_peer_unmap(mapped, device);
    else
        munmap((void *)(uintptr_t)mapped, (size_t)len);
}

static void unmap_retired(fmc_retired_map *m)
{
    while (m) {
        fmc_retired_map *next = m->next;
        unmap_region(m->mapped, m->len, m->device);
        free(m);
        m = next;
    }
}

/* Retire a mapping under p->mu (unmapped once no copy uses the peer's mappings).  Out of memory:
 * leaked rather than unmapped under a copy. */
static void retire_locked(fmc_peer *p, uint64_t mapped, uint64_t len, int device)
{
    fmc_retired_map *m = malloc(sizeof *m);
    if (!m)
        return;
    *m = (fmc_retired_map){.mapped = mapped, .len = len, .device = device, .next = p->retired};
    p->retired = m;
}

/* Retired mappings nobody can use any more, taken off the peer (call under p->mu). */
static fmc_retired_map *take_unused_retired_locked(fmc_peer *p)
{
    if (p->map_users > 0)
        return NULL;
    fmc_retired_map *m = p->retired;
    p->retired = NULL;
    return m;
}

void fmc_peer_routes_done(fmc_peer *p)
{
    pthread_mutex_lock(&p->mu);
    p->map_users--;
    fmc_retired_map *m = take_unused_retired_locked(p);
    pthread_mutex_unlock(&p->mu);
    unmap_retired(m);
}

int fmc_peer_set_regions(fmc_peer *p, const uint64_t *addrs, const uint64_t *lens, const uint32_t *keys, int n)
{
    if (n < 0)
        return FMC_ERR_INVALID_ARGUMENT;
    uint64_t *a = malloc(sizeof *a * (size_t)(n ? n : 1));
    uint64_t *l = malloc(sizeof *l * (size_t)(n ? n : 1));
    uint32_t *k = malloc(sizeof *k * (size_t)(n ? n : 1));
    if (!a || !l || !k) {
        free(a);
        free(l);
        free(k);
        return FMC_ERR_MEMORY;
    }
    /* insertion sort by address: tables are small and usually arrive sorted */
    for (int i = 0; i < n; i++) {
        int j = i;
        while (j > 0 && a[j - 1] > addrs[i]) {
            a[j] = a[j - 1];
            l[j] = l[j - 1];
            k[j] = k[j - 1];
            j--;
        }
        a[j] = addrs[i];
        l[j] = lens[i];
        k[j] = keys[i];
    }
    int32_t *sl = malloc(sizeof *sl * (size_t)(n ? n : 1));
    uint32_t *g = calloc((size_t)(n ? n : 1), sizeof *g);
    if (!sl || !g) {
        free(a);
        free(l);
        free(k);
        free(sl);
        free(g);
        return FMC_ERR_MEMORY;
    }
    int32_t *dv = malloc(sizeof *dv * (size_t)(n ? n : 1));
    uint64_t *ib = calloc((size_t)(n ? n : 1), sizeof *ib), *im = calloc((size_t)(n ? n : 1), sizeof *im);
    uint64_t *sm = calloc((size_t)(n ? n : 1), sizeof *sm);
    if (!dv || !ib || !im || !sm) {
        free(sm);
        free(a);
        free(l);
        free(k);
        free(sl);
        free(g);
        free(dv);
        free(ib);
        free(im);
        return FMC_ERR_MEMORY;
    }
    for (int i = 0; i < n; i++) {
        sl[i] = -1; /* no same-host slot until fmc_peer_set_region_slots says so */
        dv[i] = -1;
    }
    pthread_mutex_lock(&p->mu);
    /* What we know of regions that are still there carries over: their mappings, and their
     * same-host slot and GPU until set_region_slots / set_region_gpu say again (meanwhile a
     * concurrent call must neither leave the same-host path nor aim process_vm_* at GPU memory).
     * The others' mappings are retired (a region registered anew, even at the same place, has a
     * new key and new memory behind it). */
    for (int j = 0; j < p->r_count; j++) {
        int i = 0;
        while (i < n && !(a[i] == p->r_addr[j] && l[i] == p->r_len[j] && k[i] == p->r_key[j]))
            i++;
        int kept = i < n;
        if (kept) {
            sl[i] = p->r_slot[j];
            g[i] = p->r_gen[j];
            dv[i] = p->r_dev[j];
            sm[i] = p->r_shm_mapped[j];
            ib[i] = p->r_ipc_base[j];
            im[i] = p->r_ipc_mapped[j];
        } else {
            if (p->r_shm_mapped[j])
                retire_locked(p, p->r_shm_mapped[j], p->r_len[j], -1);
            if (p->r_ipc_mapped[j])
                retire_locked(p, p->r_ipc_mapped[j], 0, p->r_dev[j]);
        }
    }
    free(p->r_addr);
    free(p->r_len);
    free(p->r_key);
    free(p->r_slot);
    free(p->r_gen);
    free(p->r_dev);
    free(p->r_ipc_base);
    free(p->r_ipc_mapped);
    free(p->r_shm_mapped);
    p->r_shm_mapped = sm;
    p->r_addr = a;
    p->r_len = l;
    p->r_key = k;
    p->r_slot = sl;
    p->r_gen = g;
    p->r_dev = dv;
    p->r_ipc_base = ib;
    p->r_ipc_mapped = im;
    p->r_count = n;
    fmc_retired_map *unused = take_unused_retired_locked(p);
    pthread_mutex_unlock(&p->mu);
    unmap_retired(unused);
    return FMC_OK;
}

static int index_of_locked(fmc_peer *p, uint64_t addr)
{
    int lo = 0, hi = p->r_count - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (p->r_addr[mid] == addr)
            return mid;
        if (p->r_addr[mid] < addr)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -1;
}

/* A remote region the peer backs with a memfd (its managed buffers): map it here, so same-host
 * copies into it are a plain memcpy (still fenced like every same-host copy). */
int fmc_peer_set_region_shm(fmc_peer *p, uint64_t addr, int memfd, uint64_t size)
{
    pthread_mutex_lock(&p->mu);
    int i = index_of_locked(p, addr);
    int ok = i >= 0 && p->r_len[i] == size && p->sh != NULL;
    int have = ok && p->r_shm_mapped[i];
    int pid = p->sh_pid;
    pthread_mutex_unlock(&p->mu);
    if (!ok) {
        fmc_set_error("no same-host region of %llu bytes at 0x%llx", (unsigned long long)size, (unsigned long long)addr);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (have)
        return FMC_OK;
    void *m = fmc_map_peer_fd(pid, memfd, (size_t)size);
    if (!m)
        return FMC_ERR_NOT_IMPLEMENTED;
    pthread_mutex_lock(&p->mu);
    i = index_of_locked(p, addr);
    if (i >= 0 && p->r_len[i] == size && !p->r_shm_mapped[i]) {
        p->r_shm_mapped[i] = (uint64_t)(uintptr_t)m;
        m = NULL;
    }
    pthread_mutex_unlock(&p->mu);
    if (m)
        munmap(m, (size_t)size);
    return FMC_OK;
}

int fmc_peer_shared_region_count(fmc_peer *p)
{
    pthread_mutex_lock(&p->mu);
    int n = 0;
    for (int i = 0; i < p->r_count; i++)
        n += p->r_shm_mapped[i] != 0;
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* How a remote GPU region can be mapped here: a legacy CUDA IPC handle, or VMM chunks. */
typedef struct {
    const uint8_t *handle64; /* NULL: VMM chunks */
    int n;
    const uint64_t *bases, *sizes;
    const int32_t *fds;
} gpu_share;

/* Map a remote GPU region here for same-host copies with cuMemcpy; `base` is the remote address
 * the mapping starts at (the allocation's, or the first chunk's).  x NULL: only mark the region
 * as GPU memory (its bytes then go through staging over TCP). */
static int map_gpu_region(fmc_peer *p, uint64_t addr, int device, uint64_t base, const gpu_share *x)
{
    pthread_mutex_lock(&p->mu);
    int i = index_of_locked(p, addr);
    int have = i >= 0 && p->r_ipc_mapped[i] && p->r_ipc_base[i] == base && p->r_dev[i] == device;
    if (i >= 0 && !p->r_ipc_mapped[i])
        p->r_dev[i] = device; /* known to be GPU memory even if we cannot map it: not for process_vm_* */
    int same_host = p->sh != NULL, pid = p->sh_pid;
    pthread_mutex_unlock(&p->mu);
    if (i < 0)
        return FMC_ERR_ADDRESS_NOT_REGISTERED;
    if (have || !same_host || !x)
        return FMC_OK;
    uint64_t mapped = 0;
    int rc = x->handle64 ? fmc_cuda_ipc_open(x->handle64, device, &mapped)
                         : fmc_cuda_vmm_import(pid, x->n, x->bases, x->sizes, x->fds, device, &mapped);
    if (rc != FMC_OK)
        return rc;
    pthread_mutex_lock(&p->mu);
    i = index_of_locked(p, addr);
    if (i >= 0 && !p->r_ipc_mapped[i]) {
        p->r_dev[i] = device;
        p->r_ipc_base[i] = base;
        p->r_ipc_mapped[i] = mapped;
        mapped = 0;
    }
    pthread_mutex_unlock(&p->mu);
    if (mapped)
        fmc_cuda_peer_unmap(mapped, device); /* lost a race or the region went away */
    return FMC_OK;
}

int fmc_peer_set_region_ipc(fmc_peer *p, uint64_t addr, const uint8_t *handle64, uint64_t alloc_base, int device)
{
    gpu_share x = {.handle64 = handle64};
    return map_gpu_region(p, addr, device, alloc_base, &x);
}

int fmc_peer_set_region_device(fmc_peer *p, uint64_t addr, int device)
{
    return map_gpu_region(p, addr, device, 0, NULL);
}

/* The chunks must cover the region: a mapping shorter than the region would let a copy run off
 * its end here. */
int fmc_peer_set_region_vmm(fmc_peer *p, uint64_t addr, int device, int n, const uint64_t *bases,
                            const uint64_t *sizes, const int32_t *fds)
{
    pthread_mutex_lock(&p->mu);
    int i = index_of_locked(p, addr);
    uint64_t len = i >= 0 ? p->r_len[i] : 0;
    pthread_mutex_unlock(&p->mu);
    if (i < 0)
        return FMC_ERR_ADDRESS_NOT_REGISTERED;
    uint64_t end = n > 0 ? bases[n - 1] + sizes[n - 1] : 0;
    if (n <= 0 || n > FMC_CUDA_VMM_MAX_CHUNKS || bases[0] > addr || end < bases[n - 1] || end < addr + len) {
        fmc_set_error("the peer's GPU chunks do not cover its region at 0x%llx", (unsigned long long)addr);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    gpu_share x = {.n = n, .bases = bases, .sizes = sizes, .fds = fds};
    return map_gpu_region(p, addr, device, bases[0], &x);
}

/* Same-host slots of remote regions, by region start address (after fmc_peer_set_regions). */
int fmc_peer_set_region_slots(fmc_peer *p, const uint64_t *addrs, const int32_t *slots, const uint32_t *gens, int n)
{
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < n; i++) {
        int lo = 0, hi = p->r_count - 1;
        while (lo <= hi) {
            int mid = lo + (hi - lo) / 2;
            if (p->r_addr[mid] == addrs[i]) {
                p->r_slot[mid] = slots[i] >= 0 && slots[i] < FMC_SH_MAX_SLOTS ? slots[i] : -1;
                p->r_gen[mid] = gens[i];
                break;
            }
            if (p->r_addr[mid] < addrs[i])
                lo = mid + 1;
            else
                hi = mid - 1;
        }
    }
    pthread_mutex_unlock(&p->mu);
    return FMC_OK;
}

int fmc_peer_is_same_host(fmc_peer *p)
{
    pthread_mutex_lock(&p->mu);
    int on = p->sh != NULL;
    pthread_mutex_unlock(&p->mu);
    return on;
}

/* Routes for every task; 0 if some task cannot go the same-host way (then the batch uses TCP).
 * 1: the mappings they point into stay mapped until fmc_peer_routes_done.  0:
 * a region without a slot, a GPU region we could not map, or a GPU source/destination here with
 * host memory there (process_vm_* cannot reach GPU memory). */
int fmc_peer_lookup_routes(fmc_peer *p, int n, const uint64_t *remote, const uint64_t *lens, const int32_t *local_dev,
                           fmc_sh_route *routes)
{
    pthread_mutex_lock(&p->mu);
    int ok = 1, last = -1;
    for (int i = 0; i < n && ok; i++) {
        routes[i] = (fmc_sh_route){.slot = -1, .dev = -1};
        if (lens[i] == 0)
            continue;
        int idx = last = region_index_locked(p, remote[i], lens[i], last);
        if (idx < 0 || p->r_slot[idx] < 0) {
            ok = 0;
            break;
        }
        routes[i].slot = p->r_slot[idx];
        routes[i].gen = p->r_gen[idx];
        if (p->r_ipc_mapped[idx]) {
            routes[i].dev = p->r_dev[idx];
            routes[i].mapped = p->r_ipc_mapped[idx] + (remote[i] - p->r_ipc_base[idx]);
        } else if (p->r_dev[idx] >= 0 || local_dev[i] >= 0) {
            ok = 0;
        } else if (p->r_shm_mapped[idx]) {
            routes[i].mapped = p->r_shm_mapped[idx] + (remote[i] - p->r_addr[idx]);
        }
    }
    p->map_users += ok; /* until fmc_peer_routes_done */
    pthread_mutex_unlock(&p->mu);
    return ok;
}

/* Index of the peer region that wholly holds [addr, addr+len), or -1.  `hint` (an index or -1)
 * is tried first: the tasks of a batch mostly fall in the region of the one before. */
static int region_index_locked(const fmc_peer *p, uint64_t addr, uint64_t len, int hint)
{
    if (len == 0 || addr + len < addr)
        return -1;
    if (hint >= 0 && hint < p->r_count && fmc_range_holds(p->r_addr[hint], p->r_len[hint], addr, len))
        return hint;
    int lo = 0, hi = p->r_count - 1, idx = -1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (p->r_addr[mid] <= addr) {
            idx = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return idx >= 0 && fmc_range_holds(p->r_addr[idx], p->r_len[idx], addr, len) ? idx : -1;
}

static int find_locked(fmc_peer *p, uint64_t addr, uint64_t len, uint64_t *base, uint32_t *key)
{
    int idx = region_index_locked(p, addr, len, -1);
    if (idx < 0)
        return FMC_ERR_ADDRESS_NOT_REGISTERED;
    if (base)
        *base = p->r_addr[idx];
    if (key)
        *key = p->r_key[idx];
    return FMC_OK;
}

int fmc_peer_find_region(fmc_peer *p, uint64_t addr, uint64_t len, uint64_t *base_out, uint32_t *key_out)
{
    pthread_mutex_lock(&p->mu);
    int rc = find_locked(p, addr, len, base_out, key_out);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Resolve keys for every remote range, before anything is sent.  Returns the failing index via
 * *bad_index. */
int fmc_peer_lookup_keys(fmc_peer *p, int n, const uint64_t *remote, const uint64_t *lens, uint32_t *keys,
                         int *bad_index)
{
    pthread_mutex_lock(&p->mu);
    int last = -1;
    for (int i = 0; i < n; i++) {
        keys[i] = 0;
        if (lens[i] == 0)
            continue;
        last = region_index_locked(p, remote[i], lens[i], last);
        if (last >= 0) {
            keys[i] = p->r_key[last];
        } else {
            pthread_mutex_unlock(&p->mu);
            *bad_index = i;
            return FMC_ERR_ADDRESS_NOT_REGISTERED;
        }
    }
    pthread_mutex_unlock(&p->mu);
    return FMC_OK;
}

/* FLAGCX_MC_VECTORS=0 keeps this initiator on single requests (comparisons, old targets). */
static int vectors_wanted(void)
{
    const char *env = getenv("FLAGCX_MC_VECTORS");
    return !(env && env[0] == '0');
}

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
    uint32_t flags = FMC_PREAMBLE_READ_ACKS | (vectors_wanted() ? FMC_PREAMBLE_VECTORS : 0);
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
        int fd = left > 0 ? fmc_tcp_connect(p->host, p->data_port, (int)left) : FMC_ERR_TIMEOUT;
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

void fmc_peer_release(fmc_peer *p)
{
    if (!p || atomic_fetch_sub(&p->refs, 1) != 1)
        return;
    fmc_peer_close(p);
    for (int i = 0; i < p->nstreams; i++) {
        fmc_staging_release(&p->streams[i].send_stage);
        free(p->streams[i].scratch);
        fmc_zc_pipe_close(p->streams[i].zc_pipe);
        fmc_staging_release(&p->streams[i].recv_stage);
        fmc_staging_release(&p->streams[i].recv_stage2);
        fmc_reader_free(&p->streams[i].rd);
        if (p->streams[i].wake_fd >= 0)
            close(p->streams[i].wake_fd);
        pthread_mutex_destroy(&p->streams[i].mu);
        pthread_cond_destroy(&p->streams[i].cv);
    }
    pthread_mutex_destroy(&p->mu);
    fmc_sh_peer_release(p);
    for (int i = 0; i < p->r_count; i++) {
        if (p->r_ipc_mapped && p->r_ipc_mapped[i])
            unmap_region(p->r_ipc_mapped[i], 0, p->r_dev[i]);
        if (p->r_shm_mapped && p->r_shm_mapped[i])
            unmap_region(p->r_shm_mapped[i], p->r_len[i], -1);
    }
    unmap_retired(p->retired); /* the last reference is gone: no copy runs */
    free(p->r_shm_mapped);
    free(p->r_dev);
    free(p->r_ipc_base);
    free(p->r_ipc_mapped);
    free(p->r_addr);
    free(p->r_len);
    free(p->r_key);
    free(p->r_slot);
    free(p->r_gen);
    free(p);
}
