/* Same-host transport: the initiator copies with process_vm_writev / process_vm_readv straight
 * between its memory and the target's registered memory, no sockets, no second copy.
 *
 * The target still decides what may be touched.  It publishes a control block in a memfd that
 * same-host peers map (via /proc/<pid>/fd/<fd>): one state word per registered region (slot,
 * generation, active bit) and one "busy" word per initiator.  An initiator announces the region
 * it is about to copy in its busy word, then re-reads the region's state, and copies only if the
 * region is still active with the generation it knows.  Unregister clears the active bit, then
 * waits until no busy word names the region.  Both sides use sequentially consistent atomics, so
 * (Dekker) either the initiator sees the region revoked or unregister sees it busy: no byte is
 * written after unregister returns.  A dead initiator's busy word is cleared; a stopped one makes
 * unregister fail with -4 rather than pretend.
 *
 * The copy runs in the calling thread, so a timed-out or failed call has stopped touching its
 * buffers when it returns; copying into a stopped (SIGSTOP) target works and needs no answer. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "fmc_internal.h"

#define SH_MAGIC 0x32304d4853434d46ull /* "FMCSHM02": the layout of fmc_sh_ctrl */
#define SH_CHUNK (4u << 20)            /* bytes per syscall: bounds the time between deadline checks */
#define SH_IOV 1024

static size_t ctrl_size(void) { return sizeof(fmc_sh_ctrl); }

/* ------------------------------------------------------------------ target side */

int fmc_sh_engine_init(fmc_engine *e)
{
    e->sh_fd = memfd_create("flagcx-mc-ctrl", MFD_CLOEXEC);
    if (e->sh_fd < 0)
        return FMC_ERR_NOT_IMPLEMENTED;
    if (ftruncate(e->sh_fd, (off_t)ctrl_size()) != 0) {
        close(e->sh_fd);
        e->sh_fd = -1;
        return FMC_ERR_MEMORY;
    }
    void *m = mmap(NULL, ctrl_size(), PROT_READ | PROT_WRITE, MAP_SHARED, e->sh_fd, 0);
    if (m == MAP_FAILED) {
        close(e->sh_fd);
        e->sh_fd = -1;
        return FMC_ERR_MEMORY;
    }
    e->sh = m;
    e->sh->magic = SH_MAGIC;
    return FMC_OK;
}

void fmc_sh_engine_free(fmc_engine *e)
{
    if (e->sh) {
        munmap(e->sh, ctrl_size());
        e->sh = NULL;
    }
    if (e->sh_fd >= 0)
        close(e->sh_fd);
    e->sh_fd = -1;
}

int fmc_engine_same_host_fd(fmc_engine *e) { return e->sh ? e->sh_fd : -1; }

uint64_t fmc_engine_same_host_addr(fmc_engine *e) { return (uint64_t)(uintptr_t)e->sh; }

/* Give a new region a slot; caller holds e->mu.  No slot (all in use): the region is simply not
 * reachable by the same-host path (peers fall back to TCP for it). */
void fmc_sh_slot_assign(fmc_engine *e, fmc_region *r)
{
    r->sh_slot = -1;
    if (!e->sh)
        return;
    for (int i = 0; i < FMC_SH_MAX_SLOTS; i++) {
        uint64_t st = atomic_load(&e->sh->slot_state[i]);
        if (!(st & 1) && !e->sh_slot_used[i]) {
            uint32_t gen = (uint32_t)(st >> 1) + 1;
            e->sh_slot_used[i] = 1;
            r->sh_slot = i;
            r->sh_gen = gen;
            atomic_store(&e->sh->slot_state[i], ((uint64_t)gen << 1) | 1);
            return;
        }
    }
}

static int process_state(int pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 'X';
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *rp = strrchr(buf, ')');
    return rp && rp[1] == ' ' ? rp[2] : 'X';
}

/* Revoke a removed region's slot and wait until no initiator is copying into it.  Called with
 * e->mu held (released while waiting).  Returns FMC_ERR_BATCH_BUSY if a stopped initiator still
 * holds it after the grace period. */
