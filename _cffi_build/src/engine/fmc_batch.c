/* Batches: a vector of (local, remote, length) tasks cut into slices, spread over a peer's
 * streams, tracked per task, and waited for with a deadline.  A wait that times out cancels the
 * batch and returns only once no stream thread touches the batch's memory. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "fmc_internal.h"

static void mark_error(fmc_batch *b, int status)
{
    pthread_mutex_lock(&b->mu);
    if (b->first_error == FMC_OK)
        b->first_error = status;
    pthread_mutex_unlock(&b->mu);
}

static fmc_batch *batch_alloc(fmc_peer *p, int opcode, int ntasks, int nslices);

/* The same-host path: copy now, in this thread, and hand back a batch that is already finished.
 * Returns 1 (not taken: some region has no same-host slot) so the caller falls back to TCP. */
static int same_host(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                     const uint64_t *lens, const int32_t *local_dev, fmc_batch **out, int64_t deadline_ms)
{
    fmc_sh_route *routes = malloc(sizeof *routes * (size_t)(n ? n : 1));
    if (!routes)
        return FMC_ERR_MEMORY;
    if (!fmc_peer_lookup_routes(p, n, remote, lens, local_dev, routes)) {
        free(routes);
        return 1;
    }
    int rc = fmc_sh_transfer(p, opcode, n, local, remote, lens, local_dev, routes, deadline_ms);
    fmc_peer_routes_done(p);
    free(routes);
    fmc_batch *b = batch_alloc(p, opcode, n, 0);
    if (!b)
        return FMC_ERR_MEMORY;
    uint64_t bytes = 0;
    for (int i = 0; i < n; i++) {
        b->task_status[i] = rc;
        bytes += lens[i];
    }
    b->first_error = rc;
    b->finished = 1;
    fmc_engine *e = p->engine;
    if (rc == FMC_OK) {
        e->stat_batches_ok++;
        if (opcode == FMC_OP_WRITE)
            e->stat_written_out += bytes;
        else
            e->stat_read_in += bytes;
    } else {
        e->stat_batches_failed++;
    }
    *out = b;
    return FMC_OK;
}

static fmc_batch *batch_alloc(fmc_peer *p, int opcode, int ntasks, int nslices)
{
    size_t size = sizeof(fmc_batch) + (size_t)nslices * sizeof(fmc_slice) + (size_t)ntasks * (2 * sizeof(int32_t) + 1);
    fmc_batch *b = calloc(1, size);
    if (!b)
        return NULL;
    pthread_mutex_init(&b->mu, NULL);
    fmc_cond_init_monotonic(&b->cv);
    b->slices = (fmc_slice *)(b + 1);
    b->task_status = (int32_t *)(b->slices + nslices);
    b->task_remaining = b->task_status + ntasks;
    b->task_cancelled = (uint8_t *)(b->task_remaining + ntasks);
    b->peer = p;
    atomic_fetch_add(&p->refs, 1);
    b->opcode = opcode;
    b->ntasks = ntasks;
    b->nslices = nslices;
    return b;
}

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

/* submit's flags.  COUNTS_END: the batch may be waited for by the async facade's poller, whose
 * waits between batches end when such a batch ends (fmc_engine_wait_batch_end).  GROUP: several
 * concurrent calls gathered by the async facade, which keeps about two groups of a peer in
 * flight (engine/coalesce.py): a group takes streams in shares of at least
 * FMC_GROUP_SHARE_BYTES, so that one of up to that much stays on one stream and the group behind
 * it finds another (on 2 CPUs, 16 coroutines of 64 KiB writes in two 512 KiB groups on one
 * stream each made 17 % more calls/s than one 1 MiB group on two streams; on two streams each,
 * their thread wake-ups doubled, the same groups made fewer). */
#define SUBMIT_COUNTS_END 1
#define SUBMIT_GROUP 2
#define FMC_GROUP_SHARE_BYTES (512u << 10)

static int submit(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                  const uint64_t *lens, fmc_batch **out, int64_t inline_deadline_ms, fmc_stream **receiving,
                  int flags);

int fmc_batch_submit(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                     const uint64_t *lens, fmc_batch **out)
{
    return submit(p, opcode, n, local, remote, lens, out, -1, NULL, SUBMIT_COUNTS_END);
}

