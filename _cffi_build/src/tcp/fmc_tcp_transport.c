/* The TCP transport as batches see it (fmc_tcp_ops): a batch's tasks cut into slices, runs of
 * them handed to the peer's streams (fmc_stream.c), small ones sent from the calling thread;
 * cancelling takes back unsent slices and cuts the streams that carry the rest.  Serves both
 * framings the streams speak (native, and Mooncake's through its codec). */
#define _GNU_SOURCE
#include <string.h>

#include "fmc_internal.h"

/* The stream a batch starts on.  Small batches (FMC_SMALL_TRANSFER_BYTES) go back to the
 * stream the last small one used while it is idle: the target's thread for that connection is
 * then still polling for the next request (FLAGCX_MC_SPIN_US) instead of asleep, which is most
 * of a small call's round trip on a VM.  Round robin otherwise, and when that stream is busy
 * with someone else's batch. */
static int start_stream(fmc_peer *p, uint64_t bytes, int nready)
{
    if (bytes <= FMC_SMALL_TRANSFER_BYTES) {
        int hot = atomic_load_explicit(&p->hot_stream, memory_order_relaxed);
        fmc_stream *st = &p->streams[hot];
        if (pthread_mutex_trylock(&st->mu) == 0) {
            int idle = !st->pending.head && !st->sending_active && !st->inflight.head;
            pthread_mutex_unlock(&st->mu);
            if (idle)
                return hot;
        }
    }
    int stream = (int)(atomic_fetch_add(&p->rr, 1) % (uint32_t)nready);
    if (bytes <= FMC_SMALL_TRANSFER_BYTES)
        atomic_store_explicit(&p->hot_stream, stream, memory_order_relaxed);
    return stream;
}

/* Bytes of a batch one stream takes before the next stream's turn: a share that puts every
 * stream to work (on the target, each stream's bytes are received by one thread, so a 4 MiB batch
 * cut in 1 MiB runs kept 4 of 8 streams busy and ran no faster with more), but at least
 * FMC_SMALL_TRANSFER_BYTES, below which a second stream costs more wake-ups than it saves, and at
 * most slice_size.  The share is of at most as many streams as this process has CPUs: each
 * stream's bytes wake a sender and a receiver thread, and on 2 CPUs a 1 MiB batch over 2 of
 * 4 streams took 206 instead of 230 us with a quarter less CPU (larger batches still reach
 * every stream, slice_size at a time). */
static uint64_t stream_run_bytes(const fmc_peer *p, uint64_t total, uint64_t min_share, int nready)
{
    int cores = p->engine->cores;
    uint64_t spread = (uint64_t)(nready < cores ? nready : cores);
    uint64_t share = (total + spread - 1) / spread;
    if (share < min_share)
        share = min_share;
    return share < p->slice_size ? share : p->slice_size;
}

/* The smallest share of a group (req->group): several concurrent calls gathered by the async
 * facade, which keeps about two groups of a peer in flight (engine/coalesce.py).  A group takes
 * streams in shares of at least this much, so that one of up to that much stays on one stream and
 * the group behind it finds another (on 2 CPUs, 16 coroutines of 64 KiB writes in two 512 KiB
 * groups on one stream each made 17 % more calls/s than one 1 MiB group on two streams; on two
 * streams each, their thread wake-ups doubled, the same groups made fewer). */
#define FMC_GROUP_SHARE_BYTES (512u << 10)

/* Bytes per slice of a task: slice_size, but at most one staging chunk where the local side is
 * GPU memory, so that each such slice is staged in one chunk (fmc_stage_pool.c), and at most
 * one stream's run of the batch (run_bytes), so that a batch of one large block spreads over as
 * many streams as the same bytes in small blocks (on 16 CPUs, one 4 MiB block cut at slice_size
 * reached 4 of 8 streams and moved 0.73x what 64 blocks of 64 KiB moved). */
static uint64_t slice_bytes(const fmc_peer *p, int32_t local_dev, uint64_t run_bytes)
{
    uint64_t ss = local_dev >= 0 && p->slice_size > FMC_STAGE_CHUNK ? FMC_STAGE_CHUNK : p->slice_size;
    return run_bytes < ss ? run_bytes : ss;
}

/* The streams whose receive sides a calling thread claimed in its last submit (*caller_rx
 * points here), read by that thread in caller_receive within the same call. */
typedef struct caller_claims {
    int n;
    fmc_stream *st[FMC_MAX_STREAMS];
} caller_claims;
static __thread caller_claims my_claims;

/* How many shares of a synchronous read over `used` streams its caller receives itself: one,
 * and where the host has fewer CPUs than that many receivers need, as many as leave one stream
 * per other CPU to the receive sides, while every stream carries one run.  On 2 CPUs, 4 MiB
 * reads of 64 KiB blocks moved 1.07x as fast with the caller taking 3 of 4 shares: the receive
 * sides woken at once queued on one CPU while the other idled.  A batch of several runs per
 * stream keeps them on their receive sides (a caller reading whole 16 MiB shares in turn held
 * the target's senders of the others up: 0.66x at 16 MiB x 4). */