int fmc_sh_slot_revoke(fmc_engine *e, fmc_region *r)
{
    if (!e->sh || r->sh_slot < 0)
        return FMC_OK;
    int slot = r->sh_slot;
    atomic_store(&e->sh->slot_state[slot], (uint64_t)r->sh_gen << 1);
    uint64_t mark = (uint64_t)slot + 1;
    int64_t give_up = fmc_now_ms() + 2000;
    for (int i = 0; i < FMC_SH_BUSY_WORDS; i++) {
        while (atomic_load(&e->sh->busy[i]) == mark) {
            int pid = atomic_load(&e->sh->busy_pid[i]);
            int state = pid > 0 ? process_state(pid) : 'X';
            if (state == 'X' || state == 'Z') { /* the copier died: it will not copy again */
                atomic_store(&e->sh->busy[i], 0);
                break;
            }
            if ((state == 'T' || state == 't') && fmc_now_ms() > give_up) {
                fmc_set_error("a stopped same-host peer (pid %d) may still write this region", pid);
                e->sh_slot_used[slot] = 0;
                return FMC_ERR_BATCH_BUSY;
            }
            pthread_mutex_unlock(&e->mu);
            usleep(50);
            pthread_mutex_lock(&e->mu);
        }
    }
    e->sh_slot_used[slot] = 0;
    return FMC_OK;
}

/* ------------------------------------------------------------------ initiator side */

