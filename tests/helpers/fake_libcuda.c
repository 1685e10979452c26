/* A fake CUDA driver for the CPU machine: the calls the core makes, over host memory, strict where
 * the real driver's rules decide which device the core touches.  Loaded through FLAGCX_MC_LIBCUDA.
 *
 *   FAKE_CUDA_UUIDS  comma-separated 32-hex-digit UUIDs: the devices this process sees, in
 *                    ordinal order (what CUDA_VISIBLE_DEVICES decides on a real host)
 *   FAKE_CUDA_IPC_FAIL=1  cuIpcOpenMemHandle refuses every handle (a driver or kernel that will not map)
 *   FAKE_CUDA_LAZY=1  copies are asynchronous, as on a GPU that is slow: cuMemcpyAsync only queues
 *                    a copy on its stream; it runs when the stream is synchronised, an event recorded
 *                    behind it is synchronised, or the stream is destroyed, and cuEventQuery says
 *                    "not ready" until then.  A caller that uses staging or destination bytes before
 *                    waiting for their copy sees stale bytes.
 *   FAKE_CUDA_SYNC_SPIN_US=N  every stream or event synchronise takes at least N microseconds,
 *                    busy (a device whose copies are slow, and a waiter that never sleeps)
 *   FAKE_CUDA_LOG    a file that gets one line per event: "retain <uuid>" (a primary context
 *                    retained), "pinned <uuid>" (pinned host memory made under that device's
 *                    context), "nocontext <call>" (a call that needs a current context had none),
 *                    "ipcopen <uuid>" (a peer's handle opened under that device's context),
 *                    "wrongdevice <call>" (a copy on another device's stream, or a handle of a
 *                    GPU this process does not see)
 *
 * Device memory is a memfd mapped twice: at the address handed out with no access (the CPU
 * cannot touch GPU memory, nor can process_vm_writev), and once more readable and writable for
 * the fake's own copies.  The memfd is what lets a CUDA IPC handle (pid, fd, size, UUID)
 * opens in another process through /proc/<pid>/fd, under the current context's device, if the
 * handle's GPU is one this process sees (as peer access lets the real driver).  Pointer queries
 * need no context, as on the real driver. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MAXDEV 16
#define MAXALLOC 256
#define OK 0
#define E_INVALID_VALUE 1
#define E_NOT_INITIALIZED 3
#define E_INVALID_DEVICE 101
#define E_INVALID_CONTEXT 201
#define E_INVALID_HANDLE 400

typedef struct {
    int dev, retained;
} fake_ctx;
typedef struct {
    uint64_t dst, src;
    size_t len;
} fake_copy;
typedef struct {
    int dev;
    pthread_mutex_t mu;
    fake_copy *q; /* lazy mode: queued copies, [done, n) not run yet */
    size_t n, cap, done;
} fake_stream;
typedef struct {
    fake_stream *s;
    size_t upto; /* the copies queued before the record */
    int dev;
} fake_event;
typedef struct {
    uint64_t base, size; /* the "device address": mapped PROT_NONE, as GPU memory is to the CPU */
    char *shadow;        /* the same pages, readable and writable: what the fake copies through */
    int dev, fd, opened; /* opened: a peer's memory mapped by cuIpcOpenMemHandle */
} fake_alloc;
typedef struct {
    uint32_t magic;
    int32_t pid, fd;
    uint64_t size;
    uint8_t uuid[16];
} fake_ipc;

static int ndev = -1;
static uint8_t uuids[MAXDEV][16];
static fake_ctx ctxs[MAXDEV];
static fake_alloc allocs[MAXALLOC];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread fake_ctx *current;

