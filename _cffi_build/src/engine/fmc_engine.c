/* Engine lifecycle, the registry's public calls and statistics. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

#ifndef FMC_VERSION
#define FMC_VERSION "0.0.0"
#endif

const char *fmc_version(void) { return FMC_VERSION; }
int fmc_data_header_size(void) { return FMC_REQ_SIZE; }

void fmc_options_default(fmc_options *o)
{
    memset(o, 0, sizeof *o);
    strcpy(o->local_cc, "reno");
    o->prefault = FMC_PREFAULT_TOUCHED;
    o->vectors = 1;
    o->spin_us = 30;
    o->copy_threads = 0;
    o->zerocopy = 1;
    o->gpu_staging = 64u << 20;
    o->rto_min_us = FMC_RTO_MIN_US_DEFAULT;
    o->delack_max_us = FMC_DELACK_MAX_US_DEFAULT;
}

int fmc_engine_create(const char *bind_host, int port_min, int port_max, const fmc_options *opts,
                      fmc_engine **out)
{
    *out = NULL;
    if (port_min < 0 || port_max > 65535 || port_min > port_max) {
        fmc_set_error("invalid data port range [%d, %d]", port_min, port_max);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    fmc_engine *e = calloc(1, sizeof *e);
    if (!e)
        return FMC_ERR_MEMORY;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->log_mu, NULL);
    fmc_cond_init_monotonic(&e->cv);
    pthread_mutex_init(&e->done_mu, NULL);
    fmc_cond_init_monotonic(&e->done_cv);
    e->wake_pipe[0] = e->wake_pipe[1] = -1;
    e->accept_mooncake_wire = 1;
    e->sh_fd = -1;
    if (opts)
        e->opts = *opts;
    else
        fmc_options_default(&e->opts);
    e->opts.local_cc[sizeof e->opts.local_cc - 1] = '\0';
    e->opts.spin_us = e->opts.spin_us < 0 ? 0 : e->opts.spin_us > 10000 ? 10000 : e->opts.spin_us;
    e->cores = fmc_usable_cpus();
    if (e->opts.copy_threads <= 0)
        e->opts.copy_threads = e->cores;
    if (e->opts.copy_threads > FMC_SH_WORDS_PER_PEER)
        e->opts.copy_threads = FMC_SH_WORDS_PER_PEER;
    fmc_stage_pool_init(&e->stage, e->opts.gpu_staging);
    fmc_sh_engine_init(e); /* optional: without it peers use TCP */
    int fd = fmc_tcp_listen(bind_host, port_min, port_max, &e->data_port);
    if (fd < 0) {
        free(e);
        return fd;
    }
    e->listen_fd = fd;
    fmc_tcp_timers_early(fd, &e->opts); /* inherited by every accepted connection */
    int pool = fmc_serve_pool_start(); /* its error already says why */
    if (pool != FMC_OK || pipe2(e->wake_pipe, O_CLOEXEC) != 0 ||
        pthread_create(&e->accept_thread, NULL, fmc_server_accept_main, e) != 0) {
        if (pool == FMC_OK)
            fmc_set_error("cannot start the data listener thread: %s", strerror(errno));
        close(fd);
        if (e->wake_pipe[0] >= 0) {
            close(e->wake_pipe[0]);
            close(e->wake_pipe[1]);
        }
        free(e);
        return FMC_ERR_MEMORY;
    }
    *out = e;
    return FMC_OK;
}

int fmc_engine_data_port(fmc_engine *e) { return e->data_port; }

int fmc_engine_set_secret(fmc_engine *e, const uint8_t *key, int len)
{
    if (len < 0 || len > FMC_SECRET_MAX) {
        fmc_set_error("the shared secret must be at most %d bytes", FMC_SECRET_MAX);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&e->mu);
    memset(e->secret.key, 0, sizeof e->secret.key);
    if (len)
        memcpy(e->secret.key, key, (size_t)len);
    e->secret.len = (size_t)len;
    if (len)
        e->accept_mooncake_wire = 0; /* Mooncake's framing cannot authenticate */
    pthread_mutex_unlock(&e->mu);
    return FMC_OK;
}

void fmc_engine_accept_mooncake_wire(fmc_engine *e, int accept)
{
    pthread_mutex_lock(&e->mu);
    e->accept_mooncake_wire = accept != 0 && e->secret.len == 0;
    pthread_mutex_unlock(&e->mu);
}

void fmc_engine_destroy(fmc_engine *e)
{
    if (!e)
        return;
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_mutex_unlock(&e->mu);
    fmc_hugepages_stop(e);
    char c = 1;
    if (write(e->wake_pipe[1], &c, 1) < 0) { /* the accept thread also polls `stopping` */
    }
    pthread_join(e->accept_thread, NULL);
    close(e->listen_fd);
    close(e->wake_pipe[0]);
    close(e->wake_pipe[1]);
    pthread_mutex_lock(&e->mu);
    for (fmc_server_conn *sc = e->conns; sc; sc = sc->next)
        fmc_server_conn_cut_locked(sc);
    while (e->nconns > 0)
        pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    fmc_registry_free(&e->reg);
    fmc_stage_pool_free(&e->stage);
    fmc_sh_engine_free(e);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->log_mu);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->done_mu);
    pthread_cond_destroy(&e->done_cv);
    free(e);
}