/* Map `size` bytes of a memfd that process `pid` shares (its fd number `fd`), read-write. */
void *fmc_map_peer_fd(int pid, int fd, size_t size)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    int local = open(path, O_RDWR | O_CLOEXEC);
    if (local < 0) {
        fmc_set_error("cannot open the peer's shared memory %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(local, &st) == 0 && (uint64_t)st.st_size >= size)
        m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
    close(local);
    if (m == MAP_FAILED) {
        fmc_set_error("cannot map %zu bytes of the peer's shared memory %s", size, path);
        return NULL;
    }
    return m;
}

int fmc_peer_enable_same_host(fmc_peer *p, int pid, int ctrl_fd, uint64_t ctrl_addr)
{
    fmc_sh_ctrl *c = fmc_map_peer_fd(pid, ctrl_fd, ctrl_size());
    if (!c)
        return FMC_ERR_NOT_IMPLEMENTED;
    if (c->magic != SH_MAGIC) {
        munmap(c, ctrl_size());
        fmc_set_error("the peer's control block is not a flagcx_mc one");
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    /* Can we reach its memory at all?  (EPERM across users, in containers, under Yama; ENOSYS in
     * sandboxes such as gVisor.)  Read the control block's magic through the syscall itself. */
    uint64_t magic = 0;
    struct iovec l = {.iov_base = &magic, .iov_len = sizeof magic};
    struct iovec r = {.iov_base = (void *)(uintptr_t)ctrl_addr, .iov_len = sizeof magic};
    if (process_vm_readv(pid, &l, 1, &r, 1, 0) != (ssize_t)sizeof magic || magic != SH_MAGIC) {
        int err = errno;
        munmap(c, ctrl_size());
        fmc_set_error("process_vm_readv from pid %d does not work here (%s)", pid,
                      magic != SH_MAGIC && err == 0 ? "wrong data" : strerror(err));
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    /* Claim busy words (one per concurrent copy): free ones, or else those of initiators that
     * died.  Only a full block is searched for dead owners, and each owner's state is read once
     * per run of its words: /proc/PID/stat costs tens of microseconds, and a hundred initiators
     * arriving together each reading every other's made first contact quadratic. */
    int me = (int)getpid(), words[FMC_SH_WORDS_PER_PEER], nwords = 0;
    for (int i = 0; i < FMC_SH_BUSY_WORDS && nwords < FMC_SH_WORDS_PER_PEER; i++) {
        int expected = 0;
        if (atomic_load_explicit(&c->busy_pid[i], memory_order_relaxed) == 0 &&
            atomic_compare_exchange_strong(&c->busy_pid[i], &expected, me))
            words[nwords++] = i;
    }
    int known_pid = 0, known_dead = 0, full = nwords == 0;
    for (int i = 0; full && i < FMC_SH_BUSY_WORDS && nwords < FMC_SH_WORDS_PER_PEER; i++) {
        int owner = atomic_load(&c->busy_pid[i]);
        if (owner == 0 || owner == me)
            continue;
        if (owner != known_pid) {
            int state = process_state(owner);
            known_pid = owner;
            known_dead = state == 'X' || state == 'Z';
        }
        if (known_dead && atomic_compare_exchange_strong(&c->busy_pid[i], &owner, me))
            words[nwords++] = i;
    }
    if (nwords == 0) {
        munmap(c, ctrl_size());
        fmc_set_error("the peer has no free same-host initiator slot");
        return FMC_ERR_TOO_MANY_REQUESTS;
    }
    pthread_mutex_lock(&p->mu);
    p->sh = c;
    p->sh_pid = pid;
    /* Batches try the same-host copy first; those it declines go on to the transports after. */
    if (p->transports[0] != &fmc_samehost_ops && p->ntransports < FMC_MAX_TRANSPORTS) {
        memmove(&p->transports[1], &p->transports[0], sizeof p->transports[0] * (size_t)p->ntransports);
        p->transports[0] = &fmc_samehost_ops;
        p->ntransports++;
    }
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_lock(&p->sh_mu);
    for (int i = 0; i < nwords; i++) {
        atomic_store(&c->busy[words[i]], 0);
        p->sh_words[i] = words[i];
    }
    p->sh_nwords = nwords;
    p->sh_free = (1u << nwords) - 1;
    pthread_mutex_unlock(&p->sh_mu);
    return FMC_OK;
}

void fmc_sh_peer_release(fmc_peer *p)
{
    if (p->sh) {
        int me = (int)getpid();
        for (int i = 0; i < p->sh_nwords; i++) {
            int mine = me;
            atomic_store(&p->sh->busy[p->sh_words[i]], 0);
            atomic_compare_exchange_strong(&p->sh->busy_pid[p->sh_words[i]], &mine, 0);
        }
        munmap(p->sh, ctrl_size());
        p->sh = NULL;
    }
}

/* Announce the copy in our busy word, then check the region is still what we think it is. */
static int enter(fmc_sh_ctrl *c, _Atomic uint64_t *busy, const fmc_sh_route *r, uint64_t remote)
{
    atomic_store(busy, (uint64_t)r->slot + 1);
    if (atomic_load(&c->slot_state[r->slot]) != (((uint64_t)r->gen << 1) | 1)) {
        atomic_store(busy, 0);
        fmc_set_error("the peer unregistered the region holding 0x%llx", (unsigned long long)remote);
        return FMC_ERR_ADDRESS_NOT_REGISTERED;
    }
    return FMC_OK;
}

/* Arrays of one run of GPU copies, allocated on the first GPU run of a call. */
typedef struct {
    uint64_t dst[SH_IOV], src[SH_IOV];
    size_t len[SH_IOV];
} copy_scratch;

static int copy_tasks_with(copy_scratch **scp, fmc_peer *p, _Atomic uint64_t *busy, int opcode, int n,
                           const uint64_t *local, const uint64_t *remote, const uint64_t *lens,
                           const int32_t *local_dev, const fmc_sh_route *routes, int64_t deadline_ms);

/* Copy every task in the calling thread: host regions with process_vm_writev/readv (consecutive
 * tasks of one region in one syscall), GPU regions with cuMemcpy through their IPC mapping
 * (a region's run of copies queued as one batch). */
static int copy_tasks(fmc_peer *p, _Atomic uint64_t *busy, int opcode, int n, const uint64_t *local,
                      const uint64_t *remote, const uint64_t *lens, const int32_t *local_dev,
                      const fmc_sh_route *routes, int64_t deadline_ms)
{
    copy_scratch *sc = NULL;
    int rc = copy_tasks_with(&sc, p, busy, opcode, n, local, remote, lens, local_dev, routes, deadline_ms);
    free(sc);
    return rc;
}

/* ------------------------------------------------------------------ copies in parallel */

/* A large call is cut into parts of about equal bytes, one per free busy word, and its parts
 * beyond the first are copied by helper threads while the caller copies the first: memcpy and
 * process_vm_writev are bound by one core's copy speed, and the target side needs no CPU at all.
 * The caller returns only once every part is done, so a call's buffers are free when it returns. */
#define SH_SPLIT_MIN (1u << 20) /* smaller calls stay in the calling thread */
#define SH_MAX_PARTS FMC_SH_WORDS_PER_PEER

typedef struct sh_part {
    fmc_peer *p;
    _Atomic uint64_t *busy;
    int opcode, n;
    const uint64_t *local, *remote, *lens;
    const int32_t *local_dev;
    const fmc_sh_route *routes;
    int64_t deadline_ms;
    int rc, done;
    char error[256]; /* the helper's fmc_set_error text, handed to the caller */
    struct sh_part *next;
} sh_part;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    sh_part *queue;
    int threads; /* helpers started in this process */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0};

/* A forked child has none of the parent's helpers: start afresh. */
static void pool_after_fork(void)
{
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.queue = NULL;
    pool.threads = 0;
}

static void pool_register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Threads that copy one call: the engine's copy_threads (FLAGCX_MC_COPY_THREADS), by default
 * the CPUs this process may run on, at most SH_MAX_PARTS (resolved at engine creation).  The
 * helper threads are one pool for the process, started as calls need them; a call posts at most
 * its own engine's count less one (the calling thread copies a part too), so engines in one
 * process may differ. */
static int copy_threads(const fmc_engine *e)
{
    int v = e->opts.copy_threads;
    return v < 1 ? 1 : v > SH_MAX_PARTS ? SH_MAX_PARTS : v;
}

static void run_part(sh_part *t)
{
    t->rc = copy_tasks(t->p, t->busy, t->opcode, t->n, t->local, t->remote, t->lens, t->local_dev, t->routes,
                       t->deadline_ms);
    if (t->rc != FMC_OK)
        snprintf(t->error, sizeof t->error, "%s", fmc_last_error());
}

static void *helper_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (!pool.queue)
            pthread_cond_wait(&pool.work, &pool.mu);
        sh_part *t = pool.queue;
        pool.queue = t->next;
        pthread_mutex_unlock(&pool.mu);
        run_part(t);
        pthread_mutex_lock(&pool.mu);
        t->done = 1;
        pthread_cond_broadcast(&pool.done);
    }
    return NULL;
}

