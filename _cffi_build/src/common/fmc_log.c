/* The engine's message log: lines the core's threads leave for Python, which drains them. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "fmc_internal.h"

void fmc_engine_log(fmc_engine *e, const char *fmt, ...)
{
    char line[300];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if (n > (int)sizeof line - 2)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    pthread_mutex_lock(&e->log_mu);
    if (e->log_len + n <= FMC_LOG_CAP) { /* full: drop, the counters still tell */
        memcpy(e->log + e->log_len, line, (size_t)n);
        e->log_len += n;
    }
    pthread_mutex_unlock(&e->log_mu);
}

int fmc_engine_drain_log(fmc_engine *e, char *buf, int cap)
{
    if (!buf || cap <= 0) /* a negative cap would become a huge memcpy length */
        return 0;
    pthread_mutex_lock(&e->log_mu);
    int n = e->log_len < cap ? e->log_len : cap;
    memcpy(buf, e->log, (size_t)n);
    memmove(e->log, e->log + n, (size_t)(e->log_len - n));
    e->log_len -= n;
    pthread_mutex_unlock(&e->log_mu);
    return n;
}
