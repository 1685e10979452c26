/* GPU memory without a build-time CUDA dependency: libcuda is loaded with dlopen on first use.
 * A machine without it builds and runs every host path; device pointers are then simply not
 * recognised (registering one fails as unmapped memory, never crashes).
 *
 * The data plane never hands device pointers to the kernel: TCP stages GPU bytes through host
 * buffers (cuMemcpy with unified addressing picks the direction), and the same-host path leaves
 * GPU memory to TCP for now. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "fmc_internal.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct {
    char reserved[FMC_CUDA_IPC_HANDLE_SIZE];
} CUipcMemHandle;

#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEMORYTYPE_DEVICE 2
#define FMC_CUDA_MAX_DEVICES 64

static struct {
    int state; /* 0 untried, 1 usable, -1 unusable */
    void *lib;
    CUresult (*init)(unsigned int);
    CUresult (*pointer_get_attribute)(void *, int, CUdeviceptr);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*mem_get_address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*mem_alloc_host)(void **, size_t);
    CUresult (*mem_free_host)(void *);
    CUresult (*ipc_get_mem_handle)(void *, CUdeviceptr);
    CUresult (*ipc_open_mem_handle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
    CUresult (*ipc_close_mem_handle)(CUdeviceptr);
    CUresult (*stream_create)(void **, unsigned int);
    CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, void *);
    CUresult (*stream_synchronize)(void *);
    /* Optional (CUDA 12.8+): many copies in one call.  CUDA 13 names the form without failIdx
     * cuMemcpyBatchAsync_v2; older drivers have only the one with it. */
    CUresult (*batch_v2)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *, size_t, void *);
    CUresult (*batch_v1)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *, size_t, size_t *, void *);
    int batch_broken; /* the driver refused a batch once: copy one by one from then on */
    CUcontext ctx[FMC_CUDA_MAX_DEVICES];
    void *stream[FMC_CUDA_MAX_DEVICES];
} cu;

static pthread_mutex_t cu_mu = PTHREAD_MUTEX_INITIALIZER;

static int load(void)
{
    const char *names[] = {"libcuda.so.1", "libcuda.so"};
    for (size_t i = 0; i < 2 && !cu.lib; i++)
        cu.lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!cu.lib)
        return -1;
#define SYM(field, name)                                 \
    do {                                                 \
        *(void **)&cu.field = dlsym(cu.lib, name);       \
        if (!cu.field)                                   \
            return -1;                                   \
    } while (0)
    SYM(init, "cuInit");
    SYM(pointer_get_attribute, "cuPointerGetAttribute");
    SYM(device_get, "cuDeviceGet");
    SYM(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    SYM(ctx_set_current, "cuCtxSetCurrent");
    SYM(mem_get_address_range, "cuMemGetAddressRange_v2");
    SYM(mem_alloc_host, "cuMemAllocHost_v2");
    SYM(mem_free_host, "cuMemFreeHost");
    SYM(ipc_get_mem_handle, "cuIpcGetMemHandle");
    SYM(ipc_open_mem_handle, "cuIpcOpenMemHandle_v2");
    SYM(ipc_close_mem_handle, "cuIpcCloseMemHandle");
    SYM(stream_create, "cuStreamCreate");
    SYM(memcpy_async, "cuMemcpyAsync");
    SYM(stream_synchronize, "cuStreamSynchronize");
#undef SYM
    *(void **)&cu.batch_v2 = dlsym(cu.lib, "cuMemcpyBatchAsync_v2");
    if (!cu.batch_v2)
        *(void **)&cu.batch_v1 = dlsym(cu.lib, "cuMemcpyBatchAsync");
    return cu.init(0) == 0 ? 0 : -1;
}

int fmc_cuda_available(void)
{
    pthread_mutex_lock(&cu_mu);
    if (cu.state == 0)
        cu.state = load() == 0 ? 1 : -1;
    int ok = cu.state == 1;
    pthread_mutex_unlock(&cu_mu);
    return ok;
}

