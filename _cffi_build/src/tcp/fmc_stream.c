/* Initiator side, one data stream: a send side gathers queued slices into sendmsg (or the
 * calling thread sends them itself when the stream is idle), a receive side consumes answers in
 * order and reads read-payloads straight into local memory.  Both sides run on the process's
 * I/O pool (fmc_worker_pool.c) rather than on threads of their own.  A slice is only declared
 * finished once no thread touches its memory any more: that is what lets a timed-out call
 * return with its buffers free.  A peer's streams are set up in fmc_peer.c, connected and
 * closed by fmc_peer_connect.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_mooncake.h"
#include "fmc_wire.h"
#include "fmc_worker_pool.h"

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

/* Reads into GPU memory land through staging chunks, pipelined: a piece of an answer (at most
 * one chunk of GPU payloads, one device) is received into a chunk, its scatter to the GPU queued
 * and fenced, and the receiver goes on reading while it runs.  Pieces land (fence waited for,
 * chunk back to the pool) in answer order: when FMC_STAGE_DEPTH are pending, when a chunk is
 * needed and none is free, before an answer that does not go through staging, and before the
 * thread parks or exits.  A piece that ends an answer carries its slices, which stay on
 * st->receiving (so a cancel cuts the stream) until it lands: only then do they finish. */
typedef struct {
    fmc_chunk *chunk;
    fmc_fence fence;
    int failed;       /* its copy could not be queued */
    fmc_slice *first; /* the answer's slices, when this piece ends it (NULL otherwise) */
    int nslices;
} rx_piece;

typedef struct rx_ring {
    rx_piece p[FMC_STAGE_DEPTH];
    int head, count;
    int failed; /* a piece of the answer being landed failed: its GPU slices fail */
} rx_ring;

/* What the pool's events and timers name: one per stream, never freed (a worker may still hold
 * an event of a stream that is gone), reused by the next stream once its own is released. */
typedef struct fmc_io_handle {
    pthread_mutex_t mu;
    fmc_stream *st;           /* NULL while no stream uses it */
    fmc_pool_timer ack_timer; /* zero-copy acknowledgements owed by an idle stream */
    struct fmc_io_handle *next_free;
} fmc_io_handle;

static void stream_event(void *owner, uint32_t events);
/* Up to 8 workers while the process has one peer's streams (FMC_POOL_FEW_OWNERS), on hosts whose
 * cap is lower: on 2 CPUs, with the cap at 4, both sides of a peer's four streams could not all
 * linger, and each 4 MiB call handed its streams on through the set, chain of wake-ups and all
 * (4 MiB writes of 64 KiB blocks at 0.84x the build with a sender and a receiver thread per
 * stream; 0.94x with this and the serve pool's like it). */
static fmc_worker_pool io_pool = FMC_WORKER_POOL_INIT("io", stream_event, 2, 8);
static pthread_mutex_t handles_mu = PTHREAD_MUTEX_INITIALIZER;
static fmc_io_handle *free_handles;

int fmc_io_pool_set_threads(int n) { return fmc_pool_set_cap(&io_pool, n); }

void fmc_io_pool_counts(int *workers, int *cap, uint64_t *recalls) { fmc_pool_counts(&io_pool, workers, cap, recalls); }

void fmc_io_pool_run_soon(fmc_pool_timer *t)
{
    if (fmc_pool_start(&io_pool) == FMC_OK)
        fmc_pool_timer_add(&io_pool, t, fmc_now_ms());
}

/* What the armed sides wait for (st->mu held). */
static uint32_t wanted_events(const fmc_stream *st)
{
    return (st->rx_state == FMC_ROLE_ARMED ? st->rx_events : 0) | (st->tx_state == FMC_ROLE_ARMED ? EPOLLOUT : 0);
}

/* Watch the socket for what the armed sides wait for (st->mu held).  A watch still set for the
 * same events is left alone, so a small call that finds its stream idle costs no syscall. */
static void watch_locked(fmc_stream *st)
{
    uint32_t want = wanted_events(st);
    if (!want || st->fd < 0 || st->watched == want)
        return;
    if (fmc_pool_watch(&io_pool, st->fd, st->io, want, EPOLL_CTL_MOD) == FMC_OK)
        st->watched = want;
}

/* The send side has work (slices, an acknowledgement, a death to see): a worker takes it as soon
 * as the socket has room.  A side already running or armed sees the work itself. */
static void tx_kick_locked(fmc_stream *st)
{
    if (st->tx_state == FMC_ROLE_OFF) {
        st->tx_state = FMC_ROLE_ARMED;
        watch_locked(st);
    } else if (st->tx_lingering) {
        pthread_cond_broadcast(&st->cv); /* shared with exit paths, which wait for their own ends */
    }
}

/* How long a stream's side stays with its worker once it ran dry (fmc_pool_linger_begin): the
 * next batch then wakes that worker directly. */
#define STREAM_LINGER_MS 10

/* Answers will come: the receive side, parked on its quiet watch, watches for them. */
static void rx_expect_answers_locked(fmc_stream *st)
{
    if (st->rx_state == FMC_ROLE_ARMED && !(st->rx_events & EPOLLIN)) {
        st->rx_events |= EPOLLIN;
        watch_locked(st);
    }
}

/* Split what a cut stream held: slices of cancelled tasks go to `gone`, the others (innocent
 * calls that happened to share the stream) to `again`, in their order. */
static void split_cancelled(fmc_slice_list *left, fmc_slice_list *gone, fmc_slice_list *again)
{
    for (fmc_slice *s = left->head, *next; s; s = next) {
        next = s->next;
        fmc_slice_list_push(fmc_slice_cancelled(s) ? gone : again, s);
    }
    left->head = left->tail = NULL;
}

static void stream_come_back(fmc_stream *st);
static void ack_timer_fire(fmc_pool_timer *t);
static int ack_due(const fmc_stream *st);

/* Both sides start on the stream's connection (st->mu held): the receive side on its quiet
 * watch, or watching for answers if an inline caller already sent on a reconnected stream; the
 * send side armed if work waits. */
static int roles_start_locked(fmc_stream *st)
{
    st->roles_alive = 2;
    st->rx_state = FMC_ROLE_ARMED;
    st->rx_events = EPOLLRDHUP | (st->inflight.head ? EPOLLIN : 0);
    st->tx_state = st->pending.head || st->handoff || ack_due(st) ? FMC_ROLE_ARMED : FMC_ROLE_OFF;
    st->watched = wanted_events(st);
    int rc = fmc_pool_watch(&io_pool, st->fd, st->io, st->watched, EPOLL_CTL_ADD);
    if (rc != FMC_OK) {
        st->roles_alive = 0;
        st->rx_state = st->tx_state = FMC_ROLE_DONE;
        st->watched = 0;
    }
    return rc;
}

