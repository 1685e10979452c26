/* TCP sockets of the data plane: listening, connecting with a deadline, and the options every
 * data connection gets. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fmc_internal.h"

/* Whether both ends of a connected socket are on this host: a loopback peer, or the peer's
 * address is our own (traffic to a local address goes through the loopback device too). */
int fmc_socket_is_local(int fd)
{
    struct sockaddr_storage me, peer;
    socklen_t me_len = sizeof me, peer_len = sizeof peer;
    if (getsockname(fd, (struct sockaddr *)&me, &me_len) < 0 ||
        getpeername(fd, (struct sockaddr *)&peer, &peer_len) < 0 || me.ss_family != peer.ss_family)
        return 0;
    if (peer.ss_family == AF_INET) {
        const struct sockaddr_in *a = (const void *)&me, *b = (const void *)&peer;
        return (ntohl(b->sin_addr.s_addr) >> 24) == 127 || a->sin_addr.s_addr == b->sin_addr.s_addr;
    }
    if (peer.ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const void *)&me, *b = (const void *)&peer;
        const uint8_t *v4 = b->sin6_addr.s6_addr + 12;
        return IN6_IS_ADDR_LOOPBACK(&b->sin6_addr) || (IN6_IS_ADDR_V4MAPPED(&b->sin6_addr) && v4[0] == 127) ||
               memcmp(&a->sin6_addr, &b->sin6_addr, sizeof a->sin6_addr) == 0;
    }
    return 0;
}

/* Per-socket TCP timers (Linux 6.15+; older headers lack the names). */
#ifndef TCP_RTO_MIN_US
#define TCP_RTO_MIN_US 45
#endif
#ifndef TCP_DELACK_MAX_US
#define TCP_DELACK_MAX_US 46
#endif

/* A lost packet that no later packet reveals (the tail of a call on each of its streams) waits for
 * the retransmission timer, at least 200 ms by default: a call of a few milliseconds then lasts
 * 40 times longer.  A datacenter's round trips are tens of microseconds, so its RTO floor can be
 * milliseconds (as `ip route ... rto_min` sets per route); the delayed-ACK ceiling bounds how long
 * a receiver sits on the ACK a tail loss probe is waiting for.
 *
 * They are set before the handshake (on the listening socket, whose connections inherit them, and
 * on a connecting socket before connect): the kernel's variance estimate starts at the RTO floor in
 * force at the first RTT sample and decays only a quarter per round trip, so options set after
 * the handshake leave the RTO near 200 ms for hundreds of round trips.  Connections within this
 * host get them too (which host a listener's next connection comes from is not known before its
 * handshake); loopback loses no packet, so there they never fire.  The kernel
 * rounds up to its timer tick and refuses values below about a tick (then the value is doubled
 * until it is taken); a kernel before 6.15 refuses the options altogether, and connections keep
 * its defaults. */
static void set_tcp_timer(int fd, int option, int us)
{
    for (; us > 0 && us <= 200000; us *= 2)
        if (setsockopt(fd, IPPROTO_TCP, option, &us, sizeof us) == 0 || errno != EINVAL)
            return;
}

void fmc_tcp_timers_early(int fd, const fmc_options *o)
{
    set_tcp_timer(fd, TCP_RTO_MIN_US, o->rto_min_us);
    set_tcp_timer(fd, TCP_DELACK_MAX_US, o->delack_max_us);
}

int fmc_tcp_timer_options_supported(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    int v = 200000; /* the kernel's own floor: valid wherever the option exists */
    int ok = setsockopt(fd, IPPROTO_TCP, TCP_RTO_MIN_US, &v, sizeof v) == 0 &&
             setsockopt(fd, IPPROTO_TCP, TCP_DELACK_MAX_US, &v, sizeof v) == 0;
    close(fd);
    return ok;
}

/* A connection within this host never meets a network, so congestion control has nothing to
 * control; BBR (the default on many hosts, this VM's too) still paces every send with timers,
 * which cost 9-37 % of loopback throughput on 2 cores. Such connections use reno (always built
 * in, and allowed to unprivileged processes) by default; an engine's local_cc option
 * (FLAGCX_MC_LOCAL_CC) names another, or "" keeps the host's default. Connections to other hosts
 * keep the host's choice.
 *
 * Every connection: TCP_NODELAY for small requests; keepalive and a user timeout so that a
 * connection to a host that vanished (no FIN, no RST: a cut cable, a crashed machine) ends within
 * about 30 s instead of holding its fd, thread and buffers forever. */
