/* The engine's pool of staging chunks for GPU memory over TCP (fmc_internal.h says who takes
 * which class and why holders never wait for one another).  Chunks are made on first need, up to
 * the class's share of fmc_options.gpu_staging, and kept until the engine goes: pinning memory
 * costs far more than a transfer's copies, so it is paid once.  Chunks are portable pinned
 * memory, so one made under one device's context serves copies of any device. */
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "fmc_internal.h"

#define STAGE_MIN_CHUNKS 2      /* per class: a pipeline of two still overlaps */
#define STAGE_WAIT_SLICE_MS 50  /* a waiter looks at its stop flag this often */

void fmc_stage_pool_init(fmc_stage_pool *p, uint64_t bytes)
{
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    uint64_t per = bytes / 2 / FMC_STAGE_CHUNK;
    for (int c = 0; c < 2; c++) {
        p->free_list[c] = NULL;
        p->made[c] = p->waiters[c] = 0;
        p->limit[c] = per < STAGE_MIN_CHUNKS ? STAGE_MIN_CHUNKS : per > (1u << 20) ? (1 << 20) : (int)per;
    }
}

void fmc_stage_pool_free(fmc_stage_pool *p)
{
    for (int c = 0; c < 2; c++) {
        for (fmc_chunk *k = p->free_list[c], *next; k; k = next) {
            next = k->next;
            fmc_staging_free(k->buf, k->pinned, k->dev);
            free(k);
        }
        p->free_list[c] = NULL;
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
}

static fmc_chunk *make_chunk(int cls, int device)
{
    fmc_chunk *k = calloc(1, sizeof *k);
    if (!k)
        return NULL;
    k->buf = fmc_staging_alloc(FMC_STAGE_CHUNK, device, &k->pinned);
    if (!k->buf) {
        free(k);
        return NULL;
    }
    k->dev = device;
    k->cls = cls;
    return k;
}

/* fmc_stage_get; *blocking set once the caller waits outside its pool's cap. */
static fmc_chunk *stage_get(fmc_stage_pool *p, int cls, int device, int64_t deadline_ms, const int *stop,
                            int *blocking)
{
    pthread_mutex_lock(&p->mu);
    for (;;) {
        fmc_chunk *k = p->free_list[cls];
        if (k) {
            p->free_list[cls] = k->next;
            k->next = NULL;
            pthread_mutex_unlock(&p->mu);
            return k;
        }
        if (p->made[cls] < p->limit[cls]) {
            p->made[cls]++; /* counted before the (slow) allocation, made outside the lock */
            pthread_mutex_unlock(&p->mu);
            k = make_chunk(cls, device);
            if (!k) {
                pthread_mutex_lock(&p->mu);
                p->made[cls]--;
                pthread_cond_broadcast(&p->cv);
                pthread_mutex_unlock(&p->mu);
            }
            return k;
        }
        int64_t now = fmc_now_ms();
        if (deadline_ms == 0 || (deadline_ms > 0 && now >= deadline_ms) || (stop && __atomic_load_n(stop, __ATOMIC_RELAXED)))
            break;
        if (!*blocking) { /* outside p->mu: it may start a thread */
            pthread_mutex_unlock(&p->mu);
            fmc_pool_blocking_begin();
            *blocking = 1;
            pthread_mutex_lock(&p->mu);
            continue; /* a chunk may have come back meanwhile */
        }
        int64_t wait = deadline_ms < 0 || deadline_ms - now > STAGE_WAIT_SLICE_MS ? STAGE_WAIT_SLICE_MS
                                                                                 : deadline_ms - now;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)(wait % 1000) * 1000000L;
        ts.tv_sec += (time_t)(wait / 1000) + ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        p->waiters[cls]++;
        pthread_cond_timedwait(&p->cv, &p->mu, &ts);
        p->waiters[cls]--;
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* A wait here is for chunks that other connections hold, maybe while their peers stall: a pool
 * worker waits outside its pool's cap (fmc_pool_blocking_begin; a no-op on other threads). */
fmc_chunk *fmc_stage_get(fmc_stage_pool *p, int cls, int device, int64_t deadline_ms, const int *stop)
{
    int blocking = 0;
    fmc_chunk *k = stage_get(p, cls, device, deadline_ms, stop, &blocking);
    if (blocking)
        fmc_pool_blocking_end();
    return k;
}

void fmc_stage_put(fmc_stage_pool *p, fmc_chunk *k)
{
    if (!k)
        return;
    pthread_mutex_lock(&p->mu);
    k->next = p->free_list[k->cls];
    p->free_list[k->cls] = k;
    int wake = p->waiters[k->cls] > 0;
    pthread_mutex_unlock(&p->mu);
    if (wake)
        pthread_cond_broadcast(&p->cv);
}

int fmc_stage_copy(const fmc_engine *e, const fmc_chunk *chunk, fmc_fence *fence, uint64_t *dst, uint64_t *src,
                   size_t *len, int n, int device, int into_gpu)
{
    int mode = chunk->pinned ? e->opts.gpu_copy : FMC_GPU_COPY_BATCH;
    int rc = fmc_cuda_gather_async(dst, src, len, n, device, mode, into_gpu);
    return rc != FMC_OK ? rc : fmc_cuda_fence_record(fence, device);
}
