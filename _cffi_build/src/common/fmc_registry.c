/* Registered regions: a sorted, non-overlapping array searched by binary search, and beside it
 * the same regions in registration order (Mooncake describes a segment's buffers in that order,
 * and get_first_buffer_address means the first one registered).  Every access happens under
 * engine->mu; regions are pinned (refs) while remote operations touch them, so that unregister
 * can wait until nobody does. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fmc_internal.h"

/* Index of the last region whose addr <= a, or -1. */
static int floor_index(const fmc_registry *reg, uint64_t a)
{
    int lo = 0, hi = reg->count - 1, ans = -1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (reg->items[mid]->addr <= a) {
            ans = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return ans;
}

fmc_region *fmc_registry_find(fmc_registry *reg, uint64_t addr, uint64_t len)
{
    if (len == 0 || addr + len < addr) /* empty or wraps around 2^64 */
        return NULL;
    int i = floor_index(reg, addr);
    if (i < 0)
        return NULL;
    fmc_region *r = reg->items[i];
    return fmc_region_holds(r, addr, len) ? r : NULL;
}

int fmc_registry_add(fmc_registry *reg, uint64_t addr, uint64_t len, uint32_t key, int writable)
{
    if (len == 0 || addr + len < addr) {
        fmc_set_error("invalid region [0x%llx, +%llu)", (unsigned long long)addr,
                      (unsigned long long)len);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    int i = floor_index(reg, addr + len - 1);
    /* The candidate overlapping region is the one starting at or before the last byte. */
    if (i >= 0 && reg->items[i]->addr + reg->items[i]->len > addr) {
        fmc_set_error("region [0x%llx, +%llu) overlaps registered [0x%llx, +%llu)",
                      (unsigned long long)addr, (unsigned long long)len,
                      (unsigned long long)reg->items[i]->addr,
                      (unsigned long long)reg->items[i]->len);
        return FMC_ERR_ADDRESS_OVERLAPPED;
    }
    if (reg->count == reg->cap) {
        int ncap = reg->cap ? reg->cap * 2 : 16;
        fmc_region **n = realloc(reg->items, (size_t)ncap * sizeof *n);
        if (!n)
            return FMC_ERR_MEMORY;
        reg->items = n;
        fmc_region **o = realloc(reg->order, (size_t)ncap * sizeof *o);
        if (!o)
            return FMC_ERR_MEMORY; /* items grew alone: harmless, cap still says the smaller */
        reg->order = o;
        reg->cap = ncap;
    }
    fmc_region *r = calloc(1, sizeof *r);
    if (!r)
        return FMC_ERR_MEMORY;
    r->addr = addr;
    r->len = len;
    r->key = key;
    r->writable = writable;
    r->seq = reg->next_seq++;
    int pos = i + 1;
    memmove(reg->items + pos + 1, reg->items + pos, (size_t)(reg->count - pos) * sizeof *reg->items);
    reg->items[pos] = r;
    reg->order[reg->count] = r; /* the newest: seq grows, so `order` stays sorted by it */
    reg->count++;
    return FMC_OK;
}

fmc_region *fmc_registry_remove(fmc_registry *reg, uint64_t addr)
{
    int i = floor_index(reg, addr);
    if (i < 0 || reg->items[i]->addr != addr)
        return NULL;
    fmc_region *r = reg->items[i];
    memmove(reg->items + i, reg->items + i + 1, (size_t)(reg->count - i - 1) * sizeof *reg->items);
    int lo = 0, hi = reg->count - 1; /* its place in `order`, by seq */
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (reg->order[mid]->seq < r->seq)
            lo = mid + 1;
        else
            hi = mid;
    }
    memmove(reg->order + lo, reg->order + lo + 1, (size_t)(reg->count - lo - 1) * sizeof *reg->order);
    reg->count--;
    __atomic_store_n(&r->removed, 1, __ATOMIC_RELEASE); /* also read without the lock (server pin()) */
    return r;
}

void fmc_vmm_export_free(fmc_vmm_export *x)
{
    for (int i = 0; x && i < x->n; i++)
        close(x->fd[i]);
    free(x);
}

void fmc_region_free(fmc_region *r)
{
    if (r)
        fmc_vmm_export_free(r->vmm);
    free(r);
}

void fmc_registry_free(fmc_registry *reg)
{
    for (int i = 0; i < reg->count; i++)
        fmc_region_free(reg->items[i]);
    free(reg->items);
    free(reg->order);
    reg->items = reg->order = NULL;
    reg->count = reg->cap = 0;
}

/* Refuse ranges that are not mapped in this process, so a bad pointer is an error code rather
 * than a crash later.  mincore() fails with ENOMEM on any unmapped page and touches nothing. */
int fmc_check_mapped(uint64_t addr, uint64_t len)
{
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t start = addr & ~(page - 1);
    uint64_t end = addr + len;
    const uint64_t chunk_pages = 1u << 16;
    unsigned char *vec = malloc(chunk_pages);
    if (!vec)
        return FMC_ERR_MEMORY;
    int rc = FMC_OK;
    while (start < end) {
        uint64_t pages = (end - start + page - 1) / page;
        if (pages > chunk_pages)
            pages = chunk_pages;
        if (mincore((void *)(uintptr_t)start, pages * page, vec) != 0) {
            fmc_set_error("memory [0x%llx, +%llu) is not mapped in this process",
                          (unsigned long long)addr, (unsigned long long)len);
            rc = FMC_ERR_INVALID_ARGUMENT;
            break;
        }
        start += pages * page;
    }
    free(vec);
    return rc;
}

/* A remote write lands with memcpy (the buffered part of its payload), so a region mapped
 * read-only (say a PROT_READ file mapping registered to serve reads) would crash this process
 * with SIGSEGV on the first remote write.  Walk /proc/self/maps once, at registration, and
 * require the whole range to be covered by writable mappings. */
int fmc_range_writable(uint64_t addr, uint64_t len)
{
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f)
        return 1; /* cannot tell (no /proc): allow the writes rather than refuse them all */
    uint64_t want = addr, end = addr + len; /* caller checked that it does not wrap */
    char line[512];
    while (want < end && fgets(line, sizeof line, f)) {
        unsigned long long lo, hi;
        char perms[8];
        if (sscanf(line, "%llx-%llx %7s", &lo, &hi, perms) != 3)
            continue;
        size_t n = strlen(line);
        while (n && line[n - 1] != '\n' && fgets(line, sizeof line, f)) /* skip a long path */
            n = strlen(line);
        if (hi <= want)
            continue;
        if (lo > want || perms[1] != 'w')
            break; /* a hole or a non-writable map inside the range (maps are sorted) */
        want = hi;
    }
    fclose(f);
    return want >= end;
}

/* The region starting at addr with that registration key, or NULL.  Caller holds e->mu. */
fmc_region *fmc_region_at_locked(fmc_engine *e, uint64_t addr, uint32_t key)
{
    fmc_region *r = fmc_registry_find(&e->reg, addr, 1);
    return r && r->addr == addr && r->key == key ? r : NULL;
}

fmc_region *fmc_region_pin(fmc_engine *e, uint64_t addr, uint32_t key)
{
    pthread_mutex_lock(&e->mu);
    fmc_region *r = fmc_region_at_locked(e, addr, key);
    if (r)
        r->refs++;
    pthread_mutex_unlock(&e->mu);
    return r;
}

void fmc_region_unpin(fmc_engine *e, fmc_region *r)
{
    pthread_mutex_lock(&e->mu);
    if (--r->refs == 0 && r->removed)
        pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}
