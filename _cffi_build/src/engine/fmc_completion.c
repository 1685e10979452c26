/* How slices end: the one narrow call by which transports report completions (fmc_slices_finish,
 * and fmc_batch_report_error for a reason known before the slices fail) and read cancellation
 * (fmc_slice_cancelled), and what a batch's end wakes.  Transports depend on this file, never on
 * fmc_batch.c, which drives them through their fmc_transport_ops. */
#define _GNU_SOURCE
#include <errno.h>

#include "fmc_internal.h"

/* Record one slice's outcome; caller holds b->mu.  Returns 1 when it was the batch's last. */
static int finish_locked(fmc_batch *b, int t, int status)
{
    if (status != FMC_OK && b->task_status[t] >= 0)
        b->task_status[t] = status;
    if (--b->task_remaining[t] == 0 && b->task_status[t] == FMC_TASK_PENDING)
        b->task_status[t] = FMC_OK;
    if (status != FMC_OK && b->first_error == FMC_OK)
        b->first_error = status;
    if (b->task_remaining[t] == 0 && b->task_cancelled[t])
        pthread_cond_broadcast(&b->cv); /* fmc_batch_cancel_tasks waits for the tasks it cancels */
    if (--b->outstanding != 0)
        return 0;
    fmc_engine *e = b->peer->engine;
    __atomic_store_n(&b->finished, 1, __ATOMIC_RELEASE);
    if (b->first_error == FMC_OK) {
        e->stat_batches_ok++;
        if (b->opcode == FMC_OP_WRITE)
            e->stat_written_out += b->bytes;
        else
            e->stat_read_in += b->bytes;
    } else {
        e->stat_batches_failed++;
    }
    pthread_cond_broadcast(&b->cv);
    if (!b->counts_end)
        return 1;
    /* seq_cst against the waiter's count and read (fmc_engine_wait_batch_end): either it sees
     * the new count, or this sees it waiting and wakes it. */
    __atomic_add_fetch(&e->batches_ended, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&e->end_waiters, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&e->done_mu); /* a leaf lock: nothing is taken under it */
        pthread_cond_broadcast(&e->done_cv);
        pthread_mutex_unlock(&e->done_mu);
    }
    return 1;
}

uint64_t fmc_engine_batches_ended(fmc_engine *e)
{
    return __atomic_load_n(&e->batches_ended, __ATOMIC_SEQ_CST);
}

/* Wait until one of the engine's batches ends after `seen` (an fmc_engine_batches_ended count),
 * whichever it is, or fmc_engine_wake_end_waiters is called, at most timeout_ms: 1 if so, 0 if
 * the time ran out.  The async facade's poller waits here between its batches, so that the
 * event loop hands it a new batch without waking it: the batch's end does. */
int fmc_engine_wait_batch_end(fmc_engine *e, uint64_t seen, int64_t timeout_ms)
{
    struct timespec ts;
    fmc_deadline_ts(timeout_ms < 0 ? 0 : timeout_ms, &ts);
    pthread_mutex_lock(&e->done_mu);
    int wakes = e->end_wakes;
    __atomic_add_fetch(&e->end_waiters, 1, __ATOMIC_SEQ_CST);
    int ended, timed_out = 0; /* looked at once more after a timeout */
    while (!(ended = __atomic_load_n(&e->batches_ended, __ATOMIC_SEQ_CST) != seen || e->end_wakes != wakes) &&
           !timed_out)
        timed_out = pthread_cond_timedwait(&e->done_cv, &e->done_mu, &ts) == ETIMEDOUT;
    __atomic_sub_fetch(&e->end_waiters, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&e->done_mu);
    return ended;
}

void fmc_engine_wake_end_waiters(fmc_engine *e)
{
    pthread_mutex_lock(&e->done_mu);
    e->end_wakes++;
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->done_mu);
}

/* Finish a list of slices, each with its answer_status (or `status` for all when it is not
 * FMC_TASK_PENDING), taking each batch's lock once per run of its slices: four stream receivers
 * finishing the slices of one batch one lock at a time made them queue on it.  A slice lives in
 * its batch's memory, which its waiter may free once the last one is finished, so `next` is read
 * before a slice is finished and nothing of a batch is touched after its lock is released. */
void fmc_slices_finish(fmc_slice *s, int status)
{
    if (s)
        FMC_TR(FMC_TR_FINISH, s->batch->ntasks, 0);
    while (s) {
        fmc_batch *b = s->batch;
        pthread_mutex_lock(&b->mu);
        while (s && s->batch == b) {
            fmc_slice *next = s->next;
            finish_locked(b, s->task, status != FMC_TASK_PENDING ? status : s->answer_status);
            s = next;
        }
        pthread_mutex_unlock(&b->mu);
    }
}

/* A slice of a task that was cancelled (read under its stream's lock; set under the batch's). */
int fmc_slice_cancelled(const fmc_slice *s)
{
    return __atomic_load_n(&s->batch->task_cancelled[s->task], __ATOMIC_ACQUIRE);
}

/* Mark the unfinished tasks of [first, first + count) cancelled; 1 if there was any. */
int fmc_batch_mark_tasks_cancelled(fmc_batch *b, int first, int count)
{
    int any = 0;
    pthread_mutex_lock(&b->mu);
    for (int t = first; t < first + count; t++) {
        if (b->task_remaining[t] > 0) {
            __atomic_store_n(&b->task_cancelled[t], 1, __ATOMIC_RELEASE);
            any = 1;
        }
    }
    pthread_mutex_unlock(&b->mu);
    return any;
}

void fmc_batch_mark_cancelled(fmc_batch *b) { fmc_batch_mark_tasks_cancelled(b, 0, b->ntasks); }

void fmc_batch_report_error(fmc_batch *b, int status)
{
    pthread_mutex_lock(&b->mu);
    if (b->first_error == FMC_OK)
        b->first_error = status;
    pthread_mutex_unlock(&b->mu);
}