static int caller_read_shares(const fmc_peer *p, int used, uint64_t total, uint64_t run_bytes, int nready)
{
    int others = p->engine->cores - 1 > 1 ? p->engine->cores - 1 : 1;
    if (total > (uint64_t)nready * run_bytes || used - others <= 1)
        return 1;
    return used - others;
}

/* req->inline_deadline_ms >= 0 or FMC_INLINE_NOWAIT: the caller waits for the batch, so a small
 * one may be sent from its thread (FMC_INLINE_NOWAIT: as far as it goes without blocking); with
 * caller_rx also set, the caller may read its own answers (*caller_rx: the streams whose
 * receive sides it then owns, see fmc_stream_caller_receive).  Never declines. */
static int tcp_submit(const fmc_transfer_req *req, fmc_batch **out, void **caller_rx)
{
    my_claims.n = 0;
    fmc_peer *p = req->peer;
    int opcode = req->opcode, n = req->n;
    const uint64_t *local = req->local, *remote = req->remote, *lens = req->lens;
    const int32_t *ldev = req->local_dev;
    int64_t inline_deadline_ms = req->inline_deadline_ms;
    uint64_t nslices = 0, total = 0;
    for (int i = 0; i < n; i++)
        total += lens[i];
    /* The streams connected so far carry it; one that would use more (a share of at least
     * FMC_SMALL_TRANSFER_BYTES each, see stream_run_bytes) has them connected for the calls
     * after it. */
    int nready = atomic_load_explicit(&p->nready, memory_order_acquire);
    if (total > FMC_SMALL_TRANSFER_BYTES && nready < p->nstreams) {
        uint64_t would_use = (total + FMC_SMALL_TRANSFER_BYTES - 1) / FMC_SMALL_TRANSFER_BYTES;
        fmc_peer_grow(p, would_use < (uint64_t)p->nstreams ? (int)would_use : p->nstreams);
    }
    if (nready < 1)
        nready = 1; /* not connected: stream 0 refuses it */
    uint64_t run_bytes = stream_run_bytes(p, total, req->group ? FMC_GROUP_SHARE_BYTES : FMC_SMALL_TRANSFER_BYTES,
                                          nready);
    for (int i = 0; i < n; i++)
        nslices += (lens[i] + slice_bytes(p, ldev[i], run_bytes) - 1) / slice_bytes(p, ldev[i], run_bytes);
    if (nslices > (1u << 30)) {
        fmc_set_error("batch too large (%llu slices)", (unsigned long long)nslices);
        return FMC_ERR_TOO_MANY_REQUESTS;
    }
    fmc_batch *b = req->new_batch(req, (int)nslices);
    if (!b)
        return FMC_ERR_MEMORY;
    /* Cut tasks into slices and hand runs of about run_bytes to successive streams, so that many
     * small tasks ride one stream together and big ones spread over all of them. */
    fmc_slice_list per_stream[FMC_MAX_STREAMS];
    memset(per_stream, 0, sizeof per_stream);
    int stream = start_stream(p, total, nready);
    uint64_t run = 0;
    uint64_t first_id = atomic_fetch_add(&p->next_id, nslices); /* one atomic per batch, not per slice */
    int k = 0;
    for (int i = 0; i < n; i++) {
        b->task_status[i] = lens[i] ? FMC_TASK_PENDING : FMC_OK;
        uint64_t ss = slice_bytes(p, ldev[i], run_bytes);
        for (uint64_t off = 0; off < lens[i]; off += ss) {
            fmc_slice *s = &b->slices[k];
            s->id = first_id + (uint64_t)k++;
            s->batch = b;
            s->task = i;
            s->local = local[i] + off;
            s->remote = remote[i] + off;
            s->len = lens[i] - off < ss ? lens[i] - off : ss;
            s->key = req->keys[i];
            s->local_dev = ldev[i];
            b->task_remaining[i]++;
            b->bytes += s->len;
            fmc_slice_list_push(&per_stream[stream], s);
            run += s->len;
            if (run >= run_bytes) {
                run = 0;
                stream = (stream + 1) % nready;
            }
        }
    }
    b->outstanding = (int)nslices;
    b->finished = nslices == 0;
    *out = b;
    int used = 0, last_used = -1;
    for (int i = 0; i < p->nstreams; i++)
        if (per_stream[i].head) {
            used++;
            last_used = i;
        }
    b->spread = used > 1;
    /* The calling thread sends on idle streams itself (no sender-thread wake-up) a small transfer
     * that fits one stream, and a synchronous read's requests on every stream: they carry no
     * payload, and each wake-up spared costs tens of microseconds on a loaded small machine.
     * Other writes keep their send sides, which push the streams' payloads in parallel (the
     * caller of a synchronous one sends one share beside them, below). */
    int small = used == 1 && (inline_deadline_ms >= 0 || inline_deadline_ms == FMC_INLINE_NOWAIT) &&
                b->bytes <= FMC_SMALL_TRANSFER_BYTES;
    int send_here = small || (opcode == FMC_OP_READ && inline_deadline_ms >= 0 && p->proto == FMC_PROTO_NATIVE);
    /* Its caller then reads the answers itself: a write's, and a read's into host memory (a GPU
     * destination's answer goes through the receive side's staging pipeline). */
    int host_dst = opcode == FMC_OP_READ;
    for (int i = 0; host_dst && i < n; i++)
        host_dst = ldev[i] < 0;
    int claim = small && caller_rx && (opcode == FMC_OP_WRITE || host_dst) && fmc_spin_us(p->engine) > 0;
    /* A synchronous read into host memory over several streams: the caller, which would only
     * wait, receives the shares of the first streams whose receive sides it can claim (one, or
     * more on small hosts: caller_read_shares), beside the receive sides of the others (a
     * wake-up fewer per share, and one more core placing bytes). */
    int claim_share = !small && used > 1 && caller_rx && opcode == FMC_OP_READ && host_dst && inline_deadline_ms >= 0 &&
                      p->proto == FMC_PROTO_NATIVE && fmc_spin_us(p->engine) > 0
                          ? caller_read_shares(p, used, b->bytes, run_bytes, nready)
                          : 0;
    /* A synchronous write over several streams: the other streams' send sides start first, and
     * the caller, which would only wait, sends the last stream's share itself (one wake-up and
     * one hand-over fewer, and one more core sending). */
    int caller_share = !send_here && used > 1 && opcode == FMC_OP_WRITE && inline_deadline_ms >= 0 ? last_used : -1;
    for (int i = 0; i < p->nstreams; i++) {
        if (!per_stream[i].head)
            continue;
        fmc_slice *head = per_stream[i].head;
        int claimed = 0, rc;
        if (send_here || i == caller_share)
            rc = fmc_stream_enqueue_inline(&p->streams[i], &per_stream[i], inline_deadline_ms,
                                           claim || my_claims.n < claim_share, &claimed);
        else
            rc = fmc_stream_enqueue(&p->streams[i], &per_stream[i]);
        if (claimed) {
            my_claims.st[my_claims.n++] = &p->streams[i];
            *caller_rx = &my_claims;
        }
        if (rc == FMC_ERR_SOCKET)
            fmc_slices_finish(head, FMC_ERR_SOCKET); /* never queued: the stream was already down */
        else if (rc == FMC_ERR_TIMEOUT)
            fmc_batch_report_error(b, FMC_ERR_TIMEOUT); /* the cut stream fails the slices; report why */
    }
    return FMC_OK;
}

