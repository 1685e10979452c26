/* Random bytes for the core: nonces of the authentication exchange, region keys, data ports to
 * try.  Only the kernel's generator: a nonce or key that is predictable (rand(), the clock) or
 * left uninitialised would defeat what it is for, so a failure is reported, never papered over. */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/random.h>

#include "fmc_internal.h"

int fmc_random_bytes(void *p, size_t n)
{
    uint8_t *out = p;
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(out + got, n - got, 0);
        if (r > 0) {
            got += (size_t)r; /* a short read (large requests, a signal): ask for the rest */
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        fmc_set_error("cannot get random bytes from the kernel: %s", r < 0 ? strerror(errno) : "none returned");
        return -1;
    }
    return 0;
}