/* Hand parts to helpers (started on first need); 0 if no helper could be started. */
static int pool_post(sh_part *parts, int nparts)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, pool_register_fork_handler);
    pthread_mutex_lock(&pool.mu);
    while (pool.threads < nparts && pool.threads < SH_MAX_PARTS - 1) {
        pthread_t th;
        if (pthread_create(&th, NULL, helper_main, NULL) != 0)
            break;
        pthread_detach(th);
        pool.threads++;
    }
    if (pool.threads == 0) {
        pthread_mutex_unlock(&pool.mu);
        return 0;
    }
    for (int i = nparts - 1; i >= 0; i--) {
        parts[i].next = pool.queue;
        pool.queue = &parts[i];
    }
    pthread_cond_broadcast(&pool.work);
    pthread_mutex_unlock(&pool.mu);
    return 1;
}

/* Cut the tasks into `nparts` runs of about equal bytes (page-aligned cuts inside a task), each
 * with its own arrays in `buf`; returns 0 when a run came out empty (too few bytes to cut). */
static int cut_parts(sh_part *parts, int nparts, int n, const uint64_t *local, const uint64_t *remote,
                     const uint64_t *lens, const int32_t *local_dev, const fmc_sh_route *routes, uint64_t total,
                     uint64_t *buf, fmc_sh_route *rbuf, int32_t *dbuf)
{
    int cap = n + nparts;
    uint64_t *l = buf, *r = buf + cap, *len = buf + 2 * (size_t)cap;
    uint64_t share = (total / (uint64_t)nparts + 4095) & ~4095ull;
    int k = 0, part = 0;
    uint64_t in_part = 0;
    parts[0].local = l, parts[0].remote = r, parts[0].lens = len, parts[0].local_dev = dbuf, parts[0].routes = rbuf;
    for (int i = 0; i < n; i++) {
        uint64_t off = 0;
        while (off < lens[i]) {
            uint64_t take = lens[i] - off;
            if (part < nparts - 1 && in_part + take > share)
                take = share - in_part;
            l[k] = local[i] + off;
            r[k] = remote[i] + off;
            len[k] = take;
            dbuf[k] = local_dev[i];
            rbuf[k] = routes[i];
            if (rbuf[k].mapped)
                rbuf[k].mapped += off;
            k++;
            off += take;
            in_part += take;
            if (part < nparts - 1 && in_part == share) {
                parts[part].n = k - (int)(parts[part].local - l);
                part++;
                in_part = 0;
                parts[part].local = l + k, parts[part].remote = r + k, parts[part].lens = len + k;
                parts[part].local_dev = dbuf + k, parts[part].routes = rbuf + k;
            }
        }
    }
    parts[part].n = k - (int)(parts[part].local - l);
    return part == nparts - 1 && parts[part].n > 0;
}

