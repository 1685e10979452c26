/* Threads around one epoll set (see fmc_worker_pool.h).
 *
 * Every fd is watched EPOLLONESHOT, so one worker at a time runs its owner; the owner watches
 * it again when it wants to hear more.  Workers keep the blocking style of the data path where
 * a wait is short (a payload that is arriving is received by the worker that read its header),
 * so the pool grows while all its workers are busy: a worker that takes an event while no other
 * waits starts one more, up to the cap, and workers beyond the core count end after
 * FMC_POOL_IDLE_MS without work.  A worker about to wait for long (fmc_pool_blocking_begin)
 * stops counting against the cap, so a stalled peer costs one thread, never the others' turn.
 * A worker lingering with its owner (fmc_pool_linger_begin) does count, and is called back to
 * the set when the set has events nobody is left to take. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_worker_pool.h"

#define FMC_POOL_IDLE_MS 2000
#define FMC_POOL_STACK (512u << 10)
#define LINGER_SLICE_MS 1 /* a worker lingering on a socket sees a recall within this */

static __thread fmc_worker_pool *my_pool; /* the pool this thread works for, if any */

int fmc_pool_default_cap(void)
{
    int cpus = fmc_usable_cpus();
    return cpus * 2 > 4 ? cpus * 2 : 4;
}

int fmc_pool_set_cap(fmc_worker_pool *pool, int n)
{
    if (n < 0 || n > 4096) {
        fmc_set_error("%s threads %d outside 0..4096", pool->name, n);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&pool->mu);
    pool->cap = n;
    pool->cap_fixed = n > 0;
    pthread_mutex_unlock(&pool->mu);
    return FMC_OK;
}

static void *worker_main(void *arg);

/* Wake one worker through wake_fd (it then looks at the timers): one waiting now, or the next
 * to wait, since the eventfd stays readable until a worker takes it. */
static void wake_one_locked(fmc_worker_pool *pool)
{
    uint64_t one = 1;
    if (pool->wake_fd >= 0 && write(pool->wake_fd, &one, sizeof one) < 0) {
        /* EAGAIN: a wake-up is pending anyway */
    }
}

/* The counts workers change without the lock (it stays off the path of every event: many
 * workers woken at once would queue on it, each waking the next, tens of microseconds in all). */
static int load(const int *v) { return __atomic_load_n(v, __ATOMIC_ACQUIRE); }
static void add(int *v, int d) { __atomic_add_fetch(v, d, __ATOMIC_ACQ_REL); }

void fmc_pool_owners_add(fmc_worker_pool *pool, int d) { add(&pool->owners, d); }

/* The cap while few owners use the set: cap_few where it applies (not set by hand, and larger). */
static int cap_when_few(const fmc_worker_pool *pool)
{
    return !pool->cap_fixed && pool->cap_few > pool->cap ? pool->cap_few : pool->cap;
}

/* The cap now (the pool started). */
static int cap_now(const fmc_worker_pool *pool)
{
    return load(&pool->owners) <= FMC_POOL_FEW_OWNERS ? cap_when_few(pool) : pool->cap;
}

/* How many may linger under `cap`: one fewer than the CPUs, and at least 7 where the cap allows
 * (both sides of one peer's four streams, the fewest a peer gets, then linger between its calls
 * while one worker watches the set, as threads of their own per stream would wait, also on
 * small hosts). */
static int lingerers_under(const fmc_worker_pool *pool, int cap)
{
    return pool->linger_cpus >= 7 ? pool->linger_cpus : cap - 1 < 7 ? cap - 1 : 7;
}

/* How many may linger now: at most linger_max, the slots made at start. */
static int linger_limit(const fmc_worker_pool *pool)
{
    int n = lingerers_under(pool, cap_now(pool));
    return n < pool->linger_max ? n : pool->linger_max;
}

/* Start one worker; caller holds pool->mu.  0 if the thread could not be made. */
static int spawn_locked(fmc_worker_pool *pool)
{
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, FMC_POOL_STACK);
    pthread_t t;
    int ok = pthread_create(&t, &attr, worker_main, pool) == 0;
    pthread_attr_destroy(&attr);
    if (ok)
        add(&pool->workers, 1);
    return ok;
}

/* Threads a pool may hold beyond its cap for workers inside fmc_pool_blocking_begin/end: so many
 * peers stalled at once are each waited on while the others keep their turn; past them new work
 * waits for a thread.  (The 64-peer budget of 2 x CPUs + 8 threads counts on it.) */
#define FMC_POOL_BLOCKED_SPARE 8