static int list_has_cancelled(fmc_slice *s, fmc_batch *b)
{
    for (; s; s = s->next)
        if (s->batch == b && fmc_slice_cancelled(s))
            return 1;
    return 0;
}

/* The cancelled tasks' unsent slices are taken back (they end with FMC_ERR_TIMEOUT), and each
 * stream carrying one of their slices on the wire is cut (fmc_stream_cut), which is the only way
 * to stop a socket reading or writing their memory; the stream's exit path then finishes them.
 * Other calls' slices on a cut stream are sent again once it has reconnected: one-sided writes
 * and reads are idempotent.  The cancelled slices are those fmc_slice_cancelled names, so
 * [first, first + count) needs no walk of its own. */
static void tcp_cancel_tasks(fmc_batch *b, int first, int count)
{
    fmc_peer *p = b->peer;
    for (int i = 0; i < p->nstreams; i++) {
        fmc_stream *st = &p->streams[i];
        fmc_slice_list removed = {0}, keep = {0};
        pthread_mutex_lock(&st->mu);
        /* Unsent slices are simply taken back. */
        for (fmc_slice *s = st->pending.head, *next; s; s = next) {
            next = s->next;
            fmc_slice_list_push(s->batch == b && fmc_slice_cancelled(s) ? &removed : &keep, s);
        }
        st->pending = keep;
        /* Slices on the wire may still read or write our memory: only cutting the stream stops
         * that, and the stream's exit path then finishes them. */
        int cut = list_has_cancelled(st->receiving.head, b) || list_has_cancelled(st->inflight.head, b) ||
                  list_has_cancelled(st->answered.head, b); /* answered, but sendmsg still reads it */
        pthread_mutex_unlock(&st->mu);
        if (cut)
            fmc_stream_cut(st);
        fmc_slices_finish(removed.head, FMC_ERR_TIMEOUT);
    }
}

/* The claimed receive sides in turn, each handed back once its share is in (or the time is up). */
static void tcp_caller_receive(void *caller_rx, fmc_batch *b, int64_t until_us, int64_t wait_until_ms)
{
    caller_claims c = *(caller_claims *)caller_rx;
    ((caller_claims *)caller_rx)->n = 0;
    for (int i = 0; i < c.n; i++)
        fmc_stream_caller_receive(c.st[i], b, until_us, wait_until_ms);
}

const fmc_transport_ops fmc_tcp_ops = {
    .submit = tcp_submit,
    .healthy = fmc_peer_is_healthy, /* fmc_peer_connect.c: connected, no stream dead for good */
    .cancel_tasks = tcp_cancel_tasks,
    .caller_receive = tcp_caller_receive,
};
