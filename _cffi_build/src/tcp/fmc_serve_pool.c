/* The target side's threads: one pool per process (fmc_worker_pool.c), shared by every engine's
 * inbound data connections, instead of one thread per connection.  A worker takes a connection
 * that has input and serves it (fmc_server.c, fmc_conn_serve) until its input runs dry, then
 * hands it back to the set.  A connection stalled inside a request holds its worker until the
 * socket's stall timeout (fmc_server.c) drops it; a stalled write payload is parked instead. */
#define _GNU_SOURCE
#include <sys/epoll.h>

#include "fmc_internal.h"
#include "fmc_tcp_conn.h"
#include "fmc_worker_pool.h"

static void serve_event(void *cs, uint32_t events)
{
    (void)events;
    fmc_conn_serve(cs);
}

static fmc_worker_pool pool = FMC_WORKER_POOL_INIT("serve", serve_event, 0);

int fmc_serve_pool_set_threads(int n) { return fmc_pool_set_cap(&pool, n); }

int fmc_serve_pool_start(void) { return fmc_pool_start(&pool); }

/* Watch a connection for input, once.  The set exists: every engine made it
 * (fmc_serve_pool_start) before it could accept a connection. */
int fmc_serve_pool_add(fmc_conn_state *cs, int fd)
{
    return fmc_pool_watch(&pool, fd, cs, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
}

int fmc_serve_pool_rearm(fmc_conn_state *cs, int fd)
{
    return fmc_pool_watch(&pool, fd, cs, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_MOD);
}

void fmc_serve_pool_counts(int *workers, int *cap) { fmc_pool_counts(&pool, workers, cap); }
