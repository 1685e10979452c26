/* A pool of threads around one epoll set (fmc_worker_pool.c): the shape both sides of TCP
 * use, so that threads follow the sockets with work at the moment, not the sockets that exist.
 * The target side serves inbound connections with one (fmc_server.c); the initiator side
 * runs its streams' send and receive sides on another (fmc_stream.c). */
#ifndef FMC_WORKER_POOL_H
#define FMC_WORKER_POOL_H

#include <pthread.h>
#include <stdint.h>

/* Something a worker runs once its time comes (a zero-copy acknowledgement owed by an idle
 * stream); queued at most once.  A worker may hold an event or a timer of an owner that is
 * going away: owners give the pool memory that outlives them (fmc_stream.c's handles). */
typedef struct fmc_pool_timer {
    int64_t due_ms;
    void (*fire)(struct fmc_pool_timer *t);
    struct fmc_pool_timer *next;
    int queued;
} fmc_pool_timer;

/* A worker lingering with its owner (fmc_pool_linger_begin), which the pool can call back when
 * every other worker is busy or lingering, the cap allows no more, and events wait in the set.
 * Two forms: a worker waiting on its owner's condition variable (mu and cv set; the owner's
 * wait loop ends on `recalled`, read under mu) or one waiting in poll (mu and cv NULL; it polls
 * in slices of a millisecond and looks at `recalled` between them). */
typedef struct fmc_pool_lingerer {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int recalled; /* the pool wants the worker back in its set */
    int released; /* the recall is done with this record (atomic, or under mu in the cv form) */
    int slot;
} fmc_pool_lingerer;

typedef struct fmc_worker_pool {
    const char *name;
    /* Runs in a worker for each event of a watched fd (EPOLLONESHOT: re-watch to hear more). */
    void (*dispatch)(void *ptr, uint32_t events);
    pthread_mutex_t mu;
    int epfd;                /* -1 until started */
    int wake_fd;             /* eventfd: a timer was queued while every worker slept without one */
    int workers;             /* alive (atomic; changed under mu) */
    int waiting;             /* in epoll_wait (atomic) */
    int blocked;             /* inside fmc_pool_blocking_begin/end, not counted against the cap (atomic) */
    int lingering;           /* between fmc_pool_linger_begin and _end (atomic) */
    int linger_max;          /* at most this many linger (see fmc_pool_start) */
    fmc_pool_lingerer **lingerers; /* linger_max slots: who lingers now, for a recall (atomic) */
    uint64_t recalls;        /* lingering workers called back to the set so far (atomic) */
    int core;                /* kept however idle */
    int cap;                 /* workers not blocked, at most (0: from the CPUs) */
    int cap_few;             /* the cap while at most FMC_POOL_FEW_OWNERS owners use the set, if larger */
    int owners;              /* fds its user keeps in the set (atomic; counted by that user) */
    int cap_fixed;           /* the cap was set (fmc_pool_set_cap): cap_few does not apply */
    int linger_cpus;         /* CPUs - 1: how many may linger, at least (see linger_limit) */
    int core_wanted;         /* 0: as many as CPUs */
    int timekeeper;          /* a waiting worker sleeps until the first timer is due */
    fmc_pool_timer *timers;  /* sorted by due_ms (changed under mu; workers look without it first) */
} fmc_worker_pool;

#define FMC_WORKER_POOL_INIT(pool_name, fn, core_n, few_cap)                                                     \
    {.name = pool_name, .dispatch = fn, .mu = PTHREAD_MUTEX_INITIALIZER,                                         \
     .epfd = -1, .wake_fd = -1, .core_wanted = core_n, .cap_few = few_cap}
/* Owners (one socket each) a pool counts as few: the streams of one peer.  While its user has no
 * more in the set, a pool with cap_few may hold that many workers even where twice the CPUs is
 * fewer: both sides of each of one peer's streams then have a worker of their own, as a thread
 * per side would.  Past it the cap is the CPUs' again, the bound that the threads of a process
 * talking to many peers are held to. */
#define FMC_POOL_FEW_OWNERS 4

/* The cap by default: twice the CPUs this process may use, at least 4. */
int fmc_pool_default_cap(void);
int fmc_pool_set_cap(fmc_worker_pool *pool, int n);
/* The pool's user has d more (or fewer) fds in the set (see cap_few). */
void fmc_pool_owners_add(fmc_worker_pool *pool, int d);
/* Make the set and the core workers (once; later calls return at once). */
int fmc_pool_start(fmc_worker_pool *pool);
/* Watch fd for `events` once (EPOLLONESHOT is added): op is EPOLL_CTL_ADD or EPOLL_CTL_MOD. */
int fmc_pool_watch(fmc_worker_pool *pool, int fd, void *owner, uint32_t events, int op);
/* Around a wait that may last (a payload that stalls, a GPU copy, a connect): the worker does not
 * count against the cap meanwhile, and one more is started if nobody is left watching the set,
 * so a stalled peer never starves the others.  No-ops outside the pool's workers. */
void fmc_pool_blocking_begin(void);
void fmc_pool_blocking_end(void);
/* A worker's stall hook (fmc_stall_hook_set): a blocking socket call that waits out its socket's
 * timeout with no byte moved is such a wait, until the call ends.  Bytes that keep moving keep
 * the worker counted, so the cap bounds the threads of busy connections. */
void fmc_pool_stall(int begins);
/* A worker whose owner just ran dry may wait for that owner's next work alone, outside the set,
 * when the pool can spare it: some other worker still watches the set, and fewer than
 * linger_max workers linger.  Its owner's next work then wakes this worker directly, as a thread
 * of its own would be woken.  Through the set it would cost more: epoll wakes a waiter for every
 * segment that arrives before a worker takes the event, and the next waiter after each worker
 * takes one, so many waiters on one set turn a burst over several streams into a chain of
 * wake-ups.  Lingering workers count against the cap; when the last worker watching the set
 * takes an event, the pool is at its cap and more events are ready, one lingering worker is
 * called back (l->recalled) to watch the set.  begin returns 1 if the worker may linger (then it
 * must call end, which waits out a recall under way), 0 at once outside the pool's workers.
 * In the cv form both are called with l->mu held. */
int fmc_pool_linger_begin(fmc_pool_lingerer *l);
void fmc_pool_linger_end(fmc_pool_lingerer *l);
/* Linger on one fd: 1 if it turned readable within `ms` (the caller serves it again at once), 0 if
 * the owner goes back to the set (the time ran out, or the pool called the worker back). */
int fmc_pool_linger(int fd, int ms);
/* Queue a timer (a no-op if queued already) / take it out. */
void fmc_pool_timer_add(fmc_worker_pool *pool, fmc_pool_timer *t, int64_t due_ms);
void fmc_pool_timer_cancel(fmc_worker_pool *pool, fmc_pool_timer *t);
void fmc_pool_counts(fmc_worker_pool *pool, int *workers, int *cap, uint64_t *recalls);

#endif