/* Bytes per slice of a task: slice_size, but at most one staging chunk where the local side is
 * GPU memory, so that each such slice is staged in one chunk (fmc_stage_pool.c). */
static uint64_t slice_bytes(const fmc_peer *p, int32_t local_dev)
{
    return local_dev >= 0 && p->slice_size > FMC_STAGE_CHUNK ? FMC_STAGE_CHUNK : p->slice_size;
}

/* inline_deadline_ms >= 0: the caller waits for the batch (fmc_transfer), so a small one may be
 * sent from its thread (FMC_INLINE_NOWAIT: as far as it goes without blocking); with `receiving` also set, a write's caller may read its own answers
 * (*receiving: the stream whose receive side it then owns, see fmc_stream_caller_receive). */
static int submit(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                  const uint64_t *lens, fmc_batch **out, int64_t inline_deadline_ms, fmc_stream **receiving,
                  int flags)
{
    *out = NULL;
    if (receiving)
        *receiving = NULL;
    if ((opcode != FMC_OP_READ && opcode != FMC_OP_WRITE) || n < 0) {
        fmc_set_error("invalid opcode %d or task count %d", opcode, n);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (!fmc_peer_is_healthy(p)) {
        fmc_set_error("connection to %s:%d is down", p->host, p->data_port);
        return FMC_ERR_SOCKET;
    }
    __atomic_store_n(&p->last_used_ms, fmc_now_ms(), __ATOMIC_RELAXED);
    uint32_t *keys = malloc(sizeof *keys * (size_t)(n ? n : 1));
    if (!keys)
        return FMC_ERR_MEMORY;
    int bad = -1;
    int rc = fmc_peer_lookup_keys(p, n, remote, lens, keys, &bad);
    if (rc != FMC_OK) {
        fmc_set_error("remote range [0x%llx, +%llu) (entry %d) is not inside one region registered by the peer (data port %s:%d)",
                      (unsigned long long)remote[bad], (unsigned long long)lens[bad], bad, p->host, p->data_port);
        free(keys);
        return rc;
    }
    uint64_t nslices = 0;
    int32_t *ldev = malloc(sizeof *ldev * (size_t)(n ? n : 1)); /* GPU of each local range, or -1 */
    if (!ldev) {
        free(keys);
        return FMC_ERR_MEMORY;
    }
    if (!fmc_local_ranges_ok(p->engine, n, local, lens, opcode == FMC_OP_READ, ldev, &bad)) {
        fmc_set_error("local range [0x%llx, +%llu) (entry %d) is not inside one registered%s region",
                      (unsigned long long)local[bad], (unsigned long long)lens[bad], bad,
                      opcode == FMC_OP_READ ? " writable" : "");
        free(keys);
        free(ldev);
        return FMC_ERR_ADDRESS_NOT_REGISTERED;
    }
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        nslices += (lens[i] + slice_bytes(p, ldev[i]) - 1) / slice_bytes(p, ldev[i]);
        total += lens[i];
    }
    if (p->sh) {
        rc = same_host(p, opcode, n, local, remote, lens, ldev, out, inline_deadline_ms == FMC_INLINE_NOWAIT ? -1 : inline_deadline_ms);
        if (rc != 1) {
            free(keys);
            free(ldev);
            return rc;
        }
    }
    if (nslices > (1u << 30)) {
        free(keys);
        free(ldev);
        fmc_set_error("batch too large (%llu slices)", (unsigned long long)nslices);
        return FMC_ERR_TOO_MANY_REQUESTS;
    }
    fmc_batch *b = batch_alloc(p, opcode, n, (int)nslices);
    if (!b) {
        free(keys);
        free(ldev);
        return FMC_ERR_MEMORY;
    }
    /* Cut tasks into slices and hand runs of about run_bytes to successive streams, so that many
     * small tasks ride one stream together and big ones spread over all of them. */
    fmc_slice_list per_stream[FMC_MAX_STREAMS];
    memset(per_stream, 0, sizeof per_stream);
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
    int stream = start_stream(p, total, nready);
    uint64_t run_bytes = stream_run_bytes(p, total, flags & SUBMIT_GROUP ? FMC_GROUP_SHARE_BYTES
                                                                          : FMC_SMALL_TRANSFER_BYTES, nready);
    uint64_t run = 0;
    uint64_t first_id = atomic_fetch_add(&p->next_id, nslices); /* one atomic per batch, not per slice */
    int k = 0;
    for (int i = 0; i < n; i++) {
        b->task_status[i] = lens[i] ? FMC_TASK_PENDING : FMC_OK;
        uint64_t ss = slice_bytes(p, ldev[i]);
        for (uint64_t off = 0; off < lens[i]; off += ss) {
            fmc_slice *s = &b->slices[k];
            s->id = first_id + (uint64_t)k++;
            s->batch = b;
            s->task = i;
            s->local = local[i] + off;
            s->remote = remote[i] + off;
            s->len = lens[i] - off < ss ? lens[i] - off : ss;
            s->key = keys[i];
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
    free(keys);
    free(ldev);
    b->outstanding = (int)nslices;
    b->finished = nslices == 0;
    b->counts_end = (flags & SUBMIT_COUNTS_END) != 0;
    *out = b;
    int used = 0;
    for (int i = 0; i < p->nstreams; i++)
        used += per_stream[i].head != NULL;
    /* The calling thread sends on idle streams itself (no sender-thread wake-up) a small transfer
     * that fits one stream, and a synchronous read's requests on every stream: they carry no
     * payload, and each wake-up spared costs tens of microseconds on a loaded small machine.
     * Other writes keep their sender threads, which push the streams' payloads in parallel. */
    int small = used == 1 && (inline_deadline_ms >= 0 || inline_deadline_ms == FMC_INLINE_NOWAIT) &&
                b->bytes <= FMC_SMALL_TRANSFER_BYTES;
    int send_here = small || (opcode == FMC_OP_READ && inline_deadline_ms >= 0 && p->proto == FMC_PROTO_NATIVE);
    int claim = small && receiving && opcode == FMC_OP_WRITE && fmc_spin_us(p->engine) > 0;
    for (int i = 0; i < p->nstreams; i++) {
        if (!per_stream[i].head)
            continue;
        fmc_slice *head = per_stream[i].head;
        int claimed = 0, rc;
        if (send_here)
            rc = fmc_stream_enqueue_inline(&p->streams[i], &per_stream[i], inline_deadline_ms, claim, &claimed);
        else
            rc = fmc_stream_enqueue(&p->streams[i], &per_stream[i]);
        if (claimed)
            *receiving = &p->streams[i];
        if (rc == FMC_ERR_SOCKET)
            fmc_slices_finish(head, FMC_ERR_SOCKET); /* never queued: the stream was already down */
        else if (rc == FMC_ERR_TIMEOUT)
            mark_error(b, FMC_ERR_TIMEOUT); /* the cut stream fails the slices; report why */
    }
    return FMC_OK;
}

int fmc_batch_poll(fmc_batch *b)
{
    pthread_mutex_lock(&b->mu);
    int rc = b->finished ? (b->first_error == FMC_OK ? 1 : b->first_error) : 0;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

int fmc_batch_task_status(fmc_batch *b, int index)
{
    if (index < 0 || index >= b->ntasks)
        return FMC_ERR_INVALID_ARGUMENT;
    pthread_mutex_lock(&b->mu);
    int rc = b->task_status[index];
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static int list_has_cancelled(fmc_slice *s, fmc_batch *b)
{
    for (; s; s = s->next)
        if (s->batch == b && fmc_slice_cancelled(s))
            return 1;
    return 0;
}

/* Cancel tasks [first, first + count) of a batch: their unsent slices are taken back, and each
 * stream carrying one of their slices on the wire is cut (fmc_stream_cut), which is the only way
 * to stop a socket reading or writing their memory.  Other calls' slices on a cut stream are
 * sent again once it has reconnected: one-sided writes and reads are idempotent.  Returns once
 * no thread touches the cancelled tasks' memory; they end with FMC_ERR_TIMEOUT. */
int fmc_batch_cancel_tasks(fmc_batch *b, int first, int count)
{
    if (first < 0 || count < 0 || first > b->ntasks || count > b->ntasks - first) {
        fmc_set_error("tasks [%d, +%d) outside a batch of %d", first, count, b->ntasks);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (!fmc_batch_mark_tasks_cancelled(b, first, count))
        return FMC_OK;
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
    pthread_mutex_lock(&b->mu);
    for (int t = first; t < first + count; t++)
        while (b->task_remaining[t] > 0)
            pthread_cond_wait(&b->cv, &b->mu);
    pthread_mutex_unlock(&b->mu);
    return FMC_OK;
}


int fmc_batch_cancel(fmc_batch *b)
{
    pthread_mutex_lock(&b->mu);
    if (b->finished) {
        pthread_mutex_unlock(&b->mu);
        return FMC_OK;
    }
    b->cancelled = 1;
    if (b->first_error == FMC_OK)
        b->first_error = FMC_ERR_TIMEOUT;
    pthread_mutex_unlock(&b->mu);
    fmc_batch_cancel_tasks(b, 0, b->ntasks);
    pthread_mutex_lock(&b->mu);
    while (!b->finished)
        pthread_cond_wait(&b->cv, &b->mu);
    pthread_mutex_unlock(&b->mu);
    return FMC_OK;
}

/* Microseconds a waiter (and a target between requests) polls before sleeping: the engine's
 * spin_us (FLAGCX_MC_SPIN_US), default 30, 0 to never poll.  On a VM a sleeping thread takes
 * tens of microseconds to wake; a small transfer's round trip ends within the poll and saves that
 * wake-up on each side, at the price of at most this much CPU per call. */
static int batch_wait(fmc_batch *b, int64_t timeout_ms, int spin)
{
    struct timespec ts;
    if (timeout_ms >= 0)
        fmc_deadline_ts(timeout_ms, &ts);
    if (spin > 0) {
        int64_t until = fmc_now_us() + spin;
        while (!__atomic_load_n(&b->finished, __ATOMIC_ACQUIRE) && fmc_now_us() < until)
            sched_yield();
    }
    pthread_mutex_lock(&b->mu);
    while (!b->finished) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&b->cv, &b->mu);
        } else if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT) {
            break;
        }
    }
    int finished = b->finished;
    int rc = b->first_error;
    pthread_mutex_unlock(&b->mu);
    if (finished)
        return rc;
    fmc_batch_cancel(b);
    fmc_set_error("transfer to %s:%d timed out after %lld ms", b->peer->host, b->peer->data_port,
                  (long long)timeout_ms);
    return FMC_ERR_TIMEOUT;
}

/* Wait up to timeout_ms for the batch to end without cancelling it when time runs out (the async
 * facade's poller keeps deadlines itself); returns fmc_batch_poll's answer. */
int fmc_batch_wait_done(fmc_batch *b, int64_t timeout_ms)
{
    struct timespec ts;
    fmc_deadline_ts(timeout_ms < 0 ? 0 : timeout_ms, &ts);
    int spin = fmc_spin_us_after(b->peer->engine, b->bytes);
    if (spin > 0) {
        int64_t until = fmc_now_us() + spin;
        while (!__atomic_load_n(&b->finished, __ATOMIC_ACQUIRE) && fmc_now_us() < until)
            sched_yield();
    }
    pthread_mutex_lock(&b->mu);
    while (!b->finished && pthread_cond_timedwait(&b->cv, &b->mu, &ts) != ETIMEDOUT)
        ;
    int rc = b->finished ? (b->first_error == FMC_OK ? 1 : b->first_error) : 0;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

int fmc_batch_wait(fmc_batch *b, int64_t timeout_ms)
{
    return batch_wait(b, timeout_ms, fmc_spin_us_after(b->peer->engine, b->bytes));
}

void fmc_batch_free(fmc_batch *b)
{
    if (!b)
        return;
    fmc_batch_cancel(b);
    fmc_peer *p = b->peer;
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
    fmc_peer_release(p);
}

/* Upper bounds of the latency buckets of fmc_call_stats, in microseconds; metrics.py's
 * LATENCY_BUCKETS (seconds) say the same, and tests/test_metrics.py checks that they do. */
static const uint64_t latency_bounds_us[FMC_LATENCY_BUCKETS - 1] = {
    50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000, 1000000,
    2500000, 5000000, 10000000, 30000000};

uint64_t fmc_latency_bucket_bound_us(int index)
{
    return index >= 0 && index < FMC_LATENCY_BUCKETS - 1 ? latency_bounds_us[index] : UINT64_MAX;
}

void fmc_peer_set_call_stats(fmc_peer *p, fmc_call_stats *stats) { p->call_stats = stats; }

/* A successful synchronous call, counted here so that the Python facades need no lock, clock or
 * dictionary on their fast path.  Relaxed atomics: readers want totals, not a consistent cut. */
static void count_call(fmc_peer *p, int opcode, int n, const uint64_t *lens, int64_t start_us)
{
    fmc_call_stats *c = p->call_stats;
    if (!c)
        return;
    uint64_t bytes = 0, us = (uint64_t)(fmc_now_us() - start_us);
    for (int i = 0; i < n; i++)
        bytes += lens[i];
    int k = 0; /* the first bucket whose bound is >= us, like bisect_left */
    while (k < FMC_LATENCY_BUCKETS - 1 && us > latency_bounds_us[k])
        k++;
    __atomic_fetch_add(&c->calls, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(opcode == FMC_OP_WRITE ? &c->bytes_written : &c->bytes_read, bytes, __ATOMIC_RELAXED);
    __atomic_fetch_add(&c->latency_us, us, __ATOMIC_RELAXED);
    __atomic_fetch_add(&c->buckets[k], 1, __ATOMIC_RELAXED);
}

/* The thread's error message for a transfer that failed with `rc` (not a timeout). */
static void set_failure_reason(const fmc_peer *p, int rc)
{
    fmc_set_error("transfer to %s:%d failed (%s)", p->host, p->data_port,
                  rc == FMC_ERR_REMOTE_REFUSED    ? "the target refused a range"
                  : rc == FMC_ERR_INVALID_ARGUMENT ? "the kernel refused to write a local buffer: its "
                                                     "protection changed after registration?"
                                                   : "connection lost");
}

int fmc_transfer(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                 const uint64_t *lens, int64_t timeout_ms)
{
    fmc_batch *b = NULL;
    fmc_stream *receiving = NULL;
    int64_t start_us = fmc_now_us();
    FMC_TR(FMC_TR_CALL, n, 0);
    int rc = submit(p, opcode, n, local, remote, lens, &b, fmc_now_ms() + (timeout_ms < 0 ? 1 << 30 : timeout_ms), &receiving, 0);
    if (rc != FMC_OK)
        return rc;
    int spin = fmc_spin_us_after(b->peer->engine, b->bytes);
    if (receiving) {
        /* Poll for the answers for the usual spin, plus the time the bytes take at 2 GB/s. */
        int64_t until = start_us + spin + (int64_t)(b->bytes >> 11);
        if (timeout_ms >= 0 && until > start_us + timeout_ms * 1000)
            until = start_us + timeout_ms * 1000;
        fmc_stream_caller_receive(receiving, b, until);
        spin = 0; /* polled already */
    }
    rc = batch_wait(b, timeout_ms, spin);
    FMC_TR(FMC_TR_CALL_END, rc, 0);
    if (rc != FMC_OK && rc != FMC_ERR_TIMEOUT)
        set_failure_reason(p, rc);
    fmc_batch_free(b);
    if (rc == FMC_OK)
        count_call(p, opcode, n, lens, start_us);
    return rc;
}

/* The three lists as _argpack.pack3 lays them out in one buffer: local[n] | remote[n] | lens[n]
 * (at least one slot each), so a Python call hands over one bytes object and no views. */
static const uint64_t *packed_lists(const char *packed, int n, size_t *slots)
{
    if (!packed || n < 0) {
        fmc_set_error("transfer: no arguments");
        return NULL;
    }
    *slots = n > 0 ? (size_t)n : 1;
    return (const uint64_t *)(const void *)packed;
}

int fmc_transfer_packed(fmc_peer *p, int opcode, int n, const char *packed, int64_t timeout_ms)
{
    size_t slots;
    const uint64_t *local = packed_lists(packed, n, &slots);
    if (!local)
        return FMC_ERR_INVALID_ARGUMENT;
    return fmc_transfer(p, opcode, n, local, local + slots, local + 2 * slots, timeout_ms);
}

/* One range: what transfer_sync_write/read pass, without building arrays in Python. */
int fmc_transfer_one(fmc_peer *p, int opcode, uint64_t local, uint64_t remote, uint64_t len, int64_t timeout_ms)
{
    return fmc_transfer(p, opcode, 1, &local, &remote, &len, timeout_ms);
}

/* For a caller that must not block (an event loop's thread): start a transfer and keep this
 * thread at most `poll_us` for its end.  poll_us < 0: queue it for the streams' sender threads
 * (with other calls in flight they pack many into one send); >= 0: a small transfer on an idle
 * stream is sent from this thread as far as the socket takes it at once, and for up to poll_us
 * a small write's answers are read here and any other small batch's end is polled for (none
 * where the engine's spin_us is 0).  On one host the copy happens here, whatever poll_us.
 * Returns the outcome when the transfer ended (*pending = NULL; a success is counted as
 * fmc_transfer counts it), else FMC_OK with the batch still in flight in *pending. */
static int start_transfer(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                          const uint64_t *lens, int64_t poll_us, fmc_batch **pending, int group)
{
    *pending = NULL;
    fmc_batch *b = NULL;
    fmc_stream *receiving = NULL;
    int64_t start_us = fmc_now_us();
    int rc = submit(p, opcode, n, local, remote, lens, &b, poll_us < 0 ? -1 : FMC_INLINE_NOWAIT,
                    poll_us > 0 ? &receiving : NULL, SUBMIT_COUNTS_END | (group ? SUBMIT_GROUP : 0));
    if (rc != FMC_OK)
        return rc;
    if (poll_us > 0) {
        /* Only small transfers, and not at all where the engine never polls (spin_us 0). */
        int64_t until = start_us + (fmc_spin_us_after(p->engine, b->bytes) > 0 ? poll_us : 0);
        if (receiving)
            fmc_stream_caller_receive(receiving, b, until); /* also hands the receive side back */
        while (!__atomic_load_n(&b->finished, __ATOMIC_ACQUIRE) && fmc_now_us() < until)
            sched_yield();
    }
    rc = fmc_batch_poll(b);
    if (rc == 0) {
        *pending = b;
        return FMC_OK;
    }
    fmc_batch_free(b);
    if (rc == 1) {
        if (!group) /* a group's calls are counted by the facade, each on its own */
            count_call(p, opcode, n, lens, start_us);
        return FMC_OK;
    }
    set_failure_reason(p, rc);
    return rc;
}

int fmc_transfer_start(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                       const uint64_t *lens, int64_t poll_us, fmc_batch **pending)
{
    return start_transfer(p, opcode, n, local, remote, lens, poll_us, pending, 0);
}

/* fmc_transfer_start of one range, as plain ints: no arrays to build in Python. */
int fmc_transfer_start_one(fmc_peer *p, int opcode, uint64_t local, uint64_t remote, uint64_t len, int64_t poll_us,
                           fmc_batch **pending)
{
    return fmc_transfer_start(p, opcode, 1, &local, &remote, &len, poll_us, pending);
}

static int start_packed(fmc_peer *p, int opcode, int n, const char *packed, int64_t poll_us, fmc_batch **pending,
                        int group)
{
    *pending = NULL;
    size_t slots;
    const uint64_t *local = packed_lists(packed, n, &slots);
    if (!local)
        return FMC_ERR_INVALID_ARGUMENT;
    return start_transfer(p, opcode, n, local, local + slots, local + 2 * slots, poll_us, pending, group);
}

/* fmc_transfer_start of pack3's one buffer (see fmc_transfer_packed). */
int fmc_transfer_start_packed(fmc_peer *p, int opcode, int n, const char *packed, int64_t poll_us,
                              fmc_batch **pending)
{
    return start_packed(p, opcode, n, packed, poll_us, pending, 0);
}

/* fmc_transfer_start_packed of several calls' ranges gathered into one batch (the async facade's
 * coalescing): a success is not counted here, since the caller counts each of its calls, and the
 * batch takes streams in larger shares (SUBMIT_GROUP). */
int fmc_transfer_start_group(fmc_peer *p, int opcode, int n, const char *packed, int64_t poll_us,
                             fmc_batch **pending)
{
    return start_packed(p, opcode, n, packed, poll_us, pending, 1);
}