static void note(const char *fmt, ...)
{
    const char *path = getenv("FAKE_CUDA_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (!f)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}

static const char *hex(int dev)
{
    static __thread char s[33];
    for (int i = 0; i < 16; i++)
        sprintf(s + 2 * i, "%02x", uuids[dev][i]);
    return s;
}

static int need_ctx(const char *call)
{
    if (current)
        return 1;
    note("nocontext %s", call);
    return 0;
}

int cuInit(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    if (ndev < 0) {
        ndev = 0;
        const char *s = getenv("FAKE_CUDA_UUIDS");
        while (s && *s && ndev < MAXDEV) {
            for (int i = 0; i < 16; i++) {
                unsigned v = 0;
                if (sscanf(s + 2 * i, "%2x", &v) != 1)
                    v = 0;
                uuids[ndev][i] = (uint8_t)v;
            }
            ctxs[ndev].dev = ndev;
            ndev++;
            s = strchr(s, ',');
            s = s ? s + 1 : NULL;
        }
    }
    pthread_mutex_unlock(&mu);
    return OK;
}

int cuDeviceGetCount(int *n)
{
    *n = ndev < 0 ? 0 : ndev;
    return ndev < 0 ? E_NOT_INITIALIZED : OK;
}

int cuDeviceGet(int *dev, int ordinal)
{
    if (ordinal < 0 || ordinal >= ndev)
        return E_INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}

int cuDeviceGetUuid(uint8_t *uuid, int dev)
{
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    memcpy(uuid, uuids[dev], 16);
    return OK;
}

int cuDeviceGetUuid_v2(uint8_t *uuid, int dev) { return cuDeviceGetUuid(uuid, dev); }

int cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    ctxs[dev].retained++;
    pthread_mutex_unlock(&mu);
    note("retain %s", hex(dev));
    *ctx = &ctxs[dev];
    return OK;
}

int cuDevicePrimaryCtxGetState(int dev, unsigned int *flags, int *active)
{
    if (dev < 0 || dev >= ndev)
        return E_INVALID_DEVICE;
    *flags = 0;
    *active = ctxs[dev].retained > 0;
    return OK;
}

int cuCtxSetCurrent(void *ctx)
{
    current = ctx;
    return OK;
}

static fake_alloc *find(uint64_t p)
{
    for (int i = 0; i < MAXALLOC; i++)
        if (allocs[i].size && p >= allocs[i].base && p < allocs[i].base + allocs[i].size)
            return &allocs[i];
    return NULL;
}

/* Map `fd` as device memory of `dev` (the current context's); its address, or 0. */
static uint64_t map_device(int fd, uint64_t size, int dev, int opened)
{
    void *base = mmap(NULL, size, PROT_NONE, MAP_SHARED, fd, 0);
    void *shadow = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED || shadow == MAP_FAILED) {
        if (base != MAP_FAILED)
            munmap(base, size);
        if (shadow != MAP_FAILED)
            munmap(shadow, size);
        return 0;
    }
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXALLOC; i++)
        if (!allocs[i].size) {
            allocs[i] = (fake_alloc){(uint64_t)(uintptr_t)base, size, shadow, dev, fd, opened};
            break;
        }
    pthread_mutex_unlock(&mu);
    return (uint64_t)(uintptr_t)base;
}

/* Where the fake reads or writes `p`: the shadow of device memory, host memory as it is. */
static void *cpu_view(uint64_t p)
{
    pthread_mutex_lock(&mu);
    fake_alloc *a = find(p);
    void *v = a ? a->shadow + (p - a->base) : (void *)(uintptr_t)p;
    pthread_mutex_unlock(&mu);
    return v;
}

int cuPointerGetAttribute(void *data, int attr, uint64_t p)
{
    pthread_mutex_lock(&mu);
    fake_alloc *a = find(p);
    int dev = a ? a->dev : -1;
    pthread_mutex_unlock(&mu);
    if (!a)
        return E_INVALID_VALUE; /* host memory the driver does not know */
    switch (attr) {
    case 2: /* memory type */
        *(unsigned int *)data = 2;
        return OK;
    case 9: /* device ordinal */
        *(int *)data = dev;
        return OK;
    case 10: /* legacy IPC capable */
        *(int *)data = 1;
        return OK;
    default:
        return E_INVALID_VALUE;
    }
}

int cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t p)
{
    if (!need_ctx("cuMemGetAddressRange"))
        return E_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    fake_alloc *a = find(p);
    if (a) {
        *base = a->base;
        *size = a->size;
    }
    pthread_mutex_unlock(&mu);
    return a ? OK : E_INVALID_VALUE;
}

int cuMemAlloc_v2(uint64_t *p, size_t size)
{
    if (!need_ctx("cuMemAlloc"))
        return E_INVALID_CONTEXT;
    int fd = memfd_create("fake-gpu", MFD_CLOEXEC);
    uint64_t base = fd >= 0 && ftruncate(fd, (off_t)size) == 0 ? map_device(fd, size, current->dev, 0) : 0;
    if (!base) {
        if (fd >= 0)
            close(fd);
        return 2; /* out of memory */
    }
    *p = base;
    return OK;
}

static int drop(uint64_t p, int opened)
{
    pthread_mutex_lock(&mu);
    fake_alloc *a = find(p);
    fake_alloc gone = a && a->base == p && a->opened == opened ? *a : (fake_alloc){0};
    if (gone.size)
        a->size = 0;
    pthread_mutex_unlock(&mu);
    if (!gone.size)
        return E_INVALID_VALUE;
    munmap((void *)(uintptr_t)gone.base, gone.size);
    munmap(gone.shadow, gone.size);
    close(gone.fd);
    return OK;
}

int cuMemFree_v2(uint64_t p) { return need_ctx("cuMemFree") ? drop(p, 0) : E_INVALID_CONTEXT; }

int cuMemHostAlloc(void **p, size_t size, unsigned int flags)
{
    (void)flags;
    if (!need_ctx("cuMemHostAlloc"))
        return E_INVALID_CONTEXT;
    note("pinned %s", hex(current->dev));
    *p = malloc(size);
    return *p ? OK : 2;
}

int cuMemFreeHost(void *p)
{
    if (!need_ctx("cuMemFreeHost"))
        return E_INVALID_CONTEXT;
    free(p);
    return OK;
}

int cuIpcGetMemHandle(void *handle, uint64_t p)
{
    if (!need_ctx("cuIpcGetMemHandle"))
        return E_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    fake_alloc *a = find(p);
    fake_ipc h = {0};
    if (a && a->base == p && !a->opened)
        h = (fake_ipc){0x46414b45, getpid(), a->fd, a->size, {0}};
    int dev = a ? a->dev : 0;
    pthread_mutex_unlock(&mu);
    if (!h.magic)
        return E_INVALID_VALUE;
    memcpy(h.uuid, uuids[dev], 16);
    memset(handle, 0, 64);
    memcpy(handle, &h, sizeof h);
    return OK;
}

typedef struct {
    char bytes[64];
} fake_handle_arg;

int cuIpcOpenMemHandle_v2(uint64_t *p, fake_handle_arg handle, unsigned int flags)
{
    (void)flags;
    fake_ipc h;
    memcpy(&h, handle.bytes, sizeof h);
    if (!need_ctx("cuIpcOpenMemHandle"))
        return E_INVALID_CONTEXT;
    const char *fail = getenv("FAKE_CUDA_IPC_FAIL");
    if ((fail && *fail == '1') || h.magic != 0x46414b45)
        return E_INVALID_HANDLE;
    int visible = 0;
    for (int d = 0; d < ndev; d++)
        visible |= memcmp(h.uuid, uuids[d], 16) == 0;
    if (!visible) {
        note("wrongdevice cuIpcOpenMemHandle");
        return E_INVALID_DEVICE;
    }
    note("ipcopen %s", hex(current->dev));
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", h.pid, h.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    uint64_t base = fd >= 0 ? map_device(fd, h.size, current->dev, 1) : 0;
    if (!base) {
        if (fd >= 0)
            close(fd);
        return E_INVALID_HANDLE;
    }
    *p = base;
    return OK;
}

int cuIpcCloseMemHandle(uint64_t p) { return drop(p, 1); }

