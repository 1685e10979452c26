/* Initiator side: a peer is one remote engine, its region table (make_desc: which region and
 * key hold a remote address), its same-host mappings and N persistent data streams
 * (fmc_stream.c; connected and closed by fmc_peer_connect.c). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

#define FMC_DEFAULT_SLICE (1ull << 20)
#define FMC_MIN_SLICE (4ull << 10)

int fmc_peer_create(fmc_engine *e, const char *host, int data_port, int nstreams, uint64_t slice_size,
                    fmc_peer **out)
{
    *out = NULL;
    if (!host || strlen(host) >= sizeof(((fmc_peer *)0)->host) || data_port <= 0 || data_port > 65535 ||
        nstreams < 1 || nstreams > FMC_MAX_STREAMS) {
        fmc_set_error("invalid peer parameters (host '%s', port %d, %d streams; 1..%d streams allowed)",
                      host ? host : "", data_port, nstreams, FMC_MAX_STREAMS);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (slice_size == 0)
        slice_size = FMC_DEFAULT_SLICE;
    if (slice_size < FMC_MIN_SLICE || slice_size > FMC_MAX_WIRE_LEN) {
        fmc_set_error("slice size %llu outside [%llu, %llu]", (unsigned long long)slice_size,
                      (unsigned long long)FMC_MIN_SLICE, (unsigned long long)FMC_MAX_WIRE_LEN);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    fmc_peer *p = calloc(1, sizeof *p);
    if (!p)
        return FMC_ERR_MEMORY;
    p->engine = e;
    strcpy(p->host, host);
    p->data_port = data_port;
    p->nstreams = nstreams;
    p->slice_size = slice_size;
    p->transports[0] = &fmc_tcp_ops; /* every peer's batches can go over TCP */
    p->ntransports = 1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->sh_mu, NULL);
    pthread_cond_init(&p->sh_cv, NULL);
    pthread_cond_init(&p->grow_cv, NULL);
    atomic_init(&p->nready, 0);
    atomic_init(&p->grow_queued, 0);
    atomic_init(&p->grow_want, 1);
    atomic_init(&p->refs, 1);
    atomic_init(&p->next_id, 1);
    for (int i = 0; i < nstreams; i++) {
        fmc_stream *st = &p->streams[i];
        st->peer = p;
        st->index = i;
        st->fd = -1;
        st->dead = 1; /* until connected */
        st->rx_state = st->tx_state = FMC_ROLE_DONE;
        pthread_mutex_init(&st->mu, NULL);
        fmc_cond_init_monotonic(&st->cv); /* the send side's linger waits on it with a deadline */
        st->target_fd = -1;
    }
    *out = p;
    return FMC_OK;
}

static int find_locked(fmc_peer *p, uint64_t addr, uint64_t len, uint64_t *base, uint32_t *key);
static int region_index_locked(const fmc_peer *p, uint64_t addr, uint64_t len, int hint);

/* A mapping of a region that left the peer's table: a GPU range (device >= 0) or a shared one. */
typedef struct fmc_retired_map {
    uint64_t mapped, len;
    int device;
    struct fmc_retired_map *next;
} fmc_retired_map;

/* Undo a mapping of a peer's region: GPU (device >= 0) or shared memory of `len` bytes. */
static void unmap_region(uint64_t mapped, uint64_t len, int device)
{
    if (device >= 0)
        fmc_cuda_peer_unmap(mapped, device);
    else
        munmap((void *)(uintptr_t)mapped, (size_t)len);
}

static void unmap_retired(fmc_retired_map *m)
{
    while (m) {
        fmc_retired_map *next = m->next;
        unmap_region(m->mapped, m->len, m->device);
        free(m);
        m = next;
    }
}

/* Retire a mapping under p->mu (unmapped once no copy uses the peer's mappings).  Out of memory:
 * leaked rather than unmapped under a copy. */
static void retire_locked(fmc_peer *p, uint64_t mapped, uint64_t len, int device)
{
    fmc_retired_map *m = malloc(sizeof *m);
    if (!m)
        return;
    *m = (fmc_retired_map){.mapped = mapped, .len = len, .device = device, .next = p->retired};
    p->retired = m;
}

/* Retired mappings nobody can use any more, taken off the peer (call under p->mu). */
static fmc_retired_map *take_unused_retired_locked(fmc_peer *p)
{
    if (p->map_users > 0)
        return NULL;
    fmc_retired_map *m = p->retired;
    p->retired = NULL;
    return m;
}

