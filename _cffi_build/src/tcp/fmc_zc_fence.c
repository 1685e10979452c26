/* The fence of zero-copy sends (fmc_splice.c) within one host.
 *
 * A spliced write payload is not copied into the socket: the target's socket holds references
 * to the caller's pages, and the target's recv copies out of them whenever it runs.  A call that
 * fails or is cancelled while its target is stopped (SIGSTOP, a debugger, a long pause) would
 * otherwise return while those references are still queued, and a source rewritten afterwards
 * would reach the target when it resumes.  So before a zero-copy stream's socket is closed, the
 * initiator takes the target's end of the connection (pidfd_getfd: the same permission that
 * process_vm_writev needs), resets the connection, and discards whatever the target has not
 * read yet.  Its recv takes the socket's lock, so a target thread copying at that moment
 * finishes first; afterwards the target finds the connection reset and empty.
 *
 * The target's end is found once, when a stream connects: its fd number is the one whose socket
 * has our socket's addresses swapped.  Zero-copy sends are used only on streams where it was
 * found; elsewhere write payloads are copied into the socket, which needs no fence. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fmc_internal.h"

typedef struct {
    struct sockaddr_storage addr;
    socklen_t len;
} sock_name;

static int same_name(const sock_name *a, const sock_name *b)
{
    return a->len == b->len && memcmp(&a->addr, &b->addr, a->len) == 0;
}

/* Our socket's local and peer names. */
static int names_of(int fd, sock_name *local, sock_name *peer)
{
    local->len = peer->len = sizeof(struct sockaddr_storage);
    memset(&local->addr, 0, sizeof local->addr);
    memset(&peer->addr, 0, sizeof peer->addr);
    return getsockname(fd, (struct sockaddr *)&local->addr, &local->len) == 0 &&
                   getpeername(fd, (struct sockaddr *)&peer->addr, &peer->len) == 0
               ? 0
               : -1;
}

/* Whether `theirs` (a copy of a target's fd) is the far end of our socket named (local, peer). */
static int is_far_end(int theirs, const sock_name *local, const sock_name *peer)
{
    sock_name tl, tp;
    return names_of(theirs, &tl, &tp) == 0 && same_name(&tl, peer) && same_name(&tp, local);
}

void fmc_zc_fence_attach(fmc_peer *p, fmc_stream *const *streams, int n)
{
    if (n == 0 || p->owner_pid <= 0 || !fmc_zc_enabled(p->engine))
        return;
    int pidfd = fmc_pidfd_open(p->owner_pid);
    if (pidfd < 0)
        return;
    sock_name local[FMC_MAX_STREAMS], peer[FMC_MAX_STREAMS];
    int found[FMC_MAX_STREAMS] = {0};
    int missing = 0;
    for (int i = 0; i < n; i++) {
        found[i] = names_of(streams[i]->fd, &local[i], &peer[i]) == 0 ? -1 : -2; /* -2: never */
        missing += found[i] == -1;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", p->owner_pid);
    DIR *d = missing ? opendir(path) : NULL;
    for (struct dirent *ent; d && missing && (ent = readdir(d));) {
        char *end;
        long fdn = strtol(ent->d_name, &end, 10);
        if (*end || end == ent->d_name || fdn < 0)
            continue;
        /* Only its sockets are taken (briefly, to compare addresses): a process named by a
         * descriptor from another pid namespace is then at most looked at, never disturbed. */
        char link[64], target[32];
        snprintf(link, sizeof link, "%s/%ld", path, fdn);
        ssize_t tl = readlink(link, target, sizeof target - 1);
        if (tl < 8 || memcmp(target, "socket:[", 8) != 0)
            continue;
        int theirs = fmc_pidfd_getfd(pidfd, (int)fdn);
        if (theirs < 0)
            continue; /* not allowed (then no other fd is either), or gone meanwhile */
        for (int i = 0; i < n; i++) {
            if (found[i] == -1 && is_far_end(theirs, &local[i], &peer[i])) {
                found[i] = (int)fdn;
                missing--;
                break;
            }
        }
        close(theirs);
    }
    if (d)
        closedir(d);
    close(pidfd);
    for (int i = 0; i < n; i++) {
        if (found[i] < 0)
            continue;
        pthread_mutex_lock(&streams[i]->mu);
        streams[i]->target_fd = found[i];
        streams[i]->zc_link = 1;
        pthread_mutex_unlock(&streams[i]->mu);
    }
}

/* Discard what the target's socket still holds (it was reset: no more can come). */
static void discard_queued(int theirs)
{
    char scratch[4096];
    for (int rounds = 0; rounds < (1 << 16); rounds++) {
        ssize_t r = recv(theirs, NULL, 64u << 20, MSG_DONTWAIT | MSG_TRUNC); /* TCP: dropped, not copied */
        if (r < 0 && errno == EFAULT)
            r = recv(theirs, scratch, sizeof scratch, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EINTR))
            return;
    }
}

void fmc_zc_fence_close(fmc_stream *st)
{
    int theirs = -1;
    sock_name local, peer;
    if (st->zc_link && st->target_fd >= 0 && st->peer->owner_pid > 0 && names_of(st->fd, &local, &peer) == 0) {
        int pidfd = fmc_pidfd_open(st->peer->owner_pid);
        if (pidfd >= 0) {
            theirs = fmc_pidfd_getfd(pidfd, st->target_fd);
            close(pidfd);
        }
        /* The fd number may name something else by now, if the target closed its end: then
         * its socket, and the references it held, are gone already. */
        if (theirs >= 0 && !is_far_end(theirs, &local, &peer)) {
            close(theirs);
            theirs = -1;
        }
    }
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(st->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(st->fd); /* the reset: our send queue, and the page references in it, are dropped */
    if (theirs >= 0) {
        st->peer->engine->stat_zc_fences++;
        discard_queued(theirs);
        close(theirs);
    }
}