void fmc_engine_get_stats(fmc_engine *e, fmc_stats *s)
{
    s->bytes_written_out = e->stat_written_out;
    s->bytes_read_in = e->stat_read_in;
    s->bytes_served_in = e->stat_served_in;
    s->bytes_served_out = e->stat_served_out;
    s->batches_ok = e->stat_batches_ok;
    s->batches_failed = e->stat_batches_failed;
    s->requests_refused = e->stat_refused;
    s->protocol_errors = e->stat_protocol_errors;
    s->requests_served = e->stat_requests;
    s->vectors_served = e->stat_vectors;
    s->zero_copy_answers = e->stat_zc_answers;
    s->zero_copy_resets = e->stat_zc_resets;
    s->zero_copy_sends = e->stat_zc_sends;
    s->streams_cut = e->stat_streams_cut;
    s->streams_reconnected = e->stat_streams_reconnected;
    s->zero_copy_fences = e->stat_zc_fences;
    pthread_mutex_lock(&e->mu);
    s->server_connections = (uint64_t)e->nconns;
    pthread_mutex_unlock(&e->mu);
}

/* ------------------------------------------------------------------ registry API */

/* A region's key, never 0.  Keys are what stops a peer from reaching a region by a guessed
 * address, so they come from the kernel's generator or not at all. */
static int random_key(uint32_t *key)
{
    uint32_t k = 0;
    while (k == 0)
        if (fmc_random_bytes(&k, sizeof k) < 0)
            return -1;
    *key = k;
    return 0;
}

int fmc_register(fmc_engine *e, uint64_t addr, uint64_t len, uint32_t *key_out)
{
    if (addr == 0 || len == 0 || addr + len < addr) {
        fmc_set_error("cannot register [0x%llx, +%llu): %s", (unsigned long long)addr,
                      (unsigned long long)len,
                      addr == 0 ? "null address" : len == 0 ? "zero length" : "range wraps around");
        return FMC_ERR_INVALID_ARGUMENT;
    }
    int rc = fmc_check_mapped(addr, len);
    int writable = rc == FMC_OK && fmc_range_writable(addr, len); /* read-only regions serve reads only */
    int dev = -1;
    if (rc != FMC_OK || !writable) {
        /* Not plain host memory: it may be GPU memory (unified addressing). */
        int is_dev = fmc_cuda_device_of(addr, len, &dev);
        if (is_dev < 0)
            return FMC_ERR_INVALID_ARGUMENT;
        if (is_dev == 1)
            writable = 1;
        else if (rc != FMC_OK)
            return rc;
    }
    uint32_t key;
    if (random_key(&key) < 0)
        return FMC_ERR_NOT_IMPLEMENTED;
    int host = dev < 0 && writable;
    if (host)
        fmc_hugepages_prepare(e, addr, len); /* huge pages for future faults; commits nothing by default */
    pthread_mutex_lock(&e->mu);
    rc = fmc_registry_add(&e->reg, addr, len, key, writable);
    if (rc == FMC_OK) {
        fmc_region *r = fmc_registry_find(&e->reg, addr, len);
        r->cuda_dev = dev;
        if (writable)
            fmc_sh_slot_assign(e, r);
        else
            r->sh_slot = -1; /* read-only: same-host peers would write it unchecked, keep them on TCP */
    }
    pthread_mutex_unlock(&e->mu);
    if (rc == FMC_OK && host)
        fmc_hugepages_collapse_later(e, addr, len, key); /* pages touched before registration */
    if (rc == FMC_OK && key_out)
        *key_out = key;
    return rc;
}

static int conn_pins(const fmc_server_conn *sc, const fmc_region *r)
{
    for (int i = 0; i < sc->npins; i++)
        if (sc->pins[i] == r)
            return 1;
    return 0;
}

int fmc_unregister(fmc_engine *e, uint64_t addr)
{
    pthread_mutex_lock(&e->mu);
    fmc_region *r = fmc_registry_remove(&e->reg, addr);
    if (!r) {
        pthread_mutex_unlock(&e->mu);
        fmc_set_error("address 0x%llx is not the start of a registered region",
                      (unsigned long long)addr);
        return FMC_ERR_ADDRESS_NOT_REGISTERED;
    }
    /* No new operation can pin r now.  Give the ones in progress a moment to finish, then cut
     * the connections still holding it so that no byte moves once we return. */
    int64_t grace_until = fmc_now_ms() + 200;
    while (r->refs > 0) {
        if (fmc_now_ms() >= grace_until) {
            for (fmc_server_conn *sc = e->conns; sc; sc = sc->next)
                if (conn_pins(sc, r))
                    fmc_server_conn_cut_locked(sc);
        }
        struct timespec ts;
        fmc_deadline_ts(20, &ts);
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    }
    int rc = fmc_sh_slot_revoke(e, r); /* and no same-host peer is copying into it */
    pthread_mutex_unlock(&e->mu);
    fmc_region_free(r);
    return rc;
}