int fmc_stream_start(fmc_stream *st)
{
    int rc = fmc_pool_start(&io_pool);
    if (rc != FMC_OK)
        return rc;
    if (!st->rx_gpu && !(st->rx_gpu = calloc(1, sizeof *st->rx_gpu)))
        return FMC_ERR_MEMORY;
    if (!st->io) {
        pthread_mutex_lock(&handles_mu);
        fmc_io_handle *h = free_handles;
        if (h)
            free_handles = h->next_free;
        pthread_mutex_unlock(&handles_mu);
        if (!h && (h = calloc(1, sizeof *h))) {
            pthread_mutex_init(&h->mu, NULL);
            h->ack_timer.fire = ack_timer_fire;
        }
        if (!h)
            return FMC_ERR_MEMORY;
        pthread_mutex_lock(&h->mu);
        h->st = st;
        pthread_mutex_unlock(&h->mu);
        st->io = h;
        fmc_pool_owners_add(&io_pool, 1);
    }
    pthread_mutex_lock(&st->mu);
    rc = roles_start_locked(st);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

void fmc_stream_wait_gone(fmc_stream *st)
{
    pthread_mutex_lock(&st->mu);
    while (st->roles_alive > 0 || st->reconnecting || st->leaving)
        pthread_cond_wait(&st->cv, &st->mu);
    pthread_mutex_unlock(&st->mu);
}

void fmc_stream_release(fmc_stream *st)
{
    fmc_io_handle *h = st->io;
    if (h) {
        pthread_mutex_lock(&h->mu); /* a worker holding one of its events waits, then finds no stream */
        h->st = NULL;
        pthread_mutex_unlock(&h->mu);
        fmc_pool_timer_cancel(&io_pool, &h->ack_timer);
        pthread_mutex_lock(&handles_mu);
        h->next_free = free_handles;
        free_handles = h;
        pthread_mutex_unlock(&handles_mu);
        st->io = NULL;
        fmc_pool_owners_add(&io_pool, -1);
    }
    if (st->rx_gpu) {
        for (int i = 0; i < FMC_STAGE_DEPTH; i++)
            fmc_cuda_fence_free(&st->rx_gpu->p[i].fence);
        free(st->rx_gpu);
        st->rx_gpu = NULL;
    }
}

/* A side leaves its connection (it broke, was cut, or the peer is closing): `state` becomes
 * DONE.  The first out shuts the socket down and has the other side see it; the last one out
 * closes the socket (after which nothing can touch slice memory through it) and settles what
 * the stream held: a stream cut by a cancel (fmc_stream_cut) keeps its innocent slices queued
 * and reconnects (this worker, see stream_come_back), the cancelled ones end with
 * FMC_ERR_TIMEOUT; a stream that broke fails everything. */
static void role_exit(fmc_stream *st, int *state)
{
    fmc_slice_list left = {0}, gone = {0};
    int status = FMC_ERR_SOCKET;
    pthread_mutex_lock(&st->mu);
    *state = FMC_ROLE_DONE;
    if (!st->dead) {
        st->dead = 1;
        if (st->fd >= 0)
            shutdown(st->fd, SHUT_RDWR);
    }
    pthread_cond_broadcast(&st->cv);
    if (--st->roles_alive > 0) {
        tx_kick_locked(st); /* the shut-down socket wakes an armed side at once */
        rx_expect_answers_locked(st);
        pthread_mutex_unlock(&st->mu);
        return;
    }
    /* An inline sender still in sendmsg, or a caller reading its own answers: shutdown ends
     * either soon, and neither may find the socket closed (or reconnected) under it. */
    fmc_pool_blocking_begin();
    while (st->sending_active || st->caller_recv)
        pthread_cond_wait(&st->cv, &st->mu);
    fmc_pool_blocking_end();
    /* Nobody uses the socket any more: close it now, abortively.  After shutdown() the
     * receive side drains what is queued and a plain close() then sends only a FIN while our
     * window stays shut, which leaves a target blocked in sendmsg (read answers) on a
     * CLOSE-WAIT socket for minutes; the RST ends it at once.  Spliced write payloads still
     * queued at a same-host target are taken back first (fmc_zc_fence.c).  kill/close read fd
     * under mu. */
    if (st->fd >= 0) {
        fmc_zc_fence_close(st);
        st->fd = -1;
    }
    st->watched = 0;
    list_append(&left, &st->receiving);
    list_append(&left, &st->inflight);
    list_append(&left, &st->answered); /* empty in practice: the send side drains it */
    list_append(&left, &st->pending);
    st->zc_owed = 0;
    st->zc_ack_idle = 0;
    if (st->restart && !__atomic_load_n(&st->peer->closed, __ATOMIC_ACQUIRE)) {
        split_cancelled(&left, &gone, &st->pending);
        st->reconnecting = 1;
        status = FMC_ERR_TIMEOUT;
    }
    __atomic_store_n(&st->restart, 0, __ATOMIC_RELEASE); /* after reconnecting: health reads both */
    int again = st->reconnecting;
    st->leaving = !again;
    pthread_mutex_unlock(&st->mu);
    fmc_slices_finish(gone.head, FMC_ERR_TIMEOUT);
    fmc_slices_finish(left.head, status);
    if (again) {
        stream_come_back(st);
        return;
    }
    pthread_mutex_lock(&st->mu);
    st->leaving = 0;
    pthread_cond_broadcast(&st->cv); /* a closing peer may free the stream once this is let go */
    pthread_mutex_unlock(&st->mu);
}

/* The last side out of a cut connection: connect again and start both sides, or end the stream
 * (its queued slices fail) if the peer cannot be reached in time or is being closed. */
static void stream_come_back(fmc_stream *st)
{
    fmc_pool_blocking_begin();
    int alive = fmc_stream_reconnect(st) == FMC_OK;
    fmc_pool_blocking_end();
    fmc_slice_list left = {0};
    pthread_mutex_lock(&st->mu);
    st->reconnecting = 0;
    if (alive) {
        st->rx_gpu->failed = 0; /* a failed piece of an answer the old connection broke off fails nothing here */
        alive = roles_start_locked(st) == FMC_OK;
        if (!alive) {
            st->dead = 1;
            close(st->fd);
            st->fd = -1;
        }
    }
    if (alive)
        st->peer->engine->stat_streams_reconnected++;
    else
        list_append(&left, &st->pending);
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    fmc_slices_finish(left.head, FMC_ERR_SOCKET);
}

static void kill_locked(fmc_stream *st)
{
    st->dead = 1;
    if (st->fd >= 0)
        shutdown(st->fd, SHUT_RDWR);
    pthread_cond_broadcast(&st->cv);
    tx_kick_locked(st); /* both sides leave: the shut-down socket wakes an armed one at once */
    rx_expect_answers_locked(st);
}

void fmc_stream_kill(fmc_stream *st)
{
    pthread_mutex_lock(&st->mu);
    kill_locked(st);
    pthread_mutex_unlock(&st->mu);
}

/* Cut the stream to stop its slices of cancelled tasks (fmc_batch_cancel_tasks) or of a call past
 * its deadline: unlike a kill, the stream reconnects and sends the other slices it held again. */
static void cut_locked(fmc_stream *st)
{
    if (!st->dead) {
        __atomic_store_n(&st->restart, 1, __ATOMIC_RELEASE); /* before `dead`: the peer stays healthy */
        st->peer->engine->stat_streams_cut++;
        kill_locked(st);
    }
}

void fmc_stream_cut(fmc_stream *st)
{
    pthread_mutex_lock(&st->mu);
    cut_locked(st);
    pthread_mutex_unlock(&st->mu);
}

/* Remember whether the batch now queued is bulk (see fmc_stream's rx_events). */
static void note_batch_size(fmc_stream *st, const fmc_slice_list *list)
{
    if (list->head)
        st->bulk = list->head->batch->bytes > FMC_SMALL_TRANSFER_BYTES;
}

int fmc_stream_enqueue(fmc_stream *st, fmc_slice_list *list)
{
    pthread_mutex_lock(&st->mu);
    if (st->dead && !st->reconnecting) {
        pthread_mutex_unlock(&st->mu);
        return FMC_ERR_SOCKET;
    }
    note_batch_size(st, list);
    list_append(&st->pending, list);
    if (!st->sending_active) /* else the round's end sees it */
        tx_kick_locked(st);
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

/* The send side has a round to send: slices or an acknowledgement, and no inline round holds
 * the socket (its end kicks the side again). */
static int round_due(const fmc_stream *st)
{
    return (st->pending.head || ack_due(st)) && !st->sending_active;
}

/* The receive side, with st->mu held: an acknowledgement due while no round is running goes out
 * from the send side (a running round's end sees it). */
static void send_ack_if_due_locked(fmc_stream *st)
{
    if (ack_due(st) && !st->sending_active)
        tx_kick_locked(st);
}

/* The receive side parks, or a caller that read its own answers hands it back, with nothing in
 * flight: owed acknowledgements go out ZC_ACK_IDLE_MS from now unless a request carries them
 * first. */
static void went_idle_locked(fmc_stream *st)
{
    st->idle_since_ms = fmc_now_ms();
    if (st->zc_owed && st->io)
        fmc_pool_timer_add(&io_pool, &st->io->ack_timer, st->idle_since_ms + ZC_ACK_IDLE_MS);
}

/* An idle stream that owes acknowledgements sends them ZC_ACK_IDLE_MS after it went idle.  The
 * timer was queued when the stream last went idle; a stream that has been busy since (batches
 * back to back) carries its acks with its next requests instead, and going idle again queues the
 * timer again, so only a stream quiet for the whole interval sends an ack on its own. */
static void ack_timer_fire(fmc_pool_timer *t)
{
    fmc_io_handle *h = (fmc_io_handle *)((char *)t - offsetof(fmc_io_handle, ack_timer));
    pthread_mutex_lock(&h->mu);
    fmc_stream *st = h->st;
    if (st) {
        pthread_mutex_lock(&st->mu);
        int busy = st->inflight.head || st->pending.head || st->sending_active || st->caller_recv;
        if (!st->dead && st->zc_owed && !busy) {
            int64_t due = st->idle_since_ms + ZC_ACK_IDLE_MS;
            if (fmc_now_ms() >= due) {
                st->zc_ack_idle = 1;
                send_ack_if_due_locked(st);
            } else {
                fmc_pool_timer_add(&io_pool, t, due); /* idle again, but not for long enough yet */
            }
        }
        pthread_mutex_unlock(&st->mu);
    }
    pthread_mutex_unlock(&h->mu);
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
    struct iovec *rest; /* a handed-off round (st->handoff): its unsent iovecs */
    int rest_n, rest_nw, rest_nzc, rest_gpu;
} send_scratch;

static int end_round(fmc_stream *st, send_scratch *sc, int nw, int rc);

/* A write payload that may leave zero-copy (fmc_splice.c): host memory (GPU sources are staged
 * in a buffer the next round reuses), large enough to pay for the extra syscalls (a share of a
 * call spread over several streams: FMC_ZC_SHARE_MIN_BYTES), and to our own targets, which check
 * for a reset before it lands. */
static int zero_copy_payload(const fmc_stream *st, const fmc_slice *s, int local_dev, uint64_t len, int vector)
{
    return local_dev < 0 && len >= fmc_zc_least_bytes(!vector && s->batch->spread) &&
           st->peer->proto == FMC_PROTO_NATIVE;
}

/* Small slices of one batch travel as vectors when the target takes them, from and into host or
 * GPU memory: GPU sources are gathered into staging (stage_gpu_sources), a read's GPU
 * destinations received side by side into staging and scattered by one copy (receive_vector). */
static int vectorizable(const fmc_peer *p, const fmc_slice *s)
{
    return p->vectors && s->len <= FMC_VEC_ENTRY_MAX;
}

/* How many slices from s on can form one vector, within this round's limits (`limit` bytes). */
static int vector_length(const fmc_peer *p, const fmc_slice *s, int niov, int nentries, size_t bytes, size_t limit)
{
    int is_write = s->batch->opcode == FMC_OP_WRITE, k = 0;
    for (const fmc_slice *x = s; x && k < FMC_VEC_MAX && x->batch == s->batch && vectorizable(p, x); x = x->next) {
        if (nentries + k + 1 > FMC_IOV_MAX || (is_write && niov + 2 + k + 1 > FMC_IOV_MAX) ||
            (k > 0 && bytes >= limit))
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
    if (proto == FMC_PROTO_MOONCAKE)
        return fmc_mc_encode_request(s, is_write, out);
    fmc_req q = {.opcode = is_write ? FMC_WIRE_OP_WRITE : FMC_WIRE_OP_READ,
                 .flags = !is_write && s->batch->spread ? FMC_REQ_SHARE : 0,
                 .key = s->key, .id = s->id, .addr = s->remote, .len = s->len};
    fmc_req_encode(out, &q);
    return FMC_REQ_SIZE;
}

/* Zero-copy sends on this stream (fmc_splice.c): only within this host, where they save the
 * receiver's second copy, and only where a cut can take back what the target has not read
 * (fmc_zc_fence.c).  Over a link that reorders and loses packets they measured twice the
 * spurious retransmissions of copied sends and up to a quarter less throughput (BENCHMARKS.md,
 * lossy links), for a copy the sender's CPU can afford at network rates. */
static int stream_zc(const fmc_stream *st) { return st->zc_link && fmc_zc_enabled(st->peer->engine); }

/* A run of payloads spliced (counted for the engine's stats); by the deadline where one is set. */
static int send_zc(fmc_stream *st, int fd, struct iovec *iov, int n, const uint8_t *zc, int64_t deadline_ms)
{
    st->peer->engine->stat_zc_sends++;
    return fmc_sendv_zc(fd, iov, n, zc, deadline_ms);
}

/* A round's iovecs [from, to) leave: zero-copy where flagged, by the deadline where one is set
 * (a synchronous caller's share of a multi-stream write is spliced too: copying it cost the
 * caller a quarter more CPU per byte than the send sides beside it). */
static int send_range(fmc_stream *st, send_scratch *sc, int from, int to, int64_t deadline_ms)
{
    if (to <= from)
        return 0;
    struct iovec *iov = sc->iov + from;
    int n = to - from, nzc = 0;
    for (int i = from; i < to; i++)
        nzc += sc->zc[i];
    if (nzc && stream_zc(st))
        return send_zc(st, st->fd, iov, n, sc->zc + from, deadline_ms);
    return fmc_sendv_flags(st->fd, iov, n, 0, deadline_ms);
}

/* A piece of a round in the send pipeline: iovecs [from, to), its GPU sources gathered into
 * `chunk` behind `fence` (a slot of st->send_fence). */
typedef struct {
    int from, to;
    fmc_chunk *chunk;
    fmc_fence *fence;
    int failed;
} send_piece;

/* A piece leaves once its gather has landed, and its chunk goes back to the pool either way:
 * 0, or < 0 as send_range (-1 if the copy failed). */
static int send_piece_now(fmc_stream *st, send_scratch *sc, const send_piece *p, int64_t deadline_ms)
{
    int rc = -1;
    FMC_TR(FMC_TR_FENCE_WAIT, st->fd, 0);
    if (!p->failed && fmc_cuda_fence_wait(p->fence) == FMC_OK) {
        FMC_TR(FMC_TR_FENCED, st->fd, 0);
        rc = send_range(st, sc, p->from, p->to, deadline_ms);
        FMC_TR(FMC_TR_SENT, st->fd, p->to - p->from);
    }
    fmc_stage_put(&st->peer->engine->stage, p->chunk);
    return rc;
}

/* Send round iovecs [0, niov) whose write payloads include GPU sources: they go through staging
 * chunks as a pipeline.  The round is cut into pieces of at most one chunk of GPU bytes (one
 * device each; headers and host payloads ride along); each piece's gather (the copy kernel or
 * the driver's batch, by gpu_copy) is queued and fenced, up to FMC_STAGE_DEPTH pieces ahead, and
 * the pieces leave in order, each once its fence is reached: the GPU gathers piece k+1 while
 * piece k is on the wire.  The round owns st->send_fence (sending_active).  A send that holds no
 * chunk waits for one (by the deadline, or until the stream dies); with some, it sends what it
 * has first. */
static int send_gpu_round(fmc_stream *st, send_scratch *sc, int niov, int nw, int64_t deadline_ms)
{
    fmc_stage_pool *pool = &st->peer->engine->stage;
    int gdev[FMC_IOV_MAX]; /* device of a GPU payload iovec, else -1 */
    for (int v = 0; v < niov; v++)
        gdev[v] = -1;
    for (int i = 0, v = 0; v < niov && i < nw; v++) {
        fmc_slice *s = sc->writes[i];
        if (sc->iov[v].iov_base != (void *)(uintptr_t)s->local || sc->iov[v].iov_len != s->len)
            continue; /* a header or a vector table */
        gdev[v] = s->local_dev;
        i++;
    }
    send_piece ring[FMC_STAGE_DEPTH];
    int head = 0, count = 0, rc = 0, slot = 0;
    for (int v = 0; v < niov && rc == 0;) {
        /* The next piece: from v to just before the next GPU payload that does not fit. */
        int dev = -1, to = v;
        size_t staged = 0;
        for (; to < niov; to++) {
            if (gdev[to] < 0)
                continue;
            if (dev >= 0 && (gdev[to] != dev || staged + sc->iov[to].iov_len > FMC_STAGE_CHUNK))
                break;
            dev = gdev[to];
            staged += sc->iov[to].iov_len;
        }
        if (dev < 0) { /* no GPU payload left: the rest goes after the pieces before it */
            for (; count && rc == 0; count--, head = (head + 1) % FMC_STAGE_DEPTH)
                rc = send_piece_now(st, sc, &ring[head], deadline_ms);
            if (rc == 0)
                rc = send_range(st, sc, v, niov, deadline_ms);
            break;
        }
        fmc_chunk *k = NULL;
        while (rc == 0 && !k) {
            if (count < FMC_STAGE_DEPTH)
                k = fmc_stage_get(pool, FMC_STAGE_SEND, dev, count ? 0 : deadline_ms, &st->dead);
            if (k || rc != 0)
                break;
            if (!count) {
                rc = deadline_ms >= 0 && fmc_now_ms() >= deadline_ms ? -2 : -1;
                break;
            }
            rc = send_piece_now(st, sc, &ring[head], deadline_ms); /* the oldest piece, then ask again */
            head = (head + 1) % FMC_STAGE_DEPTH;
            count--;
        }
        if (rc != 0)
            break;
        send_piece *p = &ring[(head + count) % FMC_STAGE_DEPTH];
        *p = (send_piece){.from = v, .to = to, .chunk = k, .fence = &st->send_fence[slot]};
        slot = (slot + 1) % FMC_STAGE_DEPTH;
        int m = 0;
        size_t off = 0;
        for (int x = v; x < to; x++) {
            if (gdev[x] < 0)
                continue;
            sc->copy_dst[m] = (uint64_t)(uintptr_t)(k->buf + off);
            sc->copy_src[m] = (uint64_t)(uintptr_t)sc->iov[x].iov_base;
            sc->copy_len[m++] = sc->iov[x].iov_len;
            sc->iov[x].iov_base = k->buf + off;
            off += sc->iov[x].iov_len;
        }
        p->failed = fmc_stage_copy(st->peer->engine, k, p->fence, sc->copy_dst, sc->copy_src, sc->copy_len, m, dev,
                                   0) != FMC_OK;
        FMC_TR(FMC_TR_GATHER, st->fd, m);
        count++;
        v = to;
        if (to == niov) { /* the last piece: send everything in order */
            for (; count && rc == 0; count--, head = (head + 1) % FMC_STAGE_DEPTH)
                rc = send_piece_now(st, sc, &ring[head], deadline_ms);
        }
    }
    /* Stopped early: no copy may still write a chunk that goes back to the pool. */
    for (; count; count--, head = (head + 1) % FMC_STAGE_DEPTH) {
        fmc_cuda_fence_wait(ring[head].fence);
        fmc_stage_put(pool, ring[head].chunk);
    }
    return rc;
}

/* A round's iovecs [0, niov) leave: straight from the caller's memory, or through the staging
 * pipeline where write payloads include GPU sources. */
static int send_round_iov(fmc_stream *st, send_scratch *sc, int niov, int nw, int gpu, int64_t deadline_ms)
{
    if (gpu)
        return send_gpu_round(st, sc, niov, nw, deadline_ms);
    return send_range(st, sc, 0, niov, deadline_ms);
}

/* One send round: gather queued slices (and owed acknowledgements) into one sendmsg and send
 * it.  Called with st->mu held, pending non-empty or an acknowledgement due, and no other round
 * in progress; returns with st->mu held.  The slices move
 * to `inflight` before the first byte leaves, because their answers may come back before
 * sendmsg returns.  deadline_ms >= 0: give up at that time (-2); FMC_INLINE_NOWAIT (an idle
 * stream's caller, or the send side itself): send what the socket takes now and hand the rest
 * to the send side. */
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
    /* A round of GPU sources is longer: its staging pipeline runs FMC_STAGE_DEPTH pieces ahead
     * within a round, so only a round's first gather is not hidden behind the wire. */
    size_t limit = first_sent && first_sent->local_dev >= 0 && first_sent->batch->opcode == FMC_OP_WRITE
                       ? FMC_GPU_ROUND_BYTES
                       : FMC_COALESCE_BYTES;
    while (st->pending.head && niov + 2 <= FMC_IOV_MAX && (bytes < limit || niov == 0)) {
        fmc_slice *s = st->pending.head;
        int is_write = s->batch->opcode == FMC_OP_WRITE;
        int vec = niov + 3 <= FMC_IOV_MAX && vectorizable(st->peer, s);
        int k = vec ? vector_length(st->peer, s, niov, nent, bytes, limit) : 1;
        if (niov > 0 && (k == 0 || (vec && k == 1 && s->next && s->next->batch == s->batch &&
                                    vectorizable(st->peer, s->next))))
            break; /* this round's vector tables are full: the next round sends these slices as
                    * vectors, not as a request each (reads add no payload bytes to end a round) */
        if (k >= 2) {
            /* One header, the table of k entries, then (writes) the k payloads. */
            uint8_t *table = sc->table[nent];
            uint64_t sum = 0;
            for (int j = 0; j < k; j++) {
                fmc_slice *x = st->pending.head;
                st->pending.head = x->next;
                fmc_slice_list_push(&st->inflight, x);
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
            int zc = is_write && zero_copy_payload(st, s, dev, sum, 1);
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
        fmc_slice_list_push(&st->inflight, s);
        s->vec_n = 1;
        size_t hlen = encode_request(st->peer->proto, s, is_write, sc->hdr[nh]);
        sc->zc[niov] = 0;
        sc->iov[niov++] = (struct iovec){.iov_base = sc->hdr[nh++], .iov_len = hlen};
        bytes += hlen;
        if (is_write) {
            sc->zc[niov] = (uint8_t)zero_copy_payload(st, s, s->local_dev, s->len, 0);
            nzc += sc->zc[niov];
            sc->iov[niov++] = (struct iovec){.iov_base = (void *)(uintptr_t)s->local, .iov_len = s->len};
            bytes += s->len;
            s->sending = 1;
            sc->writes[nw++] = s;
        }
    }
    if (first_sent)
        rx_expect_answers_locked(st); /* before the first byte leaves */
    int fd = st->fd;
    FMC_TR(FMC_TR_ROUND, fd, bytes);
    if (deadline_ms == FMC_INLINE_NOWAIT) {
        /* A GPU source (staging waits on a copy) or a zero-copy payload goes whole to the send
         * side, which sends it blocking; otherwise send what the socket takes now and leave the
         * rest to the send side, which goes on once the socket has room. */
        int gpu = 0;
        for (int i = 0; i < nw; i++)
            gpu |= sc->writes[i]->local_dev >= 0;
        struct iovec *rest = sc->iov;
        int rest_n = niov;
        if (!gpu && !nzc) {
            pthread_mutex_unlock(&st->mu);
            int rc = fmc_sendv_nowait(fd, &rest, &rest_n);
            pthread_mutex_lock(&st->mu);
            if (rc < 0)
                return end_round(st, sc, nw, rc);
        }
        if (rest_n == 0)
            return end_round(st, sc, nw, 0);
        if (st->dead) /* the send side may be gone: the exit path fails the slices */
            return end_round(st, sc, nw, -1);
        sc->rest = rest;
        sc->rest_n = rest_n;
        sc->rest_nw = nw;
        sc->rest_nzc = nzc;
        sc->rest_gpu = gpu;
        st->handoff = 1;
        FMC_TR(FMC_TR_HANDOFF, fd, rest_n);
        pthread_cond_broadcast(&st->cv); /* an exit path may wait on cv too */
        tx_kick_locked(st);
        return 0;
    }
    int gpu = 0;
    for (int i = 0; i < nw && !gpu; i++)
        gpu = sc->writes[i]->local_dev >= 0;
    pthread_mutex_unlock(&st->mu);
    int rc = send_round_iov(st, sc, niov, nw, gpu, deadline_ms);
    if (rc == -1 && errno == EFAULT) /* the stream dies with the slices it carried, as for any send error */
        fmc_engine_log(st->peer->engine, "a write to %s:%d failed: the kernel refused to read its source (its "
                       "protection changed after registration?); stream closed", st->peer->host, st->peer->data_port);
    pthread_mutex_lock(&st->mu);
    return end_round(st, sc, nw, rc);
}

/* The end of a send round, with st->mu held: returns rc. */
static int end_round(fmc_stream *st, send_scratch *sc, int nw, int rc)
{
    /* sendmsg no longer reads these slices.  Nobody else finishes a slice while `sending` is
     * set, so the pointers are still valid; the ones already answered are ours to finish. */
    for (int i = 0; i < nw; i++)
        sc->writes[i]->sending = 0;
    st->sending_active = 0;
    FMC_TR(FMC_TR_ROUND_END, st->fd, rc < 0 ? -rc : rc);
    /* Wake the send side only for queued work, and an exit path waiting to close fd: a
     * needless wake-up per inline call costs the caller a context switch on a small machine. */
    if (st->pending.head || st->dead || ack_due(st)) {
        pthread_cond_broadcast(&st->cv);
        tx_kick_locked(st);
    }
    if (st->answered.head) {
        fmc_slice *s = st->answered.head;
        st->answered.head = st->answered.tail = NULL;
        pthread_mutex_unlock(&st->mu);
        fmc_slices_finish(s, FMC_TASK_PENDING); /* each with its parked answer_status */
        pthread_mutex_lock(&st->mu);
    }
    return rc;
}

/* The rest of a round left to the send side (send_round's handoff), with st->mu held and
 * sending_active still set by that round: GPU sources and zero-copy payloads are sent blocking,
 * the rest as far as the socket takes it.  Returns what end_round does once the round is over,
 * or SEND_WAIT while the socket has no room (the round stays handed off). */
#define SEND_WAIT 1
static int finish_handoff(fmc_stream *st)
{
    send_scratch *sc = st->scratch;
    int fd = st->fd, nw = sc->rest_nw, rc;
    FMC_TR(FMC_TR_RESUME, fd, 0);
    if (st->dead) {
        rc = -1;
    } else if (sc->rest_gpu || (sc->rest_nzc && stream_zc(st))) {
        pthread_mutex_unlock(&st->mu);
        rc = sc->rest_gpu ? send_gpu_round(st, sc, sc->rest_n, nw, -1) /* nothing was sent: all of it */
                          : send_zc(st, fd, sc->rest, sc->rest_n, sc->zc + (sc->rest - sc->iov), -1);
        pthread_mutex_lock(&st->mu);
    } else {
        pthread_mutex_unlock(&st->mu);
        rc = fmc_sendv_nowait(fd, &sc->rest, &sc->rest_n);
        pthread_mutex_lock(&st->mu);
        if (rc == 0 && sc->rest_n > 0)
            return SEND_WAIT;
    }
    st->handoff = 0;
    return end_round(st, sc, nw, rc);
}

/* The send side, taken by a pool worker: rounds go out until nothing is queued or the socket
 * is full (then the socket is watched for room), or the stream dies (the side leaves). */
static void tx_run(fmc_stream *st)
{
    int lingered = 0; /* waited out a linger with nothing to send */
    pthread_mutex_lock(&st->mu);
    for (;;) {
        if (st->handoff) { /* before leaving too: the round's slices are `sending` until it ends */
            int rc = finish_handoff(st);
            if (rc == SEND_WAIT) {
                st->tx_state = FMC_ROLE_ARMED;
                watch_locked(st);
                pthread_mutex_unlock(&st->mu);
                return;
            }
            if (rc < 0)
                break;
            lingered = 0;
            continue;
        }
        if (st->dead)
            break;
        if (round_due(st)) {
            if (send_round(st, FMC_INLINE_NOWAIT) < 0)
                break;
            lingered = 0;
            continue;
        }
        fmc_pool_lingerer linger = {.mu = &st->mu, .cv = &st->cv};
        if (!lingered && STREAM_LINGER_MS > 0 && fmc_pool_linger_begin(&linger)) {
            /* Wait here for the next round (or an inline round's rest): tx_kick_locked wakes it,
             * and so does the pool calling the worker back.  Work that came as the wait ended
             * is still seen above. */
            struct timespec until;
            fmc_deadline_ts(STREAM_LINGER_MS, &until);
            st->tx_lingering = 1;
            while (!st->dead && !st->handoff && !round_due(st) && !lingered && !linger.recalled)
                lingered = pthread_cond_timedwait(&st->cv, &st->mu, &until) == ETIMEDOUT;
            st->tx_lingering = 0;
            fmc_pool_linger_end(&linger);
            lingered |= linger.recalled;
            continue;
        }
        st->tx_state = FMC_ROLE_OFF; /* an inline round in progress kicks it again at its end */
        pthread_mutex_unlock(&st->mu);
        return;
    }
    /* Dead from here on, before mu is let go: an inline round must not hand this side its rest
     * any more (send_round sees `dead`). */
    if (!st->dead) {
        st->dead = 1;
        if (st->fd >= 0)
            shutdown(st->fd, SHUT_RDWR);
    }
    pthread_mutex_unlock(&st->mu);
    role_exit(st, &st->tx_state);
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
        int queued = st->reconnecting; /* sent once it is back */
        if (queued)
            list_append(&st->pending, list);
        pthread_mutex_unlock(&st->mu);
        return queued ? FMC_OK : FMC_ERR_SOCKET;
    }
    int idle = !st->pending.head && !st->sending_active;
    fmc_batch *b = list->head ? list->head->batch : NULL;
    note_batch_size(st, list);
    /* The receive side is free to claim when it is parked, or lingering on the socket with
     * nothing in flight (its worker, woken by the caller's answers, then parks it: rx_wait). */
    int rx_free = st->rx_state == FMC_ROLE_ARMED || (st->rx_state == FMC_ROLE_RUNNING && st->rx_lingering);
    if (idle && claim_recv && rx_free && !st->inflight.head && !st->caller_recv &&
        st->peer->proto == FMC_PROTO_NATIVE && fmc_reader_buffered(&st->rd) == 0) {
        *claimed = st->caller_recv = 1;
        if (st->rx_state == FMC_ROLE_ARMED) {
            if (st->rx_events & EPOLLIN) { /* parked after a bulk batch: quieten its watch first */
                st->rx_events = EPOLLRDHUP;
                watch_locked(st);
            }
            st->rx_state = FMC_ROLE_OFF; /* its quiet watch stays set: a worker it wakes finds nothing to take */
        }
    }
    list_append(&st->pending, list);
    if (!idle) {
        if (!st->sending_active) /* else the round's end sees it */
            tx_kick_locked(st);
        pthread_mutex_unlock(&st->mu);
        return FMC_OK;
    }
    int rc = send_round(st, deadline_ms);
    pthread_mutex_unlock(&st->mu);
    if (rc == -2 && b) {
        fmc_batch_mark_cancelled(b); /* past the call's deadline: the others on it are sent again */
        fmc_stream_cut(st);
    }
    else if (rc < 0)
        fmc_stream_kill(st);
    return rc == -2 ? FMC_ERR_TIMEOUT : FMC_OK; /* other failures surface through the slices */
}

static int remote_status(int32_t status)
{
    if (status == FMC_OK || status == FMC_ERR_REMOTE_REFUSED || status == FMC_ERR_ADDRESS_NOT_REGISTERED)
        return status;
    return FMC_ERR_SOCKET;
}

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

/* The oldest pending piece lands; its slices, if it ends an answer, leave st->receiving for
 * `done` (or for the sender, while it may still read them).  Called without st->mu. */
static void land_oldest(fmc_stream *st, rx_ring *r, fmc_slice_list *done)
{
    rx_piece *p = &r->p[r->head];
    r->head = (r->head + 1) % FMC_STAGE_DEPTH;
    r->count--;
    if (p->failed || fmc_cuda_fence_wait(&p->fence) != FMC_OK)
        r->failed = 1;
    fmc_stage_put(&st->peer->engine->stage, p->chunk);
    p->chunk = NULL;
    if (!p->first)
        return;
    pthread_mutex_lock(&st->mu);
    for (int i = 0; i < p->nslices; i++) {
        fmc_slice *x = st->receiving.head;
        if (x != p->first && i == 0) { /* not at the head: cannot happen (answers land in order) */
            x = p->first;
            receiving_remove(st, x);
        } else {
            st->receiving.head = x->next;
            if (!st->receiving.head)
                st->receiving.tail = NULL;
        }
        if (r->failed && x->local_dev >= 0 && x->answer_status == FMC_OK)
            x->answer_status = FMC_ERR_DEVICE_NOT_FOUND;
        fmc_slice_list_push(x->sending ? &st->answered : done, x);
    }
    pthread_mutex_unlock(&st->mu);
    r->failed = 0;
}

static void land_all(fmc_stream *st, rx_ring *r, fmc_slice_list *done)
{
    while (r->count)
        land_oldest(st, r, done);
}

/* A receive chunk for a piece on `dev`: free ones first; with none, the oldest pending piece
 * lands and gives its chunk back; with nothing pending, the pool is waited for (until the stream
 * dies).  NULL: no chunk. */
static fmc_chunk *rx_chunk(fmc_stream *st, rx_ring *r, int dev, fmc_slice_list *done)
{
    fmc_stage_pool *pool = &st->peer->engine->stage;
    for (;;) {
        if (r->count == FMC_STAGE_DEPTH)
            land_oldest(st, r, done);
        fmc_chunk *k = fmc_stage_get(pool, FMC_STAGE_RECV, dev, r->count ? 0 : -1, &st->dead);
        if (k || !r->count)
            return k;
        land_oldest(st, r, done);
    }
}

/* Queue a piece's scatter (n copies from its chunk to one device) and add it to the pipeline. */
static rx_piece *rx_push(fmc_stream *st, rx_ring *r, fmc_chunk *k, int dev, uint64_t *dst, uint64_t *src,
                         size_t *len, int n)
{
    rx_piece *p = &r->p[(r->head + r->count) % FMC_STAGE_DEPTH];
    r->count++;
    p->chunk = k;
    p->first = NULL;
    p->nslices = 0;
    p->failed = fmc_stage_copy(st->peer->engine, k, &p->fence, dst, src, len, n, dev, 1) != FMC_OK;
    return p;
}

/* A read's destination the kernel refused to write (the caller's buffer was made read-only or
 * unmapped after registration): its payload was dropped, the slice fails, the stream goes on. */
static void local_refused(fmc_stream *st, fmc_slice *s)
{
    s->answer_status = FMC_ERR_INVALID_ARGUMENT;
    fmc_engine_log(st->peer->engine, "a read of %llu bytes into 0x%llx failed: the kernel refused to write the "
                   "local buffer (its protection changed after registration?)",
                   (unsigned long long)s->len, (unsigned long long)s->local);
}

/* A read's payload: straight into host memory (after every pending piece landed, so that `done`
 * keeps answer order), or into GPU memory through the pipeline, piece by piece.  Returns 1 when
 * the slice lands later (its last piece carries it), 0 when done, -1 on a broken stream. */
static int receive_payload(fmc_stream *st, fmc_reader *rd, fmc_slice *s, rx_ring *r, fmc_slice_list *done)
{
    if (s->local_dev < 0) {
        land_all(st, r, done);
        int rc = fmc_reader_read_region(rd, (void *)(uintptr_t)s->local, (size_t)s->len);
        if (rc == FMC_READ_REFUSED) {
            local_refused(st, s);
            return 0;
        }
        return rc;
    }
    for (uint64_t off = 0; off < s->len;) {
        size_t piece = s->len - off < FMC_STAGE_CHUNK ? (size_t)(s->len - off) : FMC_STAGE_CHUNK;
        fmc_chunk *k = rx_chunk(st, r, s->local_dev, done);
        if (!k || fmc_reader_read_into(rd, k->buf, piece) < 0) {
            fmc_stage_put(&st->peer->engine->stage, k);
            return -1;
        }
        uint64_t dst = s->local + off, src = (uint64_t)(uintptr_t)k->buf;
        size_t len = piece;
        rx_piece *p = rx_push(st, r, k, s->local_dev, &dst, &src, &len, 1);
        off += piece;
        if (off == s->len) {
            p->first = s;
            p->nslices = 1;
        }
    }
    return 1;
}

/* The rest of a vector's answer `a` for its k slices from `first` on (on st->receiving, see
 * fmc_wire.h): entry statuses when it failed, then a read's payloads, scattered straight into
 * place; GPU destinations' payloads through the pipeline, a piece at a time side by side in a
 * chunk.  Sets each slice's answer_status.  Returns 1 when the slices land later (with the last
 * piece), 0 when they are done, -1 if the answer does not fit the request or the stream broke. */
static int receive_vector(fmc_stream *st, fmc_reader *rd, const fmc_resp *a, fmc_slice *first, int k, rx_ring *r,
                          fmc_slice_list *done)
{
    int is_read = first->batch->opcode == FMC_OP_READ;
    uint64_t expect = 0;
    if (a->status != FMC_OK) {
        if (a->len < (uint64_t)k * 4 || fmc_reader_fill(rd, (size_t)k * 4) < 0)
            return -1;
        expect = (uint64_t)k * 4;
    }
    struct iovec iov[FMC_VEC_MAX];
    fmc_slice *into[FMC_VEC_MAX];
    int n = 0, j = 0;
    uint64_t gpu_bytes = 0;
    for (fmc_slice *x = first; x && j < k; x = x->next, j++) {
        int32_t status = a->status == FMC_OK ? FMC_OK : (int32_t)fmc_get32(rd->buf + rd->start + 4 * (size_t)j);
        x->answer_status = remote_status(status);
        if (is_read && status == FMC_OK) {
            into[n] = x;
            iov[n++] = (struct iovec){.iov_base = (void *)(uintptr_t)x->local, .iov_len = (size_t)x->len};
            expect += x->len;
            gpu_bytes += x->local_dev >= 0 ? x->len : 0;
        }
    }
    if (a->status != FMC_OK)
        rd->start += (size_t)k * 4;
    if (a->len != expect)
        return -1;
    if (!gpu_bytes)
        land_all(st, r, done); /* answers land in order */
    uint8_t refused[FMC_VEC_MAX] = {0};
    rx_piece *last = NULL;
    for (int i = 0, e; i < n; i = e) {
        /* The next piece: entries up to the next GPU one that does not fit the chunk or lies on
         * another device (host destinations are received in place along with it). */
        int dev = -1;
        size_t staged = 0;
        for (e = i; e < n; e++) {
            if (into[e]->local_dev < 0)
                continue;
            if (dev >= 0 && (into[e]->local_dev != dev || staged + into[e]->len > FMC_STAGE_CHUNK))
                break;
            dev = into[e]->local_dev;
            staged += into[e]->len;
        }
        fmc_chunk *c = dev >= 0 ? rx_chunk(st, r, dev, done) : NULL;
        if (dev >= 0 && !c)
            return -1;
        uint64_t dst[FMC_VEC_MAX], src[FMC_VEC_MAX], off = 0;
        size_t len[FMC_VEC_MAX];
        int m = 0;
        for (int x = i; c && x < e; x++) {
            if (into[x]->local_dev < 0)
                continue;
            iov[x].iov_base = c->buf + off;
            dst[m] = into[x]->local;
            src[m] = (uint64_t)(uintptr_t)iov[x].iov_base;
            len[m++] = (size_t)into[x]->len;
            off += into[x]->len;
        }
        if (fmc_reader_read_regions(rd, iov + i, e - i, refused + i) < 0) {
            fmc_stage_put(&st->peer->engine->stage, c);
            return -1;
        }
        if (c)
            last = rx_push(st, r, c, dev, dst, src, len, m);
    }
    for (int i = 0; i < n; i++)
        if (refused[i])
            local_refused(st, into[i]);
    if (!last)
        return 0;
    last->first = first;
    last->nslices = k;
    return 1;
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
    if (proto == FMC_PROTO_MOONCAKE)
        return fmc_mc_read_answer(rd, a);
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

/* For a caller reading its own answers: the slice at the head of `inflight` (*s), if it is of
 * `opcode`, its answer's header (*a, left in the buffer) and the slices that answer covers (*k).
 * 1: all there; -1: the header has not all come yet; 0: no such slice. */
static int head_answer(fmc_stream *st, int opcode, fmc_slice **s, fmc_resp *a, int *k)
{
    *s = st->inflight.head;
    if (!*s || (*s)->batch->opcode != opcode)
        return 0;
    if (fmc_reader_buffered(&st->rd) < FMC_RESP_SIZE)
        return -1;
    fmc_resp_decode(st->rd.buf + st->rd.start, a);
    *k = (*s)->vec_n >= 2 ? (*s)->vec_n : 1;
    return 1;
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
        fmc_slice *s;
        fmc_resp a;
        int k, head = head_answer(st, FMC_OP_WRITE, &s, &a, &k);
        if (head <= 0)
            return head < 0;
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
            fmc_slice_list_push(x->sending ? &st->answered : done, x);
        }
        if (!st->inflight.head)
            st->inflight.tail = NULL;
        rd->start += FMC_RESP_SIZE + statuses;
    }
}

/* An answer's slices, first..last at the head of `inflight`, move to `receiving` while its
 * payload is placed (a cancel then still finds them on the wire and cuts the stream). */
static void move_to_receiving_locked(fmc_stream *st, fmc_slice *first, fmc_slice *last)
{
    st->inflight.head = last->next;
    if (!st->inflight.head)
        st->inflight.tail = NULL;
    last->next = NULL;
    if (st->receiving.tail)
        st->receiving.tail->next = first;
    else
        st->receiving.head = first;
    st->receiving.tail = last;
}

/* A caller places a read's answer while the rest of it arrives only while at least this much is
 * still to come: the last few KiB come within microseconds, sooner than a receive that sleeps
 * for them wakes, and a wait costs two setsockopt calls (the deadline's receive timeout). */
#define CALLER_WAITS_FOR_BYTES (32u << 10)

/* A read answer into host memory at the head of `inflight`, taken by the caller that owns the
 * receive side the way the receive side takes it (rx_run).  Once its header is buffered the
 * caller places the payload as it arrives, overlapping the target's sending (64 blocks of 4 KiB
 * made 1.07-1.41x the calls per second of waiting for all of it on a 2-core VM), but only where it may wait
 * (wait_until_ms >= 0): the receive then gives up at that deadline (the socket's receive
 * timeout, and the reader's deadline), and the stream is cut as a send past its deadline
 * is.  A caller that must not block takes the answer only once all of it is queued in the
 * socket (FIONREAD), and so does any caller for an answer of another call (`mine` is its own
 * batch): a wait for it would end at this caller's deadline, not that call's.  Called and
 * returns with st->mu held (dropped while the payload is placed).
 * Returns 1 to keep polling, 0 to stop and leave what is left to the receive side (nothing in
 * flight, an answer not for a host read, one that matches no request, or a broken stream, which
 * is killed). */
static int take_read_answer_locked(fmc_stream *st, const fmc_batch *mine, fmc_slice_list *done, int64_t wait_until_ms)
{
    fmc_reader *rd = &st->rd;
    fmc_slice *s;
    fmc_resp a;
    int k, head = head_answer(st, FMC_OP_READ, &s, &a, &k);
    if (head <= 0)
        return head < 0;
    if (s->batch != mine)
        wait_until_ms = -1; /* another call's answer: never waited for past this caller's deadline */
    fmc_slice *last = s;
    for (int j = 1; j < k && last; j++)
        last = last->next;
    /* A caller that must not block takes only what the socket can hold whole. */
    if (a.id != s->id || !last || (wait_until_ms < 0 && a.len > FMC_SMALL_TRANSFER_BYTES + (uint64_t)k * 4))
        return 0;
    for (fmc_slice *x = s; x != last->next; x = x->next)
        if (x->local_dev >= 0)
            return 0;
    int queued = 0;
    if (ioctl(rd->fd, FIONREAD, &queued) < 0)
        return 0;
    uint64_t here = fmc_reader_buffered(rd) - FMC_RESP_SIZE + (size_t)queued;
    int wait = here < a.len;
    if (wait && (wait_until_ms < 0 || a.len - here < CALLER_WAITS_FOR_BYTES))
        return 1; /* not all here yet, and not worth a wait in the receive */
    rd->start += FMC_RESP_SIZE;
    move_to_receiving_locked(st, s, last);
    pthread_mutex_unlock(&st->mu);
    if (wait)
        fmc_reader_set_deadline(rd, wait_until_ms > 0 ? wait_until_ms : 1);
    int got;
    if (k >= 2) {
        got = receive_vector(st, rd, &a, s, k, st->rx_gpu, done);
    } else {
        s->answer_status = remote_status(a.status);
        got = a.len != (a.status == FMC_OK ? s->len : 0) ? -1
              : a.len                                     ? receive_payload(st, rd, s, st->rx_gpu, done)
                                                          : 0;
    }
    int late = rd->timed_out;
    if (wait)
        fmc_reader_set_deadline(rd, 0);
    int broken = got != 0 || zc_answer_void(st, &a);
    if (broken && late)
        fmc_batch_mark_cancelled(s->batch); /* past the call's deadline: the others on it are sent again */
    pthread_mutex_lock(&st->mu);
    if (broken) {
        for (fmc_slice *x = s; x; x = x->next)
            x->answer_status = late ? FMC_ERR_TIMEOUT : FMC_ERR_SOCKET;
        rd->start = rd->end; /* mid-answer: the receive side finds nothing to read, only the end */
        if (late && !st->dead)
            cut_locked(st); /* as a send past its deadline is */
        else
            kill_locked(st);
        return 0;
    }
    st->zc_owed += (a.flags & FMC_RESP_ZC) != 0;
    for (fmc_slice *x = s, *next; x; x = next) {
        next = x->next;
        fmc_slice_list_push(done, x);
    }
    st->receiving.head = st->receiving.tail = NULL;
    send_ack_if_due_locked(st);
    return st->inflight.head != NULL; /* else nothing is left to wait for here */
}

/* Sleep until fd has bytes to read, or until until_us. */
static void wait_readable(int fd, int64_t until_us)
{
    int64_t left = until_us - fmc_now_us();
    if (left <= 0)
        return;
    struct pollfd pf = {.fd = fd, .events = POLLIN | POLLRDHUP};
    struct timespec ts = {.tv_sec = left / 1000000, .tv_nsec = (left % 1000000) * 1000};
    ppoll(&pf, 1, &ts, NULL);
}

/* The caller that claimed the receive side (fmc_stream_enqueue_inline) polls the socket for
 * its answers until batch `b` is finished or `until_us` passes, then hands the receive side
 * back.  On a 2-core machine this is what makes a small synchronous write cheap: only the
 * caller and the target's thread run, and no sleeping receiver needs waking; a small read into
 * host memory saves the same wake-up, and the hand-over of its answer.  The caller of a bulk
 * read over several streams takes one stream's share this way (fmc_tcp_transport.c). */
void fmc_stream_caller_receive(fmc_stream *st, fmc_batch *b, int64_t until_us, int64_t wait_until_ms)
{
    int got = 0;
    int is_read = b->opcode == FMC_OP_READ;
    /* A share of a bulk read comes over hundreds of microseconds: its caller sleeps until the
     * next answer's first bytes, where a small call's caller spins. */
    int sleeps = is_read && wait_until_ms >= 0 && b->bytes > FMC_SMALL_TRANSFER_BYTES;
    for (;;) {
        fmc_slice_list done = {0};
        pthread_mutex_lock(&st->mu);
        int more = !st->dead &&
                   (is_read ? take_read_answer_locked(st, b, &done, wait_until_ms) : take_write_answers_locked(st, &done));
        pthread_mutex_unlock(&st->mu);
        fmc_slices_finish(done.head, FMC_TASK_PENDING);
        if (!more || __atomic_load_n(&b->finished, __ATOMIC_ACQUIRE) || fmc_now_us() >= until_us)
            break;
        /* A read's header in hand, the rest is counted in the socket (FIONREAD), not read ahead. */
        got = is_read && fmc_reader_buffered(&st->rd) >= FMC_RESP_SIZE ? 0 : fmc_reader_try_more(&st->rd);
        if (got < 0)
            break; /* EOF or error: the thread reads it again and fails the stream */
        if (got == 0 && sleeps && fmc_reader_buffered(&st->rd) < FMC_RESP_SIZE)
            wait_readable(st->rd.fd, until_us);
        else if (got == 0)
            sched_yield();
    }
    pthread_mutex_lock(&st->mu);
    st->caller_recv = 0;
    if (st->rx_state == FMC_ROLE_OFF) { /* back to the receive side, on the watch it parked with */
        st->rx_state = FMC_ROLE_ARMED;
        /* Quiet once its answers are in, even after a bulk batch: the next such call claims it
         * again without re-watching the socket. */
        st->rx_events = EPOLLRDHUP | (st->inflight.head || st->dead || got < 0 ? EPOLLIN : 0);
        watch_locked(st);
        if (!st->inflight.head && !st->dead)
            went_idle_locked(st); /* a read's zero-copy answers are owed an acknowledgement */
    }
    if (st->dead)
        pthread_cond_broadcast(&st->cv); /* the exit path waits for the receive side */
    pthread_mutex_unlock(&st->mu);
}

/* Woken with nothing in flight: a peer that closed the idle stream (or sent bytes nobody asked
 * for) kills it, so the session cache sees it as unhealthy and reconnects before the next
 * transfer.  The socket itself is asked: the event may be an old one. */
static void rx_check_idle(fmc_stream *st)
{
    pthread_mutex_lock(&st->mu);
    if (!st->dead && !st->inflight.head && !st->caller_recv && st->fd >= 0) {
        struct pollfd pf = {.fd = st->fd, .events = POLLIN | POLLRDHUP};
        if (poll(&pf, 1, 0) > 0)
            kill_locked(st);
    }
    pthread_mutex_unlock(&st->mu);
}

enum { RX_GO, RX_PARKED, RX_LEAVE };

/* No answer is buffered: read on if bytes are there, else park the receive side (the socket
 * watched for answers, or its quiet watch while nothing is in flight or a caller reads its own
 * answers).  RX_LEAVE once the stream is dead or its socket ended. */
static int rx_wait(fmc_stream *st)
{
    int lingered = 0;
    pthread_mutex_lock(&st->mu);
    for (;;) {
        if (st->dead) {
            pthread_mutex_unlock(&st->mu);
            return RX_LEAVE;
        }
        if (!st->caller_recv && !st->inflight.head && st->bulk && !lingered && STREAM_LINGER_MS > 0) {
            /* Wait on the socket alone for the next batch's answers (fmc_pool_linger); readable
             * with nothing in flight (an end, or bytes nobody asked for), it parks below and the
             * set's event has rx_run look at it. */
            int fd = st->fd;
            went_idle_locked(st);
            st->rx_lingering = 1;
            pthread_mutex_unlock(&st->mu);
            int ready = fmc_pool_linger(fd, STREAM_LINGER_MS);
            pthread_mutex_lock(&st->mu);
            st->rx_lingering = 0;
            lingered = !ready || !st->inflight.head;
            continue;
        }
        if (st->caller_recv || !st->inflight.head) {
            st->rx_state = st->caller_recv ? FMC_ROLE_OFF : FMC_ROLE_ARMED;
            st->rx_events = EPOLLRDHUP | (st->bulk ? EPOLLIN : 0);
            watch_locked(st);
            if (!st->inflight.head && !lingered) /* a linger stamped the idle time when it began */
                went_idle_locked(st);
            pthread_mutex_unlock(&st->mu);
            return RX_PARKED;
        }
        pthread_mutex_unlock(&st->mu);
        int got = fmc_reader_try_more(&st->rd);
        if (got != 0)
            return got > 0 ? RX_GO : RX_LEAVE;
        pthread_mutex_lock(&st->mu);
        if (!st->dead && !st->caller_recv && st->inflight.head) {
            st->rx_state = FMC_ROLE_ARMED;
            st->rx_events = EPOLLIN | EPOLLRDHUP;
            watch_locked(st);
            pthread_mutex_unlock(&st->mu);
            return RX_PARKED;
        }
    }
}

/* The receive side, taken by a pool worker: answers are matched to in-flight slices in order
 * until none is left to read now (the side parks, see rx_wait) or the stream breaks or is cut
 * (the side leaves; every GPU piece has landed and every answered slice is finished first).
 * The answers already buffered are taken under one hold of the stream lock and their slices
 * finished together (one batch lock per run). */
static void rx_run(fmc_stream *st)
{
    int proto = st->peer->proto;
    fmc_reader *rd = &st->rd;
    rx_ring *gpu = st->rx_gpu;
    fmc_slice_list done = {0};
    rx_check_idle(st);
    for (;;) {
        fmc_resp a;
        if (!answer_buffered(proto, rd)) {
            land_all(st, gpu, &done); /* before this side may park */
            fmc_slices_finish(done.head, FMC_TASK_PENDING);
            done.head = done.tail = NULL;
            int next = rx_wait(st);
            if (next == RX_PARKED)
                return;
            if (next == RX_LEAVE)
                break;
        }
        if (read_answer(proto, rd, &a) < 0)
            break;
        pthread_mutex_lock(&st->mu);
        int broken = 0;
        for (;;) {
            fmc_slice *s = st->inflight.head;
            if (s && s->vec_n >= 2) {
                /* A vector's answer: its slices leave `inflight` together, behind the slices of
                 * GPU pieces still landing on `receiving`. */
                int k = s->vec_n;
                fmc_slice *first = s;
                for (int j = 1; j < k && s; j++)
                    s = s->next;
                if (!s || first->id != a.id) {
                    pthread_mutex_unlock(&st->mu);
                    log_bad_answer(st, "an answer that matches no request");
                    broken = 1;
                    break;
                }
                move_to_receiving_locked(st, first, s);
                pthread_mutex_unlock(&st->mu);
                fmc_slices_finish(done.head, FMC_TASK_PENDING); /* not held while the payload comes */
                done.head = done.tail = NULL;
                int got = receive_vector(st, rd, &a, first, k, gpu, &done);
                if (got < 0) {
                    log_bad_answer(st, "a vector answer that does not fit its request");
                    broken = 1; /* `receiving` stays set: the exit path fails it */
                    break;
                }
                if (zc_answer_void(st, &a)) {
                    for (fmc_slice *x = first; x; x = x->next)
                        x->answer_status = FMC_ERR_SOCKET; /* a GPU landing finishes them so */
                    broken = 1;
                    break;
                }
                pthread_mutex_lock(&st->mu);
                st->zc_owed += (a.flags & FMC_RESP_ZC) != 0;
                if (got == 1) /* they land with the vector's last GPU piece */
                    goto next_answer;
                /* Every earlier piece landed (receive_vector): `receiving` holds just these. */
                for (fmc_slice *x = first, *next; x; x = next) {
                    next = x->next;
                    fmc_slice_list_push(x->sending ? &st->answered : &done, x);
                }
                st->receiving.head = st->receiving.tail = NULL;
                goto next_answer;
            }
            if (s && proto == FMC_PROTO_MOONCAKE)
                fmc_mc_match_answer(s, &a); /* its answers carry no id: in-order delivery is the match */
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
                fmc_slice_list_push(&st->receiving, s);
                pthread_mutex_unlock(&st->mu);
                fmc_slices_finish(done.head, FMC_TASK_PENDING); /* not held while the payload comes */
                done.head = done.tail = NULL;
                int got = receive_payload(st, rd, s, gpu, &done);
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
            fmc_slice_list_push(s->sending ? &st->answered : &done, s);
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
    land_all(st, gpu, &done); /* no copy may still run into a slice the exit path fails */
    fmc_slices_finish(done.head, FMC_TASK_PENDING); /* answered before the stream broke */
    role_exit(st, &st->rx_state);
}

/* An event on a stream's socket: a worker takes the side it wakes, if that side is still armed
 * and waits for it (an old event of a stream since gone, or reconnected, finds nothing). */
static void stream_event(void *owner, uint32_t events)
{
    fmc_io_handle *h = owner;
    pthread_mutex_lock(&h->mu); /* the stream cannot be released meanwhile */
    fmc_stream *st = h->st;
    int side = 0;
    if (st) {
        pthread_mutex_lock(&st->mu);
        st->watched = 0; /* EPOLLONESHOT: the watch is off until set again */
        uint32_t always = EPOLLHUP | EPOLLERR;
        if (st->rx_state == FMC_ROLE_ARMED && (events & (st->rx_events | always))) {
            st->rx_state = FMC_ROLE_RUNNING;
            side = 1;
        } else if (st->tx_state == FMC_ROLE_ARMED && (events & (EPOLLOUT | always))) {
            st->tx_state = FMC_ROLE_RUNNING;
            side = 2;
        }
        watch_locked(st); /* for the side left armed, if any */
        pthread_mutex_unlock(&st->mu);
    }
    pthread_mutex_unlock(&h->mu);
    /* A blocking send or receive that waits out the socket's stall tick with no byte moved is a
     * stall (fmc_pool_stall): a peer that stops reading, or stops mid-answer, costs this worker,
     * not the others' turn, while payloads that keep moving keep it counted against the cap.  No
     * limit: the call's deadline, a cut or the peer's close ends such a wait. */
    fmc_stall_hook_set(fmc_pool_stall, 0);
    if (side == 1)
        rx_run(st);
    else if (side == 2)
        tx_run(st);
    fmc_stall_hook_set(NULL, 0);
}