void fmc_peer_routes_done(fmc_peer *p)
{
    pthread_mutex_lock(&p->mu);
    p->map_users--;
    fmc_retired_map *m = take_unused_retired_locked(p);
    pthread_mutex_unlock(&p->mu);
    unmap_retired(m);
}

int fmc_peer_set_regions(fmc_peer *p, const uint64_t *addrs, const uint64_t *lens, const uint32_t *keys, int n)
{
    if (n < 0)
        return FMC_ERR_INVALID_ARGUMENT;
    uint64_t *a = malloc(sizeof *a * (size_t)(n ? n : 1));
    uint64_t *l = malloc(sizeof *l * (size_t)(n ? n : 1));
    uint32_t *k = malloc(sizeof *k * (size_t)(n ? n : 1));
    if (!a || !l || !k) {
        free(a);
        free(l);
        free(k);
        return FMC_ERR_MEMORY;
    }
    /* insertion sort by address: tables are small and usually arrive sorted */
    for (int i = 0; i < n; i++) {
        int j = i;
        while (j > 0 && a[j - 1] > addrs[i]) {
            a[j] = a[j - 1];
            l[j] = l[j - 1];
            k[j] = k[j - 1];
            j--;
        }
        a[j] = addrs[i];
        l[j] = lens[i];
        k[j] = keys[i];
    }
    int32_t *sl = malloc(sizeof *sl * (size_t)(n ? n : 1));
    uint32_t *g = calloc((size_t)(n ? n : 1), sizeof *g);
    if (!sl || !g) {
        free(a);
        free(l);
        free(k);
        free(sl);
        free(g);
        return FMC_ERR_MEMORY;
    }
    int32_t *dv = malloc(sizeof *dv * (size_t)(n ? n : 1));
    uint64_t *ib = calloc((size_t)(n ? n : 1), sizeof *ib), *im = calloc((size_t)(n ? n : 1), sizeof *im);
    uint64_t *sm = calloc((size_t)(n ? n : 1), sizeof *sm);
    if (!dv || !ib || !im || !sm) {
        free(sm);
        free(a);
        free(l);
        free(k);
        free(sl);
        free(g);
        free(dv);
        free(ib);
        free(im);
        return FMC_ERR_MEMORY;
    }
    for (int i = 0; i < n; i++) {
        sl[i] = -1; /* no same-host slot until fmc_peer_set_region_slots says so */
        dv[i] = -1;
    }
    pthread_mutex_lock(&p->mu);
    /* What we know of regions that are still there carries over: their mappings, and their
     * same-host slot and GPU until set_region_slots / set_region_gpu say again (meanwhile a
     * concurrent call must neither leave the same-host path nor aim process_vm_* at GPU memory).
     * The others' mappings are retired (a region registered anew, even at the same place, has a
     * new key and new memory behind it). */
    for (int j = 0; j < p->r_count; j++) {
        int i = 0;
        while (i < n && !(a[i] == p->r_addr[j] && l[i] == p->r_len[j] && k[i] == p->r_key[j]))
            i++;
        int kept = i < n;
        if (kept) {
            sl[i] = p->r_slot[j];
            g[i] = p->r_gen[j];
            dv[i] = p->r_dev[j];
            sm[i] = p->r_shm_mapped[j];
            ib[i] = p->r_ipc_base[j];
            im[i] = p->r_ipc_mapped[j];
        } else {
            if (p->r_shm_mapped[j])
                retire_locked(p, p->r_shm_mapped[j], p->r_len[j], -1);
            if (p->r_ipc_mapped[j])
                retire_locked(p, p->r_ipc_mapped[j], 0, p->r_dev[j]);
        }
    }
    free(p->r_addr);
    free(p->r_len);
    free(p->r_key);
    free(p->r_slot);
    free(p->r_gen);
    free(p->r_dev);
    free(p->r_ipc_base);
    free(p->r_ipc_mapped);
    free(p->r_shm_mapped);
    p->r_shm_mapped = sm;
    p->r_addr = a;
    p->r_len = l;
    p->r_key = k;
    p->r_slot = sl;
    p->r_gen = g;
    p->r_dev = dv;
    p->r_ipc_base = ib;
    p->r_ipc_mapped = im;
    p->r_count = n;
    fmc_retired_map *unused = take_unused_retired_locked(p);
    pthread_mutex_unlock(&p->mu);
    unmap_retired(unused);
    return FMC_OK;
}

