/* The target side's threads: one pool per process, shared by every engine's inbound data
 * connections, instead of one thread per connection.
 *
 * Connections wait in one epoll set (EPOLLONESHOT: one worker at a time per connection).  A
 * worker takes a connection that has input and serves it (fmc_server.c, fmc_conn_serve) until
 * its input runs dry, then hands it back to the set.  Serving keeps the blocking style of the
 * data path: a payload that is arriving is received straight into registered memory by the
 * worker that read its header.  So the threads in use follow the connections that are moving
 * bytes at the moment, not the connections that exist: a worker that takes a connection while
 * no other worker waits starts one more, up to the cap, and workers beyond the core count end
 * after FMC_POOL_IDLE_MS without work.  A connection stalled inside a request holds its worker
 * until the socket's stall timeout (fmc_server.c) drops it. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_tcp_conn.h"

#define FMC_POOL_IDLE_MS 2000
#define FMC_POOL_STACK (512u << 10)

static struct {
    pthread_mutex_t mu;
    int epfd;     /* -1 until the first connection */
    int workers;  /* alive */
    int waiting;  /* in epoll_wait */
    int core;     /* kept however idle */
    int cap;      /* at most this many (fmc_serve_pool_set_threads; 0: from the CPUs) */
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .epfd = -1};

int fmc_serve_pool_set_threads(int n)
{
    if (n < 0 || n > 4096) {
        fmc_set_error("serve threads %d outside 0..4096", n);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&pool.mu);
    pool.cap = n;
    pthread_mutex_unlock(&pool.mu);
    return FMC_OK;
}

/* The cap by default: twice the CPUs this process may use, at least 4. */
static int default_cap(void)
{
    int cpus = fmc_usable_cpus();
    return cpus * 2 > 4 ? cpus * 2 : 4;
}

static void *worker_main(void *arg);

/* Start one worker; caller holds pool.mu.  0 if the thread could not be made. */
static int spawn_locked(void)
{
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, FMC_POOL_STACK);
    pthread_t t;
    int ok = pthread_create(&t, &attr, worker_main, NULL) == 0;
    pthread_attr_destroy(&attr);
    if (ok)
        pool.workers++;
    return ok;
}

static void *worker_main(void *arg)
{
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&pool.mu);
        int extra = pool.workers > pool.core;
        pool.waiting++;
        int epfd = pool.epfd;
        pthread_mutex_unlock(&pool.mu);
        struct epoll_event ev;
        int n = epoll_wait(epfd, &ev, 1, extra ? FMC_POOL_IDLE_MS : -1);
        pthread_mutex_lock(&pool.mu);
        pool.waiting--;
        if (n == 0 && pool.workers > pool.core) {
            pool.workers--;
            pthread_mutex_unlock(&pool.mu);
            return NULL;
        }
        if (n == 1 && pool.waiting == 0 && pool.workers < pool.cap)
            spawn_locked(); /* someone to take the next connection with input */
        pthread_mutex_unlock(&pool.mu);
        if (n == 1)
            fmc_conn_serve(ev.data.ptr);
    }
}

/* Make the set and the core workers, with the process's first engine. */
static int pool_ready_locked(void)
{
    if (pool.epfd >= 0)
        return FMC_OK;
    if (pool.cap <= 0)
        pool.cap = default_cap();
    pool.core = fmc_usable_cpus();
    if (pool.core > pool.cap)
        pool.core = pool.cap;
    pool.epfd = epoll_create1(EPOLL_CLOEXEC);
    if (pool.epfd < 0) {
        fmc_set_error("epoll_create1: %s", strerror(errno));
        return FMC_ERR_SOCKET;
    }
    while (pool.workers < pool.core && spawn_locked())
        ;
    return pool.workers > 0 ? FMC_OK : FMC_ERR_MEMORY;
}

int fmc_serve_pool_start(void)
{
    pthread_mutex_lock(&pool.mu);
    int rc = pool_ready_locked();
    pthread_mutex_unlock(&pool.mu);
    return rc;
}

/* Watch a connection for input, once (EPOLLONESHOT).  The set exists: every engine made it
 * (fmc_serve_pool_start) before it could accept a connection. */
static int watch(fmc_conn_state *cs, int fd, int op)
{
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT, .data.ptr = cs};
    if (epoll_ctl(pool.epfd, op, fd, &ev) == 0)
        return FMC_OK;
    fmc_set_error("epoll_ctl: %s", strerror(errno));
    return FMC_ERR_SOCKET;
}

int fmc_serve_pool_add(fmc_conn_state *cs, int fd) { return watch(cs, fd, EPOLL_CTL_ADD); }

int fmc_serve_pool_rearm(fmc_conn_state *cs, int fd) { return watch(cs, fd, EPOLL_CTL_MOD); }

void fmc_serve_pool_counts(int *workers, int *cap)
{
    pthread_mutex_lock(&pool.mu);
    *workers = pool.workers;
    *cap = pool.cap > 0 ? pool.cap : default_cap();
    pthread_mutex_unlock(&pool.mu);
}