/* Each copy in flight owns one of the peer's busy words (a shared word could hide one thread's
 * copy from unregister while another thread clears it), so up to FMC_SH_WORDS_PER_PEER threads
 * copy to one peer at once; more wait for a word.  A large host-memory call takes what free words
 * there are and copies its parts in parallel. */
int fmc_sh_transfer(fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                    const uint64_t *lens, const int32_t *local_dev, const fmc_sh_route *routes, int64_t deadline_ms)
{
    uint64_t total = 0;
    int host_only = 1;
    for (int i = 0; i < n; i++) {
        total += lens[i];
        host_only &= routes[i].dev < 0 && local_dev[i] < 0;
    }
    int want = total >= SH_SPLIT_MIN && host_only ? copy_threads(p->engine) : 1;
    int words[SH_MAX_PARTS], nwords = 0;
    pthread_mutex_lock(&p->sh_mu);
    while (!p->sh_free)
        pthread_cond_wait(&p->sh_cv, &p->sh_mu);
    while (p->sh_free && nwords < want) {
        int w = __builtin_ctz(p->sh_free);
        p->sh_free &= ~(1u << w);
        words[nwords++] = w;
    }
    pthread_mutex_unlock(&p->sh_mu);
    int rc;
    sh_part parts[SH_MAX_PARTS];
    memset(parts, 0, sizeof parts);
    int cap = n + nwords;
    uint64_t *buf = nwords > 1 ? malloc(sizeof(uint64_t) * 3 * (size_t)cap) : NULL;
    fmc_sh_route *rbuf = buf ? malloc(sizeof *rbuf * (size_t)cap) : NULL;
    int32_t *dbuf = rbuf ? malloc(sizeof *dbuf * (size_t)cap) : NULL;
    if (dbuf && cut_parts(parts, nwords, n, local, remote, lens, local_dev, routes, total, buf, rbuf, dbuf)) {
        for (int i = 0; i < nwords; i++) {
            parts[i].p = p;
            parts[i].busy = &p->sh->busy[p->sh_words[words[i]]];
            parts[i].opcode = opcode;
            parts[i].deadline_ms = deadline_ms;
        }
        int posted = pool_post(parts + 1, nwords - 1);
        run_part(&parts[0]);
        if (posted) {
            pthread_mutex_lock(&pool.mu);
            for (int i = 1; i < nwords; i++)
                while (!parts[i].done)
                    pthread_cond_wait(&pool.done, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        } else {
            for (int i = 1; i < nwords; i++)
                run_part(&parts[i]);
        }
        rc = FMC_OK;
        for (int i = 0; i < nwords && rc == FMC_OK; i++)
            if (parts[i].rc != FMC_OK) {
                rc = parts[i].rc;
                fmc_set_error("%s", parts[i].error);
            }
    } else {
        rc = copy_tasks(p, &p->sh->busy[p->sh_words[words[0]]], opcode, n, local, remote, lens, local_dev, routes,
                        deadline_ms);
    }
    free(buf);
    free(rbuf);
    free(dbuf);
    pthread_mutex_lock(&p->sh_mu);
    for (int i = 0; i < nwords; i++)
        p->sh_free |= 1u << words[i];
    pthread_cond_broadcast(&p->sh_cv);
    pthread_mutex_unlock(&p->sh_mu);
    return rc;
}

static int copy_tasks_with(copy_scratch **scp, fmc_peer *p, _Atomic uint64_t *busy, int opcode, int n,
                           const uint64_t *local, const uint64_t *remote, const uint64_t *lens,
                           const int32_t *local_dev, const fmc_sh_route *routes, int64_t deadline_ms)
{
    fmc_sh_ctrl *c = p->sh;
    struct iovec liov[SH_IOV], riov[SH_IOV];
    int i = 0;
    while (i < n) {
        if (lens[i] == 0) {
            i++;
            continue;
        }
        if (deadline_ms >= 0 && fmc_now_ms() > deadline_ms) {
            fmc_set_error("same-host transfer to pid %d timed out", p->sh_pid);
            return FMC_ERR_TIMEOUT;
        }
        const fmc_sh_route *r = &routes[i];
        if (r->dev >= 0) {
            if (!*scp && !(*scp = malloc(sizeof **scp)))
                return FMC_ERR_MEMORY;
            copy_scratch *sc = *scp;
            /* GPU memory over there, mapped here by CUDA IPC: queue the copies of consecutive tasks
             * into this region on one stream, wait once, and only then leave the fence. */
            int rc = enter(c, busy, r, remote[i]);
            if (rc != FMC_OK)
                return rc;
            int dev = r->dev, j = i, k = 0;
            for (; j < n; j++) {
                const fmc_sh_route *q = &routes[j];
                if (lens[j] == 0)
                    continue;
                if (q->dev != dev || q->slot != r->slot || q->gen != r->gen || k == SH_IOV)
                    break;
                sc->dst[k] = opcode == FMC_OP_WRITE ? q->mapped : local[j];
                sc->src[k] = opcode == FMC_OP_WRITE ? local[j] : q->mapped;
                sc->len[k++] = (size_t)lens[j];
            }
            rc = fmc_cuda_copy_many_async(sc->dst, sc->src, sc->len, k, dev);
            int waited = fmc_cuda_wait(dev);
            atomic_store(busy, 0);
            if (rc != FMC_OK || waited != FMC_OK) {
                fmc_set_error("CUDA IPC copy with pid %d failed", p->sh_pid);
                return FMC_ERR_SOCKET;
            }
            i = j;
            continue;
        }
        if (r->mapped) {
            /* A region the peer shares with us (its managed memory): plain memcpy, fenced the same. */
            int rc = enter(c, busy, r, remote[i]);
            if (rc != FMC_OK)
                return rc;
            int j = i;
            for (; j < n; j++) {
                const fmc_sh_route *q = &routes[j];
                if (lens[j] == 0)
                    continue;
                if (q->dev >= 0 || !q->mapped || q->slot != r->slot || q->gen != r->gen)
                    break;
                if (opcode == FMC_OP_WRITE)
                    memcpy((void *)(uintptr_t)q->mapped, (const void *)(uintptr_t)local[j], (size_t)lens[j]);
                else
                    memcpy((void *)(uintptr_t)local[j], (const void *)(uintptr_t)q->mapped, (size_t)lens[j]);
            }
            atomic_store(busy, 0);
            i = j;
            continue;
        }
        /* Gather consecutive host tasks of the same region into one syscall (up to SH_CHUNK). */
        int k = 0, j = i;
        size_t bytes = 0;
        while (j < n && k < SH_IOV && (bytes < SH_CHUNK || k == 0) &&
               (lens[j] == 0 || (routes[j].dev < 0 && !routes[j].mapped && routes[j].slot == r->slot &&
                                 routes[j].gen == r->gen))) {
            if (lens[j]) {
                liov[k] = (struct iovec){.iov_base = (void *)(uintptr_t)local[j], .iov_len = (size_t)lens[j]};
                riov[k] = (struct iovec){.iov_base = (void *)(uintptr_t)remote[j], .iov_len = (size_t)lens[j]};
                bytes += (size_t)lens[j];
                k++;
            }
            j++;
        }
        /* Each side is one stream of bytes to the kernel, so back-to-back blocks join per side:
         * the kernel pins the target's pages once per range instead of once per block. */
        unsigned long nl = (unsigned long)fmc_iov_merge(liov, k), nr = (unsigned long)fmc_iov_merge(riov, k);
        int rc = enter(c, busy, r, remote[i]);
        if (rc != FMC_OK)
            return rc;
        ssize_t done = opcode == FMC_OP_WRITE ? process_vm_writev(p->sh_pid, liov, nl, riov, nr, 0)
                                              : process_vm_readv(p->sh_pid, liov, nl, riov, nr, 0);
        int err = errno;
        atomic_store(busy, 0);
        if (done < 0 || (size_t)done != bytes) {
            fmc_set_error("same-host copy with pid %d failed: %s", p->sh_pid,
                          done < 0 ? strerror(err) : "short copy");
            return FMC_ERR_SOCKET; /* the peer is gone or its memory moved: re-open the session */
        }
        i = j;
    }
    return FMC_OK;
}