static int index_of_locked(fmc_peer *p, uint64_t addr)
{
    int lo = 0, hi = p->r_count - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (p->r_addr[mid] == addr)
            return mid;
        if (p->r_addr[mid] < addr)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -1;
}

/* A remote region the peer backs with a memfd (its managed buffers): map it here, so same-host
 * copies into it are a plain memcpy (still fenced like every same-host copy). */
int fmc_peer_set_region_shm(fmc_peer *p, uint64_t addr, int memfd, uint64_t size)
{
    pthread_mutex_lock(&p->mu);
    int i = index_of_locked(p, addr);
    int ok = i >= 0 && p->r_len[i] == size && p->sh != NULL;
    int have = ok && p->r_shm_mapped[i];
    int pid = p->sh_pid;
    pthread_mutex_unlock(&p->mu);
    if (!ok) {
        fmc_set_error("no same-host region of %llu bytes at 0x%llx", (unsigned long long)size, (unsigned long long)addr);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    if (have)
        return FMC_OK;
    void *m = fmc_map_peer_fd(pid, memfd, (size_t)size);
    if (!m)
        return FMC_ERR_NOT_IMPLEMENTED;
    pthread_mutex_lock(&p->mu);
    i = index_of_locked(p, addr);
    if (i >= 0 && p->r_len[i] == size && !p->r_shm_mapped[i]) {
        p->r_shm_mapped[i] = (uint64_t)(uintptr_t)m;
        m = NULL;
    }
    pthread_mutex_unlock(&p->mu);
    if (m)
        munmap(m, (size_t)size);
    return FMC_OK;
}

int fmc_peer_shared_region_count(fmc_peer *p)
{
    pthread_mutex_lock(&p->mu);
    int n = 0;
    for (int i = 0; i < p->r_count; i++)
        n += p->r_shm_mapped[i] != 0;
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* How a remote GPU region can be mapped here: a legacy CUDA IPC handle, or VMM chunks. */
typedef struct {
    const uint8_t *handle64; /* NULL: VMM chunks */
    int n;
    const uint64_t *bases, *sizes;
    const int32_t *fds;
} gpu_share;

/* Map a remote GPU region here for same-host copies with cuMemcpy; `base` is the remote address
 * the mapping starts at (the allocation's, or the first chunk's).  x NULL: only mark the region
 * as GPU memory (its bytes then go through staging over TCP). */
static int map_gpu_region(fmc_peer *p, uint64_t addr, int device, uint64_t base, const gpu_share *x)
{
    pthread_mutex_lock(&p->mu);
    int i = index_of_locked(p, addr);
    int have = i >= 0 && p->r_ipc_mapped[i] && p->r_ipc_base[i] == base && p->r_dev[i] == device;
    if (i >= 0 && !p->r_ipc_mapped[i])
        p->r_dev[i] = device; /* known to be GPU memory even if we cannot map it: not for process_vm_* */
    int same_host = p->sh != NULL, pid = p->sh_pid;
    pthread_mutex_unlock(&p->mu);
    if (i < 0)
        return FMC_ERR_ADDRESS_NOT_REGISTERED;
    if (have || !same_host || !x)
        return FMC_OK;
    uint64_t mapped = 0;
    int rc = x->handle64 ? fmc_cuda_ipc_open(x->handle64, device, &mapped)
                         : fmc_cuda_vmm_import(pid, x->n, x->bases, x->sizes, x->fds, device, &mapped);
    if (rc != FMC_OK)
        return rc;
    pthread_mutex_lock(&p->mu);
    i = index_of_locked(p, addr);
    if (i >= 0 && !p->r_ipc_mapped[i]) {
        p->r_dev[i] = device;
        p->r_ipc_base[i] = base;
        p->r_ipc_mapped[i] = mapped;
        mapped = 0;
    }
    pthread_mutex_unlock(&p->mu);
    if (mapped)
        fmc_cuda_peer_unmap(mapped, device); /* lost a race or the region went away */
    return FMC_OK;
}

int fmc_peer_set_region_ipc(fmc_peer *p, uint64_t addr, const uint8_t *handle64, uint64_t alloc_base, int device)
{
    gpu_share x = {.handle64 = handle64};
    return map_gpu_region(p, addr, device, alloc_base, &x);
}

int fmc_peer_set_region_device(fmc_peer *p, uint64_t addr, int device)
{
    return map_gpu_region(p, addr, device, 0, NULL);
}

/* The chunks must cover the region: a mapping shorter than the region would let a copy run off
 * its end here. */
int fmc_peer_set_region_vmm(fmc_peer *p, uint64_t addr, int device, int n, const uint64_t *bases,
                            const uint64_t *sizes, const int32_t *fds)
{
    pthread_mutex_lock(&p->mu);
    int i = index_of_locked(p, addr);
    uint64_t len = i >= 0 ? p->r_len[i] : 0;
    pthread_mutex_unlock(&p->mu);
    if (i < 0)
        return FMC_ERR_ADDRESS_NOT_REGISTERED;
    uint64_t end = n > 0 ? bases[n - 1] + sizes[n - 1] : 0;
    if (n <= 0 || n > FMC_CUDA_VMM_MAX_CHUNKS || bases[0] > addr || end < bases[n - 1] || end < addr + len) {
        fmc_set_error("the peer's GPU chunks do not cover its region at 0x%llx", (unsigned long long)addr);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    gpu_share x = {.n = n, .bases = bases, .sizes = sizes, .fds = fds};
    return map_gpu_region(p, addr, device, bases[0], &x);
}

/* Same-host slots of remote regions, by region start address (after fmc_peer_set_regions). */
int fmc_peer_set_region_slots(fmc_peer *p, const uint64_t *addrs, const int32_t *slots, const uint32_t *gens, int n)
{
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < n; i++) {
        int lo = 0, hi = p->r_count - 1;
        while (lo <= hi) {
            int mid = lo + (hi - lo) / 2;
            if (p->r_addr[mid] == addrs[i]) {
                p->r_slot[mid] = slots[i] >= 0 && slots[i] < FMC_SH_MAX_SLOTS ? slots[i] : -1;
                p->r_gen[mid] = gens[i];
                break;
            }
            if (p->r_addr[mid] < addrs[i])
                lo = mid + 1;
            else
                hi = mid - 1;
        }
    }
    pthread_mutex_unlock(&p->mu);
    return FMC_OK;
}

int fmc_peer_is_same_host(fmc_peer *p)
{
    pthread_mutex_lock(&p->mu);
    int on = p->sh != NULL;
    pthread_mutex_unlock(&p->mu);
    return on;
}

/* Routes for every task; 0 if some task cannot go the same-host way (then the batch uses TCP).
 * 1: the mappings they point into stay mapped until fmc_peer_routes_done.  0:
 * a region without a slot, a GPU region we could not map, or a GPU source/destination here with
 * host memory there (process_vm_* cannot reach GPU memory). */
int fmc_peer_lookup_routes(fmc_peer *p, int n, const uint64_t *remote, const uint64_t *lens, const int32_t *local_dev,
                           fmc_sh_route *routes)
{
    pthread_mutex_lock(&p->mu);
    int ok = 1, last = -1;
    for (int i = 0; i < n && ok; i++) {
        routes[i] = (fmc_sh_route){.slot = -1, .dev = -1};
        if (lens[i] == 0)
            continue;
        int idx = last = region_index_locked(p, remote[i], lens[i], last);
        if (idx < 0 || p->r_slot[idx] < 0) {
            ok = 0;
            break;
        }
        routes[i].slot = p->r_slot[idx];
        routes[i].gen = p->r_gen[idx];
        if (p->r_ipc_mapped[idx]) {
            routes[i].dev = p->r_dev[idx];
            routes[i].mapped = p->r_ipc_mapped[idx] + (remote[i] - p->r_ipc_base[idx]);
        } else if (p->r_dev[idx] >= 0 || local_dev[i] >= 0) {
            ok = 0;
        } else if (p->r_shm_mapped[idx]) {
            routes[i].mapped = p->r_shm_mapped[idx] + (remote[i] - p->r_addr[idx]);
        }
    }
    p->map_users += ok; /* until fmc_peer_routes_done */
    pthread_mutex_unlock(&p->mu);
    return ok;
}

/* Index of the peer region that wholly holds [addr, addr+len), or -1.  `hint` (an index or -1)
 * is tried first: the tasks of a batch mostly fall in the region of the one before. */
static int region_index_locked(const fmc_peer *p, uint64_t addr, uint64_t len, int hint)
{
    if (len == 0 || addr + len < addr)
        return -1;
    if (hint >= 0 && hint < p->r_count && fmc_range_holds(p->r_addr[hint], p->r_len[hint], addr, len))
        return hint;
    int lo = 0, hi = p->r_count - 1, idx = -1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (p->r_addr[mid] <= addr) {
            idx = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return idx >= 0 && fmc_range_holds(p->r_addr[idx], p->r_len[idx], addr, len) ? idx : -1;
}

static int find_locked(fmc_peer *p, uint64_t addr, uint64_t len, uint64_t *base, uint32_t *key)
{
    int idx = region_index_locked(p, addr, len, -1);
    if (idx < 0)
        return FMC_ERR_ADDRESS_NOT_REGISTERED;
    if (base)
        *base = p->r_addr[idx];
    if (key)
        *key = p->r_key[idx];
    return FMC_OK;
}

int fmc_peer_find_region(fmc_peer *p, uint64_t addr, uint64_t len, uint64_t *base_out, uint32_t *key_out)
{
    pthread_mutex_lock(&p->mu);
    int rc = find_locked(p, addr, len, base_out, key_out);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Resolve keys for every remote range, before anything is sent.  Returns the failing index via
 * *bad_index. */
int fmc_peer_lookup_keys(fmc_peer *p, int n, const uint64_t *remote, const uint64_t *lens, uint32_t *keys,
                         int *bad_index)
{
    pthread_mutex_lock(&p->mu);
    int last = -1;
    for (int i = 0; i < n; i++) {
        keys[i] = 0;
        if (lens[i] == 0)
            continue;
        last = region_index_locked(p, remote[i], lens[i], last);
        if (last >= 0) {
            keys[i] = p->r_key[last];
        } else {
            pthread_mutex_unlock(&p->mu);
            *bad_index = i;
            return FMC_ERR_ADDRESS_NOT_REGISTERED;
        }
    }
    pthread_mutex_unlock(&p->mu);
    return FMC_OK;
}

/* Stop a peer: a pool connecting its streams stops first, then every stream is killed and its
 * sides waited for, then its socket closed. */
void fmc_peer_close(fmc_peer *p)
{
    pthread_mutex_lock(&p->mu);
    int was_closed = p->closed;
    p->closed = 1;
    while (p->growing) /* it stops at its next stream: none starts after this */
        pthread_cond_wait(&p->grow_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    if (was_closed)
        return;
    for (int i = 0; i < p->nstreams; i++) {
        fmc_stream *st = &p->streams[i];
        fmc_stream_kill(st);
        fmc_stream_wait_gone(st);
        pthread_mutex_lock(&st->mu);
        if (st->fd >= 0)
            close(st->fd);
        st->fd = -1;
        pthread_mutex_unlock(&st->mu);
    }
}

void fmc_peer_release(fmc_peer *p)
{
    if (!p || atomic_fetch_sub(&p->refs, 1) != 1)
        return;
    fmc_peer_close(p);
    for (int i = 0; i < p->nstreams; i++) {
        for (int f = 0; f < FMC_STAGE_DEPTH; f++)
            fmc_cuda_fence_free(&p->streams[i].send_fence[f]);
        free(p->streams[i].scratch);
        fmc_reader_free(&p->streams[i].rd);
        fmc_stream_release(&p->streams[i]);
        pthread_mutex_destroy(&p->streams[i].mu);
        pthread_cond_destroy(&p->streams[i].cv);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->grow_cv);
    fmc_sh_peer_release(p);
    for (int i = 0; i < p->r_count; i++) {
        if (p->r_ipc_mapped && p->r_ipc_mapped[i])
            unmap_region(p->r_ipc_mapped[i], 0, p->r_dev[i]);
        if (p->r_shm_mapped && p->r_shm_mapped[i])
            unmap_region(p->r_shm_mapped[i], p->r_len[i], -1);
    }
    unmap_retired(p->retired); /* the last reference is gone: no copy runs */
    free(p->r_shm_mapped);
    free(p->r_dev);
    free(p->r_ipc_base);
    free(p->r_ipc_mapped);
    free(p->r_addr);
    free(p->r_len);
    free(p->r_key);
    free(p->r_slot);
    free(p->r_gen);
    free(p);
}
