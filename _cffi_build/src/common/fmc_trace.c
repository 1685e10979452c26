/* The diagnostic event trace (fmc_internal.h, FMC_TR): compiled only with -DFMC_TRACE.  Events
 * go to one array, taken slot by slot with an atomic counter so that recording costs a clock
 * read and a store (it must not change the timing it measures); the first `events` given to
 * fmc_trace_configure (default 1M) are kept.  At exit the array is written to <prefix>.<pid>,
 * one line per event: "time_ns thread event a b".  The Python side configures it from
 * FMC_TRACE_FILE and FMC_TRACE_EVENTS (flagcx_mc.config.ProcessSettings). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "fmc_internal.h"

#ifndef FMC_TRACE
int fmc_trace_configure(const char *prefix, uint64_t events)
{
    (void)prefix;
    (void)events;
    return FMC_ERR_NOT_IMPLEMENTED; /* a build without the trace */
}
#else

typedef struct {
    uint64_t t_ns;
    uint32_t thread, event;
    uint64_t a, b;
} trace_entry;

static trace_entry *entries;
static uint64_t capacity, taken, wanted = 1u << 20;
static char dump_prefix[4096]; /* "": nothing written at exit */
static pthread_once_t once = PTHREAD_ONCE_INIT;
static __thread uint32_t thread_id;

static void trace_init(void)
{
    capacity = wanted;
    entries = calloc(capacity, sizeof *entries);
    if (!entries)
        capacity = 0;
}

/* Where the trace goes at exit and how many events it keeps; before the first event only. */
int fmc_trace_configure(const char *prefix, uint64_t events)
{
    if (!prefix || strlen(prefix) >= sizeof dump_prefix)
        return FMC_ERR_INVALID_ARGUMENT;
    snprintf(dump_prefix, sizeof dump_prefix, "%s", prefix);
    if (events > 0)
        wanted = events;
    return 0;
}

void fmc_trace(int event, uint64_t a, uint64_t b)
{
    pthread_once(&once, trace_init);
    uint64_t i = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
    if (i >= capacity)
        return;
    if (!thread_id)
        thread_id = (uint32_t)syscall(SYS_gettid);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    entries[i] = (trace_entry){(uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec, thread_id, (uint32_t)event,
                               a, b};
}

__attribute__((destructor)) static void trace_dump(void)
{
    const char *prefix = dump_prefix;
    if (!*prefix || !entries)
        return;
    char name[4096];
    snprintf(name, sizeof name, "%s.%d", prefix, (int)getpid());
    FILE *out = fopen(name, "w");
    if (!out)
        return;
    uint64_t n = taken < capacity ? taken : capacity;
    if (taken > capacity)
        fprintf(out, "# dropped %llu events past the %llu kept (FMC_TRACE_EVENTS)\n",
                (unsigned long long)(taken - capacity), (unsigned long long)capacity);
    for (uint64_t i = 0; i < n; i++)
        fprintf(out, "%llu %u %u %llu %llu\n", (unsigned long long)entries[i].t_ns, entries[i].thread,
                entries[i].event, (unsigned long long)entries[i].a, (unsigned long long)entries[i].b);
    fclose(out);
}
#endif