void fmc_tune_socket_opts(int fd, const fmc_options *opts)
{
    int one = 1, idle = 15, interval = 5, count = 3;
    unsigned int user_timeout_ms = 30000;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
    if (*opts->local_cc && fmc_socket_is_local(fd))
        setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, opts->local_cc, (socklen_t)strlen(opts->local_cc));
}

/* A port in [lo, hi], or -1 (error set) without random bytes. */
static int random_port(int lo, int hi)
{
    uint32_t r = 0;
    if (fmc_random_bytes(&r, sizeof r) < 0)
        return -1;
    return lo + (int)(r % (uint32_t)(hi - lo + 1));
}

/* Bind a listening socket on host.  port_min == port_max == 0: the kernel chooses.  Otherwise up
 * to 500 random ports in [port_min, port_max] are tried, as Mooncake does. */
/* Hundreds of initiators connecting their streams at once must not overflow the backlog: a
 * dropped SYN waits a second for its retransmission.  The kernel caps it at somaxconn. */
#define SOMAXCONN_WANTED 4096

int fmc_tcp_listen(const char *host, int port_min, int port_max, int *port_out)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int rc = getaddrinfo(host && *host ? host : NULL, "0", &hints, &res);
    if (rc != 0) {
        fmc_set_error("cannot resolve bind address '%s': %s", host ? host : "", gai_strerror(rc));
        return FMC_ERR_DNS;
    }
    int attempts = (port_min == 0 && port_max == 0) ? 1 : 500;
    int last_errno = 0;
    for (int i = 0; i < attempts; i++) {
        int port = (port_min == 0 && port_max == 0) ? 0 : random_port(port_min, port_max);
        if (port < 0) {
            freeaddrinfo(res);
            return FMC_ERR_NOT_IMPLEMENTED;
        }
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
            if (fd < 0) {
                last_errno = errno;
                continue;
            }
            int one = 1;
            setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            if (ai->ai_family == AF_INET6)
                ((struct sockaddr_in6 *)ai->ai_addr)->sin6_port = htons((uint16_t)port);
            else
                ((struct sockaddr_in *)ai->ai_addr)->sin_port = htons((uint16_t)port);
            if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, SOMAXCONN_WANTED) == 0) {
                struct sockaddr_storage ss;
                socklen_t sl = sizeof ss;
                getsockname(fd, (struct sockaddr *)&ss, &sl);
                *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                                     : ntohs(((struct sockaddr_in *)&ss)->sin_port);
                freeaddrinfo(res);
                return fd;
            }
            last_errno = errno;
            close(fd);
        }
    }
    freeaddrinfo(res);
    fmc_set_error("cannot bind a data port on '%s' in [%d, %d]: %s", host ? host : "", port_min,
                  port_max, strerror(last_errno));
    return FMC_ERR_SOCKET;
}

/* Connect with a bounded wait; returns a blocking socket or a negative code. */
int fmc_tcp_connect_opts(const char *host, int port, int timeout_ms, const fmc_options *opts)
{
    struct addrinfo hints, *res = NULL;
    char service[16];
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    snprintf(service, sizeof service, "%d", port);
    int rc = getaddrinfo(host, service, &hints, &res);
    if (rc != 0) {
        fmc_set_error("cannot resolve '%s': %s", host, gai_strerror(rc));
        return FMC_ERR_DNS;
    }
    int64_t deadline = fmc_now_ms() + timeout_ms;
    int err = ETIMEDOUT;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        fmc_tcp_timers_early(fd, opts);
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno != EINPROGRESS) {
            err = errno;
            close(fd);
            continue;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        int64_t left = deadline - fmc_now_ms();
        int pr = left > 0 ? poll(&pfd, 1, (int)left) : 0;
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (pr == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 && soerr == 0) {
            int flags = fcntl(fd, F_GETFL);
            fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
            fmc_tune_socket_opts(fd, opts);
            freeaddrinfo(res);
            return fd;
        }
        err = pr == 1 ? soerr : ETIMEDOUT;
        close(fd);
    }
    freeaddrinfo(res);
    fmc_set_error("cannot connect to %s:%d: %s", host, port, strerror(err));
    return err == ETIMEDOUT ? FMC_ERR_TIMEOUT : FMC_ERR_SOCKET;
}