/* The GPU ordinal of the region starting at addr (-1: host memory or no such region), its length
 * and key, and whether its VMM chunks are exported already. */
static int gpu_region(fmc_engine *e, uint64_t addr, uint64_t *len, uint32_t *key, int *exported)
{
    pthread_mutex_lock(&e->mu);
    fmc_region *r = fmc_registry_find(&e->reg, addr, 1);
    int dev = r && r->addr == addr ? r->cuda_dev : -1;
    if (dev >= 0) {
        *len = r->len;
        *key = r->key;
        *exported = r->vmm != NULL;
    }
    pthread_mutex_unlock(&e->mu);
    return dev;
}

int fmc_region_cuda_ipc(fmc_engine *e, uint64_t addr, uint8_t *handle64, uint64_t *alloc_base, int *device)
{
    uint64_t len;
    uint32_t key;
    int exported;
    if ((*device = gpu_region(e, addr, &len, &key, &exported)) < 0)
        return 0;
    int rc = fmc_cuda_ipc_export(addr, handle64, alloc_base, device);
    return rc == FMC_OK ? 1 : rc;
}

/* Exported on first use (thousands of chunks take a while: outside the lock), then kept with the
 * region, whose unregistration closes the descriptors. */
int fmc_region_cuda_vmm(fmc_engine *e, uint64_t addr, uint64_t *bases, uint64_t *sizes, int32_t *fds, int cap,
                        int *device)
{
    uint64_t len;
    uint32_t key;
    int exported;
    if ((*device = gpu_region(e, addr, &len, &key, &exported)) < 0)
        return 0;
    fmc_vmm_export *x = NULL;
    if (!exported) {
        if (!(x = malloc(sizeof *x)))
            return FMC_ERR_MEMORY;
        x->n = fmc_cuda_vmm_export(addr, len, *device, FMC_CUDA_VMM_MAX_CHUNKS, x->base, x->size, x->fd);
        if (x->n < 0) {
            int rc = x->n;
            free(x);
            return rc;
        }
    }
    pthread_mutex_lock(&e->mu);
    fmc_region *r = fmc_region_at_locked(e, addr, key);
    if (r && !r->vmm) {
        r->vmm = x;
        x = NULL;
    }
    int n = r && r->vmm ? r->vmm->n : 0;
    for (int i = 0; i < n && n <= cap; i++) {
        bases[i] = r->vmm->base[i];
        sizes[i] = r->vmm->size[i];
        fds[i] = r->vmm->fd[i];
    }
    pthread_mutex_unlock(&e->mu);
    fmc_vmm_export_free(x); /* raced with another export, or unregistered meanwhile */
    if (n == 0)
        fmc_set_error("the region at 0x%llx was unregistered", (unsigned long long)addr);
    return n ? n : FMC_ERR_ADDRESS_NOT_REGISTERED;
}

int fmc_region_slots(fmc_engine *e, int32_t *slots, uint32_t *gens, int cap)
{
    pthread_mutex_lock(&e->mu);
    int n = e->reg.count;
    for (int i = 0; i < n && i < cap; i++) {
        slots[i] = e->reg.order[i]->sh_slot;
        gens[i] = e->reg.order[i]->sh_gen;
    }
    pthread_mutex_unlock(&e->mu);
    return n;
}

int fmc_region_table(fmc_engine *e, uint64_t *addrs, uint64_t *lens, uint32_t *keys, int cap)
{
    pthread_mutex_lock(&e->mu);
    int n = e->reg.count;
    for (int i = 0; i < n && i < cap; i++) { /* registration order (fmc_registry.c) */
        addrs[i] = e->reg.order[i]->addr;
        lens[i] = e->reg.order[i]->len;
        keys[i] = e->reg.order[i]->key;
    }
    pthread_mutex_unlock(&e->mu);
    return n;
}

int fmc_local_ranges_ok(fmc_engine *e, int n, const uint64_t *addr, const uint64_t *len, int need_write,
                        int32_t *cuda_dev, int *bad_index)
{
    pthread_mutex_lock(&e->mu);
    const fmc_region *r = NULL; /* consecutive tasks mostly share a region: try the last one first */
    for (int i = 0; i < n; i++) {
        cuda_dev[i] = -1;
        if (len[i] == 0)
            continue;
        if (!r || !fmc_region_holds(r, addr[i], len[i]))
            r = fmc_registry_find(&e->reg, addr[i], len[i]);
        if (!r || (need_write && !r->writable)) { /* a read lands with memcpy: needs write */
            pthread_mutex_unlock(&e->mu);
            *bad_index = i;
            return 0;
        }
        cuda_dev[i] = r->cuda_dev;
    }
    pthread_mutex_unlock(&e->mu);
    return 1;
}
