/* Batches: a vector of (local, remote, length) tasks, checked here and handed to the first of
 * the peer's transports that takes it (fmc_transport_ops: the same-host copy, TCP streams),
 * tracked per task, and waited for with a deadline.  A wait that times out cancels the batch
 * through its transport and returns only once no thread touches the batch's memory. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdlib.h>

#include "fmc_internal.h"

/* The batch a transport fills (fmc_transfer_req.new_batch): its slices, then per task its status,
 * remaining slices and cancel mark, in one allocation.  It holds a reference on the peer and
 * names the transport it was made for. */
static fmc_batch *new_batch(const fmc_transfer_req *req, int nslices)
{
    fmc_peer *p = req->peer;
    int ntasks = req->n;
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
    b->opcode = req->opcode;
    b->ntasks = ntasks;
    b->nslices = nslices;
    b->ops = req->ops;
    b->counts_end = req->counts_end;
    return b;
}

/* submit's flags.  COUNTS_END: the batch may be waited for by the async facade's poller, whose
 * waits between batches end when such a batch ends (fmc_engine_wait_batch_end).  GROUP: several
 * concurrent calls gathered by the async facade (engine/coalesce.py), which the transport may
 * spread differently (fmc_transfer_req.group). */
#define SUBMIT_COUNTS_END 1
#define SUBMIT_GROUP 2

static int submit(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                  const uint64_t *lens, fmc_batch **out, int64_t inline_deadline_ms, void **caller_rx, int flags);

int fmc_batch_submit(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                     const uint64_t *lens, fmc_batch **out)
{
    return submit(p, opcode, n, local, remote, lens, out, -1, NULL, SUBMIT_COUNTS_END);
}

static int transports_healthy(fmc_peer *p)
{
    for (int t = 0; t < p->ntransports; t++)
        if (p->transports[t]->healthy && !p->transports[t]->healthy(p))
            return 0;
    return 1;
}

/* inline_deadline_ms: see fmc_transfer_req.  caller_rx: NULL, or where the transport may leave
 * what the caller then receives on itself and hands back (fmc_transport_ops.caller_receive). */
static int submit(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                  const uint64_t *lens, fmc_batch **out, int64_t inline_deadline_ms, void **caller_rx, int flags)
{
    *out = NULL;
    if (caller_rx)
        *caller_rx = NULL;
    if ((opcode != FMC_OP_READ && opcode != FMC_OP_WRITE) || n < 0) {
        fmc_set_error("invalid opcode %d or task count %d", opcode, n);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (!transports_healthy(p)) {
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
    fmc_transfer_req req = {
        .peer = p,
        .opcode = opcode,
        .n = n,
        .local = local,
        .remote = remote,
        .lens = lens,
        .keys = keys,
        .local_dev = ldev,
        .inline_deadline_ms = inline_deadline_ms,
        .group = (flags & SUBMIT_GROUP) != 0,
        .counts_end = (flags & SUBMIT_COUNTS_END) != 0,
        .new_batch = new_batch,
    };
    /* The first transport that takes it carries it: same host, where it is on and reaches
     * every task, else TCP. */
    rc = FMC_DECLINED;
    for (int t = 0; t < p->ntransports && rc == FMC_DECLINED; t++) {
        req.ops = p->transports[t];
        rc = req.ops->submit(&req, out, caller_rx);
    }
    if (rc == FMC_OK)
        for (int i = 0; i < n && !(*out)->local_gpu; i++)
            (*out)->local_gpu = ldev[i] >= 0;
    free(keys);
    free(ldev);
    if (rc == FMC_DECLINED) {
        fmc_set_error("no transport to %s:%d takes this batch", p->host, p->data_port);
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    return rc;
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

/* Cancel tasks [first, first + count) of a batch: they are marked cancelled, and the batch's
 * transport takes back their unsent work and stops what is under way (for TCP, cutting the
 * streams that carry it: fmc_tcp_transport.c).  Returns once no thread touches the cancelled
 * tasks' memory; they end with FMC_ERR_TIMEOUT. */
int fmc_batch_cancel_tasks(fmc_batch *b, int first, int count)
{
    if (first < 0 || count < 0 || first > b->ntasks || count > b->ntasks - first) {
        fmc_set_error("tasks [%d, +%d) outside a batch of %d", first, count, b->ntasks);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (!fmc_batch_mark_tasks_cancelled(b, first, count))
        return FMC_OK;
    if (b->ops->cancel_tasks)
        b->ops->cancel_tasks(b, first, count);
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
static int batch_wait(fmc_batch *b, int64_t timeout_ms, int spin, int64_t call_timeout_ms)
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
                  (long long)call_timeout_ms);
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
    return batch_wait(b, timeout_ms, fmc_spin_us_after(b->peer->engine, b->bytes), timeout_ms);
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
    void *receiving = NULL;
    int64_t start_us = fmc_now_us();
    int64_t deadline_ms = fmc_now_ms() + (timeout_ms < 0 ? 1 << 30 : timeout_ms);
    FMC_TR(FMC_TR_CALL, n, 0);
    int rc = submit(p, opcode, n, local, remote, lens, &b, deadline_ms, &receiving, 0);
    if (rc != FMC_OK)
        return rc;
    /* A batch staged through GPU memory here takes a copy at each end besides its round trip
     * (a 4 KiB read from GPU memory on the H100 host: 37 us, past a 30 us poll, whose caller
     * then slept and took 56 us): its caller polls twice as long. */
    int spin = fmc_spin_us_after(b->peer->engine, b->bytes) * (b->local_gpu ? 2 : 1);
    if (receiving) {
        /* Poll for the answers for the usual spin, plus the time the bytes take at 2 GB/s, from
         * when the requests are out: a GPU source is staged before it leaves (on the H100 host a
         * 4 KiB write from GPU memory left 18 us into the call and was answered 25 us later, so
         * a window counted from the call's start ran out first; the answer then woke a pool
         * worker, which woke the caller, and the call took 58 us instead of 25). */
        int64_t until = fmc_now_us() + spin + (int64_t)(b->bytes >> 11);
        if (timeout_ms >= 0 && until > start_us + timeout_ms * 1000)
            until = start_us + timeout_ms * 1000;
        b->ops->caller_receive(receiving, b, until, deadline_ms);
        spin = 0; /* polled already */
    }
    /* The deadline counts from the call's start: the caller may have spent part of it sending
     * (a share of a write over several streams, sent blocking by the deadline). */
    int64_t now_ms = fmc_now_ms();
    int64_t left_ms = timeout_ms < 0 ? timeout_ms : deadline_ms > now_ms ? deadline_ms - now_ms : 0;
    rc = batch_wait(b, left_ms, spin, timeout_ms);
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
    void *receiving = NULL;
    int64_t start_us = fmc_now_us();
    int rc = submit(p, opcode, n, local, remote, lens, &b, poll_us < 0 ? -1 : FMC_INLINE_NOWAIT,
                    poll_us > 0 ? &receiving : NULL, SUBMIT_COUNTS_END | (group ? SUBMIT_GROUP : 0));
    if (rc != FMC_OK)
        return rc;
    if (poll_us > 0) {
        /* Only small transfers, and not at all where the engine never polls (spin_us 0). */
        int64_t until = start_us + (fmc_spin_us_after(p->engine, b->bytes) > 0 ? poll_us : 0);
        if (receiving)
            b->ops->caller_receive(receiving, b, until, -1); /* also hands the receive side back */
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