/* Nobody is left watching the set and the cap allows one more: start it.  Returns 1 where
 * nobody watches and the cap allows no more (caller holds mu). */
static int grow_if_starved_locked(fmc_worker_pool *pool)
{
    if (load(&pool->waiting) != 0)
        return 0;
    int cap = cap_now(pool), workers = load(&pool->workers);
    if (workers - load(&pool->blocked) >= cap || workers >= cap + FMC_POOL_BLOCKED_SPARE)
        return 1;
    spawn_locked(pool);
    return 0;
}

/* The same, taking the lock only when nobody is left waiting. */
static int grow_if_starved(fmc_worker_pool *pool)
{
    if (load(&pool->waiting) != 0)
        return 0;
    pthread_mutex_lock(&pool->mu);
    int at_cap = grow_if_starved_locked(pool);
    pthread_mutex_unlock(&pool->mu);
    return at_cap;
}

/* Call one lingering worker back to the set (see fmc_pool_linger_begin).  The record is taken
 * out of its slot first, so that its worker's linger_end knows to wait for the recall to finish
 * with it; after `released` is set the record is not touched again. */
static void recall_one(fmc_worker_pool *pool)
{
    for (int i = 0; i < pool->linger_max; i++) {
        fmc_pool_lingerer *l = __atomic_load_n(&pool->lingerers[i], __ATOMIC_ACQUIRE);
        if (!l || !__atomic_compare_exchange_n(&pool->lingerers[i], &l, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        __atomic_add_fetch(&pool->recalls, 1, __ATOMIC_RELAXED);
        if (l->cv) {
            pthread_mutex_lock(l->mu);
            l->recalled = 1;
            l->released = 1;
            pthread_cond_broadcast(l->cv);
            pthread_mutex_unlock(l->mu);
        } else { /* it polls in short slices and looks at `recalled` between them */
            __atomic_store_n(&l->recalled, 1, __ATOMIC_RELEASE);
            __atomic_store_n(&l->released, 1, __ATOMIC_RELEASE);
        }
        return;
    }
}

/* A worker just took an event: if it was the last watching the set and the pool can grow no more
 * while some of its workers linger, one of those watches the set again as soon as events are
 * ready there (the set is asked without waiting: a recall with nothing to take would only move
 * a worker away from its owner). */
static void keep_set_watched(fmc_worker_pool *pool)
{
    if (grow_if_starved(pool) && load(&pool->lingering) > 0) {
        struct pollfd pf = {.fd = pool->epfd, .events = POLLIN};
        if (poll(&pf, 1, 0) == 1)
            recall_one(pool);
    }
}

/* Timers due by now leave the list (caller holds mu); returns them linked, and sets *wait_ms to
 * how long until the next one (-1: none). */
static fmc_pool_timer *take_due_locked(fmc_worker_pool *pool, int *wait_ms)
{
    int64_t now = fmc_now_ms();
    fmc_pool_timer *due = NULL, **tail = &due;
    while (pool->timers && pool->timers->due_ms <= now) {
        fmc_pool_timer *t = pool->timers;
        pool->timers = t->next;
        t->queued = 0;
        t->next = NULL;
        *tail = t;
        tail = &t->next;
    }
    *wait_ms = pool->timers ? (int)(pool->timers->due_ms - now) : -1;
    return due;
}

static void fire_timers(fmc_pool_timer *t)
{
    while (t) {
        fmc_pool_timer *next = t->next;
        t->fire(t);
        t = next;
    }
}

/* A worker beyond the core count, back from its work while the pool holds more than its cap
 * (its user's owners grew past few, see cap_few): it leaves (1) instead of waiting in the set,
 * before it could take on keeping time for the timers.  A worker woken through wake_fd to keep
 * time passes that wake-up on as it leaves, else the timers would wait for the next event. */
static int beyond_cap(const fmc_worker_pool *pool)
{
    return load(&pool->workers) > pool->core && load(&pool->workers) - load(&pool->blocked) > cap_now(pool);
}

static int over_cap(fmc_worker_pool *pool)
{
    if (!beyond_cap(pool))
        return 0;
    pthread_mutex_lock(&pool->mu);
    int leave = beyond_cap(pool); /* again under mu: another may have left meanwhile */
    if (leave) {
        add(&pool->workers, -1);
        if (pool->timers && !pool->timekeeper)
            wake_one_locked(pool);
    }
    pthread_mutex_unlock(&pool->mu);
    return leave;
}

static void *worker_main(void *arg)
{
    fmc_worker_pool *pool = arg;
    my_pool = pool;
    /* splice() has no MSG_NOSIGNAL: a peer gone mid-send must not raise SIGPIPE in the host
     * process (EPIPE is enough); workers keep it blocked. */
    sigset_t pipe_signal;
    sigemptyset(&pipe_signal);
    sigaddset(&pipe_signal, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_signal, NULL);
    for (;;) {
        if (over_cap(pool))
            return NULL;
        int timer_ms = -1, keeper = 0;
        if (__atomic_load_n(&pool->timers, __ATOMIC_ACQUIRE)) { /* timers: under the lock */
            pthread_mutex_lock(&pool->mu);
            fmc_pool_timer *due = take_due_locked(pool, &timer_ms);
            if (due) {
                pthread_mutex_unlock(&pool->mu);
                fire_timers(due);
                continue;
            }
            keeper = timer_ms >= 0 && !pool->timekeeper;
            pool->timekeeper |= keeper;
            pthread_mutex_unlock(&pool->mu);
        }
        int extra = load(&pool->workers) > pool->core;
        int wait = keeper ? timer_ms : extra ? FMC_POOL_IDLE_MS : -1;
        add(&pool->waiting, 1);
        struct epoll_event ev;
        int n = epoll_wait(pool->epfd, &ev, 1, wait);
        add(&pool->waiting, -1);
        if (keeper) {
            pthread_mutex_lock(&pool->mu);
            pool->timekeeper = 0;
            if (n == 1 && pool->timers)
                wake_one_locked(pool); /* another worker keeps time while this one works */
            pthread_mutex_unlock(&pool->mu);
        }
        if (n == 1 && ev.data.ptr == NULL) { /* wake_fd: a timer to keep */
            uint64_t count;
            if (read(pool->wake_fd, &count, sizeof count) < 0) {
                /* EAGAIN: another worker took it */
            }
            struct epoll_event again = {.events = EPOLLIN | EPOLLONESHOT, .data.ptr = NULL};
            epoll_ctl(pool->epfd, EPOLL_CTL_MOD, pool->wake_fd, &again);
            continue;
        }
        if (n == 0 && !keeper) {
            pthread_mutex_lock(&pool->mu);
            if (pool->workers > pool->core) {
                add(&pool->workers, -1);
                pthread_mutex_unlock(&pool->mu);
                return NULL;
            }
            pthread_mutex_unlock(&pool->mu);
            continue;
        }
        if (n == 1) {
            keep_set_watched(pool); /* someone to take the next event */
            FMC_TR(FMC_TR_WAKE, ev.events, pool->name[0] == 's');
            pool->dispatch(ev.data.ptr, ev.events);
        }
    }
}

int fmc_pool_start(fmc_worker_pool *pool)
{
    pthread_mutex_lock(&pool->mu);
    int rc = FMC_OK;
    if (pool->epfd >= 0)
        goto out;
    if (pool->cap <= 0)
        pool->cap = fmc_pool_default_cap();
    pool->core = pool->core_wanted > 0 ? pool->core_wanted : fmc_usable_cpus();
    if (pool->core > pool->cap)
        pool->core = pool->cap;
    /* Slots for as many as may linger at the larger cap. */
    pool->linger_cpus = fmc_usable_cpus() - 1;
    pool->linger_max = lingerers_under(pool, cap_when_few(pool));
    if (pool->linger_max > 0) {
        pool->lingerers = calloc((size_t)pool->linger_max, sizeof *pool->lingerers);
        if (!pool->lingerers)
            pool->linger_max = 0;
    }
    int epfd = epoll_create1(EPOLL_CLOEXEC);
    int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLONESHOT, .data.ptr = NULL};
    if (epfd < 0 || wake < 0 || epoll_ctl(epfd, EPOLL_CTL_ADD, wake, &ev) != 0) {
        fmc_set_error("%s pool: %s", pool->name, strerror(errno));
        if (epfd >= 0)
            close(epfd);
        if (wake >= 0)
            close(wake);
        rc = FMC_ERR_SOCKET;
        goto out;
    }
    pool->epfd = epfd;
    pool->wake_fd = wake;
    while (load(&pool->workers) < pool->core && spawn_locked(pool))
        ;
    rc = load(&pool->workers) > 0 ? FMC_OK : FMC_ERR_MEMORY;
out:
    pthread_mutex_unlock(&pool->mu);
    return rc;
}

int fmc_pool_watch(fmc_worker_pool *pool, int fd, void *owner, uint32_t events, int op)
{
    struct epoll_event ev = {.events = events | EPOLLONESHOT, .data.ptr = owner};
    if (epoll_ctl(pool->epfd, op, fd, &ev) == 0)
        return FMC_OK;
    fmc_set_error("epoll_ctl: %s", strerror(errno));
    return FMC_ERR_SOCKET;
}

void fmc_pool_blocking_begin(void)
{
    fmc_worker_pool *pool = my_pool;
    if (!pool)
        return;
    add(&pool->blocked, 1);
    grow_if_starved(pool);
}

void fmc_pool_blocking_end(void)
{
    fmc_worker_pool *pool = my_pool;
    if (pool)
        add(&pool->blocked, -1);
}

void fmc_pool_stall(int begins)
{
    if (begins)
        fmc_pool_blocking_begin();
    else
        fmc_pool_blocking_end();
}

int fmc_pool_linger_begin(fmc_pool_lingerer *l)
{
    fmc_worker_pool *pool = my_pool;
    if (!pool)
        return 0;
    if (__atomic_add_fetch(&pool->lingering, 1, __ATOMIC_ACQ_REL) > linger_limit(pool) || load(&pool->waiting) == 0)
        goto refuse;
    l->recalled = l->released = 0;
    /* At most linger_max workers get this far at once, and a recall empties the slot it takes,
     * so a free slot is there. */
    for (int i = 0;; i = (i + 1) % pool->linger_max) {
        fmc_pool_lingerer *none = NULL;
        if (__atomic_compare_exchange_n(&pool->lingerers[i], &none, l, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            l->slot = i;
            return 1;
        }
    }
refuse:
    add(&pool->lingering, -1);
    return 0;
}

void fmc_pool_linger_end(fmc_pool_lingerer *l)
{
    fmc_worker_pool *pool = my_pool;
    fmc_pool_lingerer *me = l;
    if (!__atomic_compare_exchange_n(&pool->lingerers[l->slot], &me, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        /* A recall took the record: wait until it is done with it. */
        if (l->cv) {
            while (!l->released)
                pthread_cond_wait(l->cv, l->mu);
        } else {
            while (!__atomic_load_n(&l->released, __ATOMIC_ACQUIRE))
                sched_yield();
        }
    }
    add(&pool->lingering, -1);
}

int fmc_pool_linger(int fd, int ms)
{
    fmc_pool_lingerer l = {0};
    if (ms <= 0 || !fmc_pool_linger_begin(&l))
        return 0;
    /* Slices of LINGER_SLICE_MS, so that a recall is seen within one without an fd to wake the
     * poll (a helper fd per worker would make a process's fds move with its thread count). */
    struct pollfd pf = {.fd = fd, .events = POLLIN | POLLRDHUP};
    int64_t until = fmc_now_ms() + ms;
    int n = 0, left = ms;
    while (!__atomic_load_n(&l.recalled, __ATOMIC_ACQUIRE) && left > 0 &&
           (n = poll(&pf, 1, left < LINGER_SLICE_MS ? left : LINGER_SLICE_MS)) == 0)
        left = (int)(until - fmc_now_ms());
    fmc_pool_linger_end(&l);
    return n > 0 && !l.recalled;
}

void fmc_pool_timer_add(fmc_worker_pool *pool, fmc_pool_timer *t, int64_t due_ms)
{
    pthread_mutex_lock(&pool->mu);
    if (!t->queued) {
        t->due_ms = due_ms;
        t->queued = 1;
        fmc_pool_timer **pp = &pool->timers;
        while (*pp && (*pp)->due_ms <= due_ms)
            pp = &(*pp)->next;
        t->next = *pp;
        *pp = t;
        /* Workers asleep with no timeout would miss it: wake one to keep time (a worker that is
         * busy now looks at the list before it sleeps). */
        if (!pool->timekeeper)
            wake_one_locked(pool);
    }
    pthread_mutex_unlock(&pool->mu);
}

void fmc_pool_timer_cancel(fmc_worker_pool *pool, fmc_pool_timer *t)
{
    pthread_mutex_lock(&pool->mu);
    if (t->queued) {
        fmc_pool_timer **pp = &pool->timers;
        while (*pp && *pp != t)
            pp = &(*pp)->next;
        if (*pp)
            *pp = t->next;
        t->queued = 0;
    }
    pthread_mutex_unlock(&pool->mu);
}

void fmc_pool_counts(fmc_worker_pool *pool, int *workers, int *cap, uint64_t *recalls)
{
    *recalls = __atomic_load_n(&pool->recalls, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool->mu);
    *workers = load(&pool->workers);
    *cap = pool->epfd >= 0 ? cap_now(pool) : pool->cap > 0 ? pool->cap : fmc_pool_default_cap();
    pthread_mutex_unlock(&pool->mu);
}