/* Make the device's primary context current in this thread (contexts are per thread). */
static int use_device(int device)
{
    if (device < 0 || device >= FMC_CUDA_MAX_DEVICES)
        return -1;
    pthread_mutex_lock(&cu_mu);
    if (!cu.ctx[device]) {
        CUdevice dev;
        if (cu.device_get(&dev, device) != 0 || cu.primary_ctx_retain(&cu.ctx[device], dev) != 0)
            cu.ctx[device] = NULL;
    }
    CUcontext ctx = cu.ctx[device];
    pthread_mutex_unlock(&cu_mu);
    return ctx && cu.ctx_set_current(ctx) == 0 ? 0 : -1;
}

int fmc_cuda_device_of(uint64_t addr, uint64_t len, int *device)
{
    *device = -1;
    if (!fmc_cuda_available() || use_device(0) != 0)
        return 0;
    unsigned int type = 0;
    int ordinal = -1;
    if (cu.pointer_get_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)addr) != 0 ||
        type != CU_MEMORYTYPE_DEVICE ||
        cu.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)addr) != 0)
        return 0;
    CUdeviceptr base = 0;
    size_t size = 0;
    if (use_device(ordinal) != 0 || cu.mem_get_address_range(&base, &size, (CUdeviceptr)addr) != 0 ||
        addr + len > base + size) {
        fmc_set_error("[0x%llx, +%llu) runs past the end of its GPU allocation", (unsigned long long)addr,
                      (unsigned long long)len);
        return -1;
    }
    *device = ordinal;
    return 1;
}

/* Copies go on our own non-blocking stream, one per device; waiting synchronises just that
 * stream (not the whole context, where the application's kernels run).  A plain cuMemcpy may
 * return before a device-to-device or pageable host-to-device copy has landed, and a transfer
 * must not report success before that. */
static void *stream_of(int device)
{
    if (use_device(device) != 0)
        return NULL;
    pthread_mutex_lock(&cu_mu);
    if (!cu.stream[device] && cu.stream_create(&cu.stream[device], 1 /* CU_STREAM_NON_BLOCKING */) != 0)
        cu.stream[device] = NULL;
    void *stream = cu.stream[device];
    pthread_mutex_unlock(&cu_mu);
    return stream;
}

int fmc_cuda_copy_async(uint64_t dst, uint64_t src, size_t len, int device)
{
    void *stream = stream_of(device);
    return stream && cu.memcpy_async((CUdeviceptr)dst, (CUdeviceptr)src, len, stream) == 0 ? FMC_OK
                                                                                         : FMC_ERR_DEVICE_NOT_FOUND;
}

/* CUmemcpyAttributes (cuda.h): source access order, source and destination location hints
 * (type, id), flags. */
typedef struct {
    int src_access_order;
    int src_loc_type, src_loc_id;
    int dst_loc_type, dst_loc_id;
    unsigned int flags;
} fmc_cu_memcpy_attributes;
#define FMC_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM 1

int fmc_cuda_copy_many_async(uint64_t *dst, uint64_t *src, size_t *len, int n, int device)
{
    /* Neighbours contiguous on both sides become one copy (KV pages often are). */
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m > 0 && dst[m - 1] + len[m - 1] == dst[i] && src[m - 1] + len[m - 1] == src[i]) {
            len[m - 1] += len[i];
            continue;
        }
        dst[m] = dst[i];
        src[m] = src[i];
        len[m] = len[i];
        m++;
    }
    void *stream = stream_of(device);
    if (!stream)
        return FMC_ERR_DEVICE_NOT_FOUND;
    if (m > 1 && !__atomic_load_n(&cu.batch_broken, __ATOMIC_RELAXED) && (cu.batch_v2 || cu.batch_v1)) {
        fmc_cu_memcpy_attributes attr = {.src_access_order = FMC_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM};
        size_t idx = 0, fail = 0;
        CUresult r = cu.batch_v2 ? cu.batch_v2((CUdeviceptr *)dst, (CUdeviceptr *)src, len, (size_t)m, &attr, &idx, 1, stream)
                                 : cu.batch_v1((CUdeviceptr *)dst, (CUdeviceptr *)src, len, (size_t)m, &attr, &idx, 1, &fail, stream);
        if (r == 0)
            return FMC_OK;
        /* Refused as a whole (no copy was queued): fall back, and do not ask again. */
        __atomic_store_n(&cu.batch_broken, 1, __ATOMIC_RELAXED);
    }
    for (int i = 0; i < m; i++)
        if (cu.memcpy_async((CUdeviceptr)dst[i], (CUdeviceptr)src[i], len[i], stream) != 0)
            return FMC_ERR_DEVICE_NOT_FOUND;
    return FMC_OK;
}

