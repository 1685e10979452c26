/* LD_PRELOAD shim: a kernel before Linux 6.15, which refuses the per-socket TCP_RTO_MIN_US (45)
 * and TCP_DELACK_MAX_US (46) options with ENOPROTOOPT; every other option goes to libc. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>

int setsockopt(int fd, int level, int name, const void *value, socklen_t len)
{
    static int (*real)(int, int, int, const void *, socklen_t);
    if (level == IPPROTO_TCP && (name == 45 || name == 46)) {
        errno = ENOPROTOOPT;
        return -1;
    }
    if (!real)
        real = (int (*)(int, int, int, const void *, socklen_t))dlsym(RTLD_NEXT, "setsockopt");
    return real(fd, level, name, value, len);
}