static int lazy(void)
{
    const char *v = getenv("FAKE_CUDA_LAZY");
    return v && *v == '1';
}

static void slow_sync(void)
{
    const char *v = getenv("FAKE_CUDA_SYNC_SPIN_US");
    long us = v ? atol(v) : 0;
    if (us <= 0)
        return;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do
        clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000L + (t.tv_nsec - t0.tv_nsec) / 1000 < us);
}

int cuStreamCreate(void **stream, unsigned int flags)
{
    (void)flags;
    if (!need_ctx("cuStreamCreate"))
        return E_INVALID_CONTEXT;
    fake_stream *s = calloc(1, sizeof *s);
    if (!s)
        return 2;
    s->dev = current->dev;
    pthread_mutex_init(&s->mu, NULL);
    *stream = s;
    return OK;
}

/* Run the stream's queued copies up to `upto`, in order. */
static void run_until(fake_stream *s, size_t upto)
{
    pthread_mutex_lock(&s->mu);
    for (; s->done < upto && s->done < s->n; s->done++) {
        fake_copy *c = &s->q[s->done];
        memmove(cpu_view(c->dst), cpu_view(c->src), c->len);
    }
    pthread_mutex_unlock(&s->mu);
}

int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t len, void *stream)
{
    if (!need_ctx("cuMemcpyAsync"))
        return E_INVALID_CONTEXT;
    fake_stream *s = stream;
    if (s->dev != current->dev) {
        note("wrongdevice cuMemcpyAsync");
        return E_INVALID_HANDLE;
    }
    if (!lazy()) {
        memmove(cpu_view(dst), cpu_view(src), len);
        return OK;
    }
    pthread_mutex_lock(&s->mu);
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        fake_copy *q = realloc(s->q, cap * sizeof *q);
        if (!q) {
            pthread_mutex_unlock(&s->mu);
            return 2;
        }
        s->q = q;
        s->cap = cap;
    }
    s->q[s->n++] = (fake_copy){dst, src, len};
    pthread_mutex_unlock(&s->mu);
    return OK;
}

int cuStreamSynchronize(void *stream)
{
    if (!need_ctx("cuStreamSynchronize"))
        return E_INVALID_CONTEXT;
    slow_sync();
    run_until(stream, (size_t)-1);
    return OK;
}

int cuStreamDestroy_v2(void *stream)
{
    fake_stream *s = stream;
    run_until(s, (size_t)-1); /* queued work still completes */
    pthread_mutex_destroy(&s->mu);
    free(s->q);
    free(s);
    return OK;
}

int cuEventCreate(void **ev, unsigned int flags)
{
    (void)flags;
    if (!need_ctx("cuEventCreate"))
        return E_INVALID_CONTEXT;
    fake_event *e = calloc(1, sizeof *e);
    if (!e)
        return 2;
    e->dev = current->dev;
    *ev = e;
    return OK;
}

int cuEventRecord(void *ev, void *stream)
{
    fake_event *e = ev;
    fake_stream *s = stream;
    if (!need_ctx("cuEventRecord"))
        return E_INVALID_CONTEXT;
    if (s->dev != e->dev || s->dev != current->dev) {
        note("wrongdevice cuEventRecord");
        return E_INVALID_HANDLE;
    }
    pthread_mutex_lock(&s->mu);
    e->s = s;
    e->upto = s->n;
    pthread_mutex_unlock(&s->mu);
    return OK;
}

int cuEventQuery(void *ev)
{
    fake_event *e = ev;
    if (!e->s)
        return OK;
    pthread_mutex_lock(&e->s->mu);
    int ready = e->s->done >= e->upto;
    pthread_mutex_unlock(&e->s->mu);
    return ready ? OK : 600; /* CUDA_ERROR_NOT_READY */
}

int cuEventSynchronize(void *ev)
{
    fake_event *e = ev;
    slow_sync();
    if (e->s)
        run_until(e->s, e->upto);
    return OK;
}

int cuEventDestroy_v2(void *ev)
{
    free(ev);
    return OK;
}