int fmc_cuda_wait(int device)
{
    void *stream = stream_of(device);
    return stream && cu.stream_synchronize(stream) == 0 ? FMC_OK : FMC_ERR_DEVICE_NOT_FOUND;
}

int fmc_cuda_copy(uint64_t dst, uint64_t src, size_t len, int device)
{
    int rc = fmc_cuda_copy_async(dst, src, len, device);
    int wait = fmc_cuda_wait(device);
    return rc != FMC_OK ? rc : wait;
}

/* Host staging memory: pinned when CUDA is there (faster copies), plain otherwise. */
void *fmc_staging_alloc(size_t len, int *pinned)
{
    *pinned = 0;
    if (fmc_cuda_available() && use_device(0) == 0) {
        void *p = NULL;
        if (cu.mem_alloc_host(&p, len) == 0) {
            *pinned = 1;
            return p;
        }
    }
    return malloc(len);
}

void fmc_staging_free(void *p, int pinned)
{
    if (!p)
        return;
    if (pinned)
        cu.mem_free_host(p);
    else
        free(p);
}

int fmc_cuda_usable(void) { return fmc_cuda_available(); }

int fmc_staging_reserve(fmc_staging *s, size_t len)
{
    if (s->cap >= len)
        return 0;
    fmc_staging_free(s->buf, s->pinned);
    s->buf = fmc_staging_alloc(len, &s->pinned);
    s->cap = s->buf ? len : 0;
    return s->buf ? 0 : -1;
}

void fmc_staging_release(fmc_staging *s)
{
    fmc_staging_free(s->buf, s->pinned);
    s->buf = NULL;
    s->cap = 0;
}

/* ------------------------------------------------------------------ CUDA IPC (same host) */

int fmc_cuda_ipc_export(uint64_t addr, uint8_t *handle, uint64_t *alloc_base, int *device)
{
    int dev = -1;
    if (fmc_cuda_device_of(addr, 1, &dev) != 1)
        return FMC_ERR_INVALID_ARGUMENT;
    CUdeviceptr base = 0;
    size_t size = 0;
    if (use_device(dev) != 0 || cu.mem_get_address_range(&base, &size, (CUdeviceptr)addr) != 0 ||
        cu.ipc_get_mem_handle(handle, base) != 0) {
        fmc_set_error("cannot export GPU memory at 0x%llx for CUDA IPC", (unsigned long long)addr);
        return FMC_ERR_DEVICE_NOT_FOUND;
    }
    *alloc_base = base;
    *device = dev;
    return FMC_OK;
}

int fmc_cuda_ipc_open(const uint8_t *handle, int device, uint64_t *mapped)
{
    CUipcMemHandle h;
    memcpy(h.reserved, handle, sizeof h.reserved);
    CUdeviceptr ptr = 0;
    if (!fmc_cuda_available() || use_device(device) != 0 ||
        cu.ipc_open_mem_handle(&ptr, h, 1 /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */) != 0) {
        fmc_set_error("cannot open the peer's CUDA IPC handle on device %d", device);
        return FMC_ERR_DEVICE_NOT_FOUND;
    }
    *mapped = ptr;
    return FMC_OK;
}

void fmc_cuda_ipc_close(uint64_t mapped, int device)
{
    if (mapped && use_device(device) == 0)
        cu.ipc_close_mem_handle((CUdeviceptr)mapped);
}
