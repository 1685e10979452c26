/* GPU memory without a build-time CUDA dependency: libcuda is loaded with dlopen on first use.
 * A machine without it builds and runs every host path; device pointers are then simply not
 * recognised (registering one fails as unmapped memory, never crashes).
 *
 * The data plane never hands device pointers to the kernel: TCP stages GPU bytes through host
 * buffers (cuMemcpy with unified addressing picks the direction), and the same-host path maps
 * the peer's GPU memory here (a CUDA IPC handle, or VMM chunks passed as file descriptors) and
 * copies device to device.
 *
 * Contexts: the process creates or retains a primary context only on a device whose memory it
 * registers or copies (asking what a pointer is needs none), so a host-only process holds no
 * context and a worker of GPU 5 holds one on GPU 5 alone.  Across processes a GPU is named by
 * its UUID: ordinals depend on each process's CUDA_VISIBLE_DEVICES.
 *
 * FLAGCX_MC_LIBCUDA names the driver library to load instead of libcuda.so.1 (a driver in an
 * unusual place, or the test suite's fake driver). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "fmc_copy_kernel_ptx.h"
#include "fmc_internal.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct {
    char reserved[FMC_CUDA_IPC_HANDLE_SIZE];
} CUipcMemHandle;

typedef unsigned long long CUmemHandle; /* CUmemGenericAllocationHandle */
typedef struct {
    int location_type, location_id; /* CUmemLocation */
    int flags;                      /* CUmemAccess_flags */
} CUmemAccessDesc;

#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE 10
#define CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES 14
#define CU_MEMORYTYPE_DEVICE 2
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEMHOSTALLOC_PORTABLE 0x01
#define CUDA_ERROR_INVALID_CONTEXT 201
#define FMC_CUDA_MAX_DEVICES 64

static struct {
    int state; /* 0 untried, 1 usable, -1 unusable */
    void *lib;
    CUresult (*init)(unsigned int);
    CUresult (*pointer_get_attribute)(void *, int, CUdeviceptr);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_get_count)(int *);
    CUresult (*device_get_uuid)(uint8_t *, CUdevice); /* CUuuid: 16 bytes */
    CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
    CUresult (*primary_ctx_get_state)(CUdevice, unsigned int *, int *); /* optional */
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*mem_get_address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*mem_host_alloc)(void **, size_t, unsigned int);
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
    /* Optional (CUDA 10.2+): virtual memory management, to share cuMemCreate memory. */
    CUresult (*mem_retain_handle)(CUmemHandle *, void *);
    CUresult (*mem_release)(CUmemHandle);
    CUresult (*mem_export)(void *, CUmemHandle, int, unsigned long long);
    CUresult (*mem_import)(CUmemHandle *, void *, int);
    CUresult (*mem_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*mem_address_free)(CUdeviceptr, size_t);
    CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemHandle, unsigned long long);
    CUresult (*mem_unmap)(CUdeviceptr, size_t);
    CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    int vmm; /* all of them were found */
    /* Optional: events (a wait covers one thread's own copies, never a whole device or stream
     * another thread uses), stream teardown at thread exit, and the copy kernel. */
    CUresult (*event_create)(void **, unsigned int);
    CUresult (*event_record)(void *, void *);
    CUresult (*event_synchronize)(void *);
    CUresult (*event_destroy)(void *);
    CUresult (*stream_destroy)(void *);
    CUresult (*module_load_data)(void **, const void *);
    CUresult (*module_get_function)(void **, void *, const char *);
    CUresult (*launch_kernel)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                              unsigned int, unsigned int, void *, void **, void **);
    CUcontext ctx[FMC_CUDA_MAX_DEVICES];
    void *kernel[FMC_CUDA_MAX_DEVICES]; /* the copy kernel loaded under that device's context */
    int kernel_state[FMC_CUDA_MAX_DEVICES]; /* 0 untried, 1 loaded, -1 not loadable there */
} cu;

static pthread_mutex_t cu_mu = PTHREAD_MUTEX_INITIALIZER;
static char chosen_library[4096]; /* fmc_cuda_set_library; "" loads libcuda.so.1 (or libcuda.so) */

int fmc_cuda_set_library(const char *path)
{
    if (!path || strlen(path) >= sizeof chosen_library) {
        fmc_set_error("the CUDA driver's path must be 0 to %zu bytes", sizeof chosen_library - 1);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&cu_mu);
    int rc = FMC_OK;
    if (cu.state != 0 && strcmp(path, chosen_library) != 0) {
        fmc_set_error("the CUDA driver is already loaded (or was tried) from '%s'", *chosen_library ? chosen_library
                                                                                                  : "libcuda.so.1");
        rc = FMC_ERR_INVALID_ARGUMENT;
    } else {
        snprintf(chosen_library, sizeof chosen_library, "%s", path);
    }
    pthread_mutex_unlock(&cu_mu);
    return rc;
}

static int load(void)
{
    const char *chosen = chosen_library;
    const char *names[] = {*chosen ? chosen : "libcuda.so.1", "libcuda.so"};
    for (size_t i = 0; i < (*chosen ? 1u : 2u) && !cu.lib; i++)
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
    SYM(device_get_count, "cuDeviceGetCount");
    SYM(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    SYM(ctx_set_current, "cuCtxSetCurrent");
    SYM(mem_get_address_range, "cuMemGetAddressRange_v2");
    SYM(mem_host_alloc, "cuMemHostAlloc");
    SYM(mem_free_host, "cuMemFreeHost");
    SYM(ipc_get_mem_handle, "cuIpcGetMemHandle");
    SYM(ipc_open_mem_handle, "cuIpcOpenMemHandle_v2");
    SYM(ipc_close_mem_handle, "cuIpcCloseMemHandle");
    SYM(stream_create, "cuStreamCreate");
    SYM(memcpy_async, "cuMemcpyAsync");
    SYM(stream_synchronize, "cuStreamSynchronize");
#undef SYM
    /* _v2 (CUDA 11.4+) names a MIG instance by its own UUID; the first form names the GPU. */
    *(void **)&cu.device_get_uuid = dlsym(cu.lib, "cuDeviceGetUuid_v2");
    if (!cu.device_get_uuid)
        *(void **)&cu.device_get_uuid = dlsym(cu.lib, "cuDeviceGetUuid");
    if (!cu.device_get_uuid)
        return -1;
    *(void **)&cu.primary_ctx_get_state = dlsym(cu.lib, "cuDevicePrimaryCtxGetState");
    *(void **)&cu.batch_v2 = dlsym(cu.lib, "cuMemcpyBatchAsync_v2");
    if (!cu.batch_v2)
        *(void **)&cu.batch_v1 = dlsym(cu.lib, "cuMemcpyBatchAsync");
    const char *vmm_names[] = {"cuMemRetainAllocationHandle", "cuMemRelease", "cuMemExportToShareableHandle",
                               "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemAddressFree",
                               "cuMemMap", "cuMemUnmap", "cuMemSetAccess"};
    void **vmm_fields[] = {(void **)&cu.mem_retain_handle, (void **)&cu.mem_release, (void **)&cu.mem_export,
                           (void **)&cu.mem_import, (void **)&cu.mem_reserve, (void **)&cu.mem_address_free,
                           (void **)&cu.mem_map, (void **)&cu.mem_unmap, (void **)&cu.mem_set_access};
    const char *opt_names[] = {"cuEventCreate", "cuEventRecord", "cuEventSynchronize",
                               "cuEventDestroy_v2", "cuStreamDestroy_v2", "cuModuleLoadData", "cuModuleGetFunction",
                               "cuLaunchKernel"};
    void **opt_fields[] = {(void **)&cu.event_create, (void **)&cu.event_record, (void **)&cu.event_synchronize,
                           (void **)&cu.event_destroy, (void **)&cu.stream_destroy,
                           (void **)&cu.module_load_data, (void **)&cu.module_get_function,
                           (void **)&cu.launch_kernel};
    for (size_t i = 0; i < sizeof opt_names / sizeof *opt_names; i++)
        *opt_fields[i] = dlsym(cu.lib, opt_names[i]);
    if (!cu.event_create || !cu.event_record || !cu.event_synchronize)
        cu.event_create = NULL; /* waits synchronise the thread's own stream instead */
    cu.vmm = 1;
    for (size_t i = 0; i < sizeof vmm_names / sizeof *vmm_names; i++)
        cu.vmm &= (*vmm_fields[i] = dlsym(cu.lib, vmm_names[i])) != NULL;
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

/* The loaded driver's entry point `name`, or NULL (no usable driver, or no such call). */
void *fmc_cuda_symbol(const char *name) { return fmc_cuda_available() ? dlsym(cu.lib, name) : NULL; }

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

int fmc_cuda_use_device(int device) { return fmc_cuda_available() && use_device(device) == 0 ? 0 : -1; }

static CUresult pointer_attribute(void *out, int attr, uint64_t addr);

/* Ordinal of the GPU whose memory holds `addr`, or -1 (host memory, unmapped, no CUDA). */
static int device_memory_ordinal(uint64_t addr)
{
    unsigned int type = 0;
    int ordinal = -1;
    if (pointer_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr) != 0 || type != CU_MEMORYTYPE_DEVICE ||
        pointer_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr) != 0)
        return -1;
    return ordinal;
}

/* 1 for memory from cuMemAlloc (one allocation, a legacy IPC handle), 0 for cuMemCreate memory
 * (VMM), which may be many allocations ("chunks") mapped side by side. */
static int legacy_allocation(uint64_t addr)
{
    int legacy = 1;
    if (cu.pointer_get_attribute(&legacy, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, (CUdeviceptr)addr) != 0)
        return 1; /* an old driver: assume the classic kind */
    return legacy != 0;
}

#define FMC_CUDA_MAX_CHUNKS (1 << 16) /* chunks walked in one range */

/* The allocations behind [addr, addr+len) on `device`, in address order: cuMemGetAddressRange
 * reports only the chunk holding a pointer, so torch's expandable segments (a chunk per 20 MiB)
 * are walked chunk by chunk.  Calls fn(ctx, base, size) for each; returns the count, or -1 when
 * a gap, another device's memory or (for cuMemAlloc memory) the allocation's end falls inside. */
static int walk_chunks(uint64_t addr, uint64_t len, int device, int (*fn)(void *ctx, uint64_t base, uint64_t size),
                       void *ctx)
{
    int legacy = legacy_allocation(addr), n = 0;
    for (uint64_t q = addr; q < addr + len; n++) {
        CUdeviceptr base = 0;
        size_t size = 0;
        if (n == FMC_CUDA_MAX_CHUNKS || (n > 0 && legacy) || device_memory_ordinal(q) != device ||
            cu.mem_get_address_range(&base, &size, (CUdeviceptr)q) != 0 || size == 0 || base > q ||
            base + size <= q || (fn && fn(ctx, base, size) != 0))
            return -1;
        q = base + size;
    }
    return n;
}

static void set_range_error(uint64_t addr, uint64_t len)
{
    fmc_set_error("[0x%llx, +%llu) runs past the end of its GPU allocation", (unsigned long long)addr,
                  (unsigned long long)len);
}

/* The pointer attribute `attr` of `addr`, asked without a context of our own.  A driver that
 * wants a current context for it (CUDA_ERROR_INVALID_CONTEXT) is asked again under a primary
 * context that is already active: device memory implies one exists (the allocator's), so no new
 * context is ever made just to ask; none active means `addr` cannot be device memory. */
static CUresult pointer_attribute(void *out, int attr, uint64_t addr)
{
    CUresult r = cu.pointer_get_attribute(out, attr, (CUdeviceptr)addr);
    if (r != CUDA_ERROR_INVALID_CONTEXT || !cu.primary_ctx_get_state)
        return r;
    int count = 0;
    if (cu.device_get_count(&count) != 0)
        return r;
    for (int d = 0; d < count && d < FMC_CUDA_MAX_DEVICES; d++) {
        CUdevice dev;
        unsigned int flags = 0;
        int active = 0;
        if (cu.device_get(&dev, d) == 0 && cu.primary_ctx_get_state(dev, &flags, &active) == 0 && active &&
            use_device(d) == 0)
            return cu.pointer_get_attribute(out, attr, (CUdeviceptr)addr);
    }
    return r;
}

int fmc_cuda_device_of(uint64_t addr, uint64_t len, int *device)
{
    *device = -1;
    if (!fmc_cuda_available())
        return 0;
    int ordinal = device_memory_ordinal(addr);
    if (ordinal < 0)
        return 0; /* host memory: no context anywhere */
    if (use_device(ordinal) != 0 || walk_chunks(addr, len, ordinal, NULL, NULL) < 0) {
        set_range_error(addr, len);
        return -1;
    }
    *device = ordinal;
    return 1;
}

/* ------------------------------------------------------------------ devices by identity */

int fmc_cuda_device_uuid(int ordinal, uint8_t *uuid16)
{
    CUdevice dev;
    if (!fmc_cuda_available() || ordinal < 0 || cu.device_get(&dev, ordinal) != 0 ||
        cu.device_get_uuid(uuid16, dev) != 0)
        return FMC_ERR_DEVICE_NOT_FOUND;
    return FMC_OK;
}

int fmc_cuda_device_by_uuid(const uint8_t *uuid16)
{
    int count = 0;
    if (!fmc_cuda_available() || cu.device_get_count(&count) != 0)
        return -1;
    for (int d = 0; d < count; d++) {
        uint8_t u[16];
        if (fmc_cuda_device_uuid(d, u) == FMC_OK && memcmp(u, uuid16, sizeof u) == 0)
            return d;
    }
    return -1;
}

int fmc_cuda_resolve_peer_device(const uint8_t *uuid16, int peer_ordinal)
{
    if (!fmc_cuda_available())
        return -1;
    if (uuid16)
        return fmc_cuda_device_by_uuid(uuid16);
    int count = 0; /* a peer that names its GPU by ordinal only: trust that both see the same GPUs */
    return cu.device_get_count(&count) == 0 && peer_ordinal >= 0 && peer_ordinal < count ? peer_ordinal : -1;
}

/* The device to map a same-host peer's GPU memory on (its handle opened, or its chunks made
 * accessible, under that device's context; copies then run on that device's stream):
 *   the peer's GPU itself where this process already holds a context on it;
 *   else a GPU this process holds a context on (its own: the driver reaches the peer's GPU by
 *   peer access), so that mapping makes no context on a GPU the process otherwise leaves alone;
 *   FMC_MAP_NOT_VISIBLE where this process does not see the peer's GPU at all, and
 *   FMC_MAP_NO_CONTEXT where it holds no context (it registered only host memory: it makes none,
 *   and the peer stages those bytes through its own GPU instead). */
int fmc_cuda_mapping_device(const uint8_t *uuid16, int peer_ordinal)
{
    int here = fmc_cuda_resolve_peer_device(uuid16, peer_ordinal);
    if (here < 0)
        return FMC_MAP_NOT_VISIBLE;
    int chosen = FMC_MAP_NO_CONTEXT;
    pthread_mutex_lock(&cu_mu);
    if (here < FMC_CUDA_MAX_DEVICES && cu.ctx[here])
        chosen = here;
    for (int d = 0; d < FMC_CUDA_MAX_DEVICES && chosen < 0; d++)
        if (cu.ctx[d])
            chosen = d;
    pthread_mutex_unlock(&cu_mu);
    return chosen;
}

/* Reporting never loads the driver: a process that has not used it holds no context. */
int fmc_cuda_contexts(int32_t *ordinals, uint8_t *uuids16, int cap)
{
    int n = 0;
    pthread_mutex_lock(&cu_mu);
    int loaded = cu.state == 1;
    pthread_mutex_unlock(&cu_mu);
    if (!loaded)
        return 0;
    for (int d = 0; d < FMC_CUDA_MAX_DEVICES; d++) {
        pthread_mutex_lock(&cu_mu);
        int held = cu.ctx[d] != NULL;
        pthread_mutex_unlock(&cu_mu);
        if (!held)
            continue;
        if (n < cap) {
            ordinals[n] = d;
            if (fmc_cuda_device_uuid(d, uuids16 + 16 * (size_t)n) != FMC_OK)
                memset(uuids16 + 16 * (size_t)n, 0, 16);
        }
        n++;
    }
    return n;
}

/* Copies go on streams of our own, never the application's: one non-blocking stream per thread
 * and device, so the threads that stage GPU bytes (each initiator stream's sender and receiver,
 * each target connection) never wait for one another's copies, and a wait is one event recorded
 * behind this thread's copies (a driver without events: a synchronise of this thread's stream,
 * which holds nothing else).  A plain cuMemcpy may return before a device-to-device or pageable
 * host-to-device copy has landed, and a transfer must not report success before that.  The
 * streams and events of a thread are destroyed when it exits. */
typedef struct {
    void *stream[FMC_CUDA_MAX_DEVICES];
    void *event[FMC_CUDA_MAX_DEVICES];
} thread_lanes;

static pthread_key_t lanes_key;
static pthread_once_t lanes_once = PTHREAD_ONCE_INIT;
static __thread thread_lanes *my_lanes;

static void lanes_free(void *arg)
{
    thread_lanes *l = arg;
    for (int d = 0; d < FMC_CUDA_MAX_DEVICES; d++) {
        if (!l->stream[d] && !l->event[d])
            continue;
        if (use_device(d) == 0) {
            if (l->event[d] && cu.event_destroy)
                cu.event_destroy(l->event[d]);
            if (l->stream[d] && cu.stream_destroy) /* its queued work still completes */
                cu.stream_destroy(l->stream[d]);
        }
    }
    free(l);
}

static void lanes_init(void) { pthread_key_create(&lanes_key, lanes_free); }

static void *stream_of(int device)
{
    if (use_device(device) != 0)
        return NULL;
    if (!my_lanes) {
        pthread_once(&lanes_once, lanes_init);
        if (!(my_lanes = calloc(1, sizeof *my_lanes)))
            return NULL;
        pthread_setspecific(lanes_key, my_lanes);
    }
    if (!my_lanes->stream[device] && cu.stream_create(&my_lanes->stream[device], 1 /* CU_STREAM_NON_BLOCKING */) != 0)
        my_lanes->stream[device] = NULL;
    return my_lanes->stream[device];
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

/* The copy kernel on `device` (loaded once per device from the PTX the core ships), or NULL
 * where the driver cannot load or launch it: copies then go through the copy engines. */
static void *copy_kernel(int device)
{
    if (!cu.module_load_data || !cu.module_get_function || !cu.launch_kernel)
        return NULL;
    pthread_mutex_lock(&cu_mu);
    if (cu.kernel_state[device] == 0) {
        void *module = NULL;
        cu.kernel_state[device] = -1;
        if (cu.module_load_data(&module, fmc_copy_kernel_ptx) == 0 &&
            cu.module_get_function(&cu.kernel[device], module, "fmc_copy_entries") == 0)
            cu.kernel_state[device] = 1;
    }
    void *k = cu.kernel_state[device] == 1 ? cu.kernel[device] : NULL;
    pthread_mutex_unlock(&cu_mu);
    return k;
}

/* In auto mode, runs of at least this many bytes go to the copy engines (the driver's batch):
 * 32 KiB into GPU memory, 16 KiB out of it.  On the H200 (two processes on one GPU, pipelined
 * staging, 1024 blocks a call): 32 KiB blocks moved faster through the batch both ways, from one
 * caller and from 10 (15.6 against 12.2, 14.5 against 11.9 GB/s GPU to GPU).  At 16 KiB the
 * kernel's scatters into GPU memory were as fast or faster; its gathers out of GPU memory were
 * faster from one caller (GPU to host memory 17.7 against 11.1-12.7 GB/s written, GPU to GPU
 * 12.6-13.1 against 8.4-9.4) but fell far behind under 10 concurrent callers (GPU to GPU
 * 7.0-7.2 against 8.9-9.5 written, 4.8-4.9 against 9.1-9.7 read, with twice the CPU spent
 * waiting for them).  Telling the two cases apart by other batches queued on a stream (and a
 * request flag for the target's gathers) measured no better, so gathers of 16 KiB take the
 * copy engines always: the worst case is the concurrent one. */
#define FMC_KERNEL_MAX_RUN_IN (32u << 10)
#define FMC_KERNEL_MAX_RUN_OUT (16u << 10)

typedef struct {
    uint64_t dst, src, len;
} kernel_entry;

/* Launch the kernel over entries [0, n) (n <= FMC_KERNEL_ENTRIES); 0 if queued. */
static int launch_entries(void *kernel, void *stream, const kernel_entry *e, int n)
{
    static __thread kernel_entry params[FMC_KERNEL_ENTRIES]; /* the driver copies them at launch */
    uint64_t longest = 0;
    for (int i = 0; i < n; i++) {
        params[i] = e[i];
        longest = e[i].len > longest ? e[i].len : longest;
    }
    void *args[] = {params};
    unsigned int gx = (unsigned int)((longest + FMC_KERNEL_CHUNK - 1) / FMC_KERNEL_CHUNK);
    return cu.launch_kernel(kernel, gx, (unsigned int)n, 1, 256, 1, 1, 0, stream, args, NULL) == 0 ? 0 : -1;
}

int fmc_cuda_gather_async(uint64_t *dst, uint64_t *src, size_t *len, int n, int device, int mode, int into_gpu)
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
    void *kernel = m > 1 && (mode == FMC_GPU_COPY_AUTO || mode == FMC_GPU_COPY_KERNEL) ? copy_kernel(device) : NULL;
    if (kernel) {
        /* Small runs go to the kernel; in auto, long ones stay in the arrays (compacted to the
         * front) for the copy engines below. */
        kernel_entry e[FMC_KERNEL_ENTRIES];
        uint64_t max_run = into_gpu ? FMC_KERNEL_MAX_RUN_IN : FMC_KERNEL_MAX_RUN_OUT;
        int k = 0, big = 0, rc = 0;
        for (int i = 0; i < m && rc == 0; i++) {
            if (len[i] >= max_run && mode == FMC_GPU_COPY_AUTO) {
                dst[big] = dst[i];
                src[big] = src[i];
                len[big++] = len[i];
                continue;
            }
            e[k++] = (kernel_entry){dst[i], src[i], len[i]};
            if (k == FMC_KERNEL_ENTRIES) {
                rc = launch_entries(kernel, stream, e, k);
                k = 0;
            }
        }
        if (rc == 0 && k > 0)
            rc = launch_entries(kernel, stream, e, k);
        if (rc != 0)
            return FMC_ERR_DEVICE_NOT_FOUND;
        m = big;
    }
    if (m > 1 && mode != FMC_GPU_COPY_SINGLE && !__atomic_load_n(&cu.batch_broken, __ATOMIC_RELAXED) &&
        (cu.batch_v2 || cu.batch_v1)) {
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

int fmc_cuda_copy_many_async(uint64_t *dst, uint64_t *src, size_t *len, int n, int device)
{
    return fmc_cuda_gather_async(dst, src, len, n, device, FMC_GPU_COPY_BATCH, 0);
}

int fmc_cuda_wait(int device)
{
    void *stream = stream_of(device);
    if (!stream)
        return FMC_ERR_DEVICE_NOT_FOUND;
    if (cu.event_create) {
        void **ev = &my_lanes->event[device];
        if (!*ev && cu.event_create(ev, 2 /* CU_EVENT_DISABLE_TIMING */) != 0)
            *ev = NULL;
        if (*ev)
            return cu.event_record(*ev, stream) == 0 && cu.event_synchronize(*ev) == 0 ? FMC_OK
                                                                                       : FMC_ERR_DEVICE_NOT_FOUND;
    }
    return cu.stream_synchronize(stream) == 0 ? FMC_OK : FMC_ERR_DEVICE_NOT_FOUND;
}

/* Fences: an event recorded behind this thread's copies so far, so that a pipeline can queue
 * the next copies and wait for the earlier ones only.  A wait is cuEventSynchronize on an event
 * made without CU_EVENT_BLOCKING_SYNC, which the driver polls.  On the H200 (1 MiB blocks, GPU
 * to GPU written) blocking events, woken by an interrupt, moved 10.8 GB/s; polling cuEventQuery
 * from the waiting threads, 13.4; this, 19.0.  Without events, a fence is a synchronise of the
 * thread's stream on that device (it holds this thread's copies only). */
#define CU_EVENT_DISABLE_TIMING 0x2

int fmc_cuda_fence_record(fmc_fence *f, int device)
{
    void *stream = stream_of(device);
    f->armed = 0;
    if (!stream)
        return FMC_ERR_DEVICE_NOT_FOUND;
    if (f->ev && f->dev != device)
        fmc_cuda_fence_free(f);
    if (!f->ev && cu.event_create && cu.event_create(&f->ev, CU_EVENT_DISABLE_TIMING) != 0)
        f->ev = NULL;
    f->dev = device;
    if (f->ev && cu.event_record(f->ev, stream) != 0)
        return FMC_ERR_DEVICE_NOT_FOUND;
    f->armed = 1;
    return FMC_OK;
}

int fmc_cuda_fence_wait(fmc_fence *f)
{
    if (!f->armed)
        return FMC_OK;
    f->armed = 0;
    if (!f->ev) {
        void *stream = stream_of(f->dev);
        return stream && cu.stream_synchronize(stream) == 0 ? FMC_OK : FMC_ERR_DEVICE_NOT_FOUND;
    }
    if (use_device(f->dev) != 0)
        return FMC_ERR_DEVICE_NOT_FOUND;
    return cu.event_synchronize(f->ev) == 0 ? FMC_OK : FMC_ERR_DEVICE_NOT_FOUND;
}

void fmc_cuda_fence_free(fmc_fence *f)
{
    if (f->ev && cu.event_destroy && use_device(f->dev) == 0)
        cu.event_destroy(f->ev);
    f->ev = NULL;
    f->armed = 0;
}

int fmc_cuda_copy(uint64_t dst, uint64_t src, size_t len, int device)
{
    int rc = fmc_cuda_copy_async(dst, src, len, device);
    int wait = fmc_cuda_wait(device);
    return rc != FMC_OK ? rc : wait;
}

/* Host staging memory for `device`'s copies: pinned when CUDA is there (faster copies), under
 * that device's context (never another's) and portable, so that a buffer reused for another
 * device's copies stays pinned for it; plain memory otherwise. */
void *fmc_staging_alloc(size_t len, int device, int *pinned)
{
    *pinned = 0;
    if (device >= 0 && fmc_cuda_available() && use_device(device) == 0) {
        void *p = NULL;
        if (cu.mem_host_alloc(&p, len, CU_MEMHOSTALLOC_PORTABLE) == 0) {
            *pinned = 1;
            return p;
        }
    }
    return malloc(len);
}

void fmc_staging_free(void *p, int pinned, int device)
{
    if (!p)
        return;
    if (pinned) {
        use_device(device); /* retained when the buffer was made: no new context */
        cu.mem_free_host(p);
    } else {
        free(p);
    }
}

int fmc_cuda_usable(void) { return fmc_cuda_available(); }

int fmc_staging_reserve(fmc_staging *s, size_t len, int device)
{
    if (s->cap >= len)
        return 0;
    fmc_staging_free(s->buf, s->pinned, s->device);
    s->buf = fmc_staging_alloc(len, device, &s->pinned);
    s->device = device;
    s->cap = s->buf ? len : 0;
    return s->buf ? 0 : -1;
}

void fmc_staging_release(fmc_staging *s)
{
    fmc_staging_free(s->buf, s->pinned, s->device);
    s->buf = NULL;
    s->cap = 0;
}

/* ------------------------------------------------------------------ CUDA IPC (same host) */

int fmc_cuda_ipc_export(uint64_t addr, uint8_t *handle, uint64_t *alloc_base, int *device)
{
    int dev = -1;
    if (fmc_cuda_device_of(addr, 1, &dev) != 1)
        return FMC_ERR_INVALID_ARGUMENT;
    if (!legacy_allocation(addr)) {
        /* cuIpcGetMemHandle refuses it (CUDA_ERROR_INVALID_VALUE on the H200's driver):
         * say why here; its chunks are shared instead (fmc_cuda_vmm_export). */
        fmc_set_error("VMM memory (cuMemCreate) has no legacy CUDA IPC handle");
        return FMC_ERR_NOT_IMPLEMENTED;
    }
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

/* ------------------------------------------------------------------ VMM sharing (same host) */

/* Memory from cuMemCreate has no legacy IPC handle.  Each chunk that allows POSIX file
 * descriptors is exported as one; the target keeps them open while the region is registered,
 * and a same-host peer takes copies with pidfd_getfd (the same permission process_vm_writev
 * needs), imports them and maps the chunks side by side in a range of its own. */

typedef struct {
    int cap, n;
    uint64_t *bases, *sizes;
    int32_t *fds;
    int refused; /* a chunk could not be exported (the reason is set) */
} export_ctx;

static int export_chunk(void *arg, uint64_t base, uint64_t size)
{
    export_ctx *x = arg;
    if (x->n == x->cap) {
        fmc_set_error("more than %d chunks", x->cap);
        return x->refused = -1;
    }
    uint64_t types = 0;
    if (cu.pointer_get_attribute(&types, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, (CUdeviceptr)base) == 0 &&
        !(types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        fmc_set_error("its chunk at 0x%llx was not created shareable as a POSIX file descriptor",
                      (unsigned long long)base);
        return x->refused = -1;
    }
    CUmemHandle h = 0;
    int fd = -1;
    if (cu.mem_retain_handle(&h, (void *)(uintptr_t)base) != 0) {
        fmc_set_error("cuMemRetainAllocationHandle refused its chunk at 0x%llx", (unsigned long long)base);
        return x->refused = -1;
    }
    CUresult r = cu.mem_export(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    cu.mem_release(h);
    if (r != 0 || fd < 0) {
        fmc_set_error("cuMemExportToShareableHandle refused its chunk at 0x%llx (error %d)", (unsigned long long)base, r);
        return x->refused = -1;
    }
    x->bases[x->n] = base;
    x->sizes[x->n] = size;
    x->fds[x->n++] = fd;
    return 0;
}

/* Enough descriptors for many chunks: a large KV cache in 20 MiB chunks needs thousands. */
static void raise_fd_limit(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

/* `device`: the GPU registration found the range on; the walk checks every chunk again. */
int fmc_cuda_vmm_export(uint64_t addr, uint64_t len, int device, int cap, uint64_t *bases, uint64_t *sizes,
                        int32_t *fds)
{
    if (!fmc_cuda_available() || use_device(device) != 0) {
        fmc_set_error("no usable CUDA context on device %d", device);
        return FMC_ERR_DEVICE_NOT_FOUND;
    }
    if (!cu.vmm || legacy_allocation(addr)) {
        fmc_set_error("not VMM memory, or the driver lacks the VMM calls");
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    raise_fd_limit();
    export_ctx x = {.cap = cap, .bases = bases, .sizes = sizes, .fds = fds};
    if (walk_chunks(addr, len, device, export_chunk, &x) < 0) {
        if (!x.refused)
            set_range_error(addr, len);
        for (int i = 0; i < x.n; i++)
            close(fds[i]);
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    return x.n;
}

/* VMM ranges mapped here from peers' chunks (fmc_cuda_peer_unmap must know which kind it has). */
typedef struct vmm_import {
    uint64_t va, span;
    int n;
    uint64_t *sizes; /* of its chunks, mapped one after another from va */
    struct vmm_import *next;
} vmm_import;
static vmm_import *imports;

/* Unmap the first `n` chunks (one cuMemUnmap per cuMemMap) and give the range back. */
static void unmap_range(uint64_t va, int n, const uint64_t *sizes, uint64_t span)
{
    uint64_t at = va;
    for (int i = 0; i < n; at += sizes[i++])
        cu.mem_unmap((CUdeviceptr)at, (size_t)sizes[i]);
    cu.mem_address_free((CUdeviceptr)va, (size_t)span);
}

int fmc_cuda_vmm_import(int pid, int n, const uint64_t *bases, const uint64_t *sizes, const int32_t *fds, int device,
                        uint64_t *mapped)
{
    if (!fmc_cuda_available() || !cu.vmm || use_device(device) != 0) {
        fmc_set_error("no usable CUDA VMM calls for device %d", device);
        return FMC_ERR_DEVICE_NOT_FOUND;
    }
    uint64_t span = 0;
    for (int i = 0; i < n; i++) {
        if (sizes[i] == 0 || (i > 0 && bases[i] != bases[i - 1] + sizes[i - 1]) || span + sizes[i] < span) {
            fmc_set_error("the peer's GPU chunks are not one contiguous range");
            return FMC_ERR_INVALID_ARGUMENT;
        }
        span += sizes[i];
    }
    vmm_import *m = n > 0 ? calloc(1, sizeof *m) : NULL;
    uint64_t *kept = m ? malloc(sizeof *kept * (size_t)n) : NULL;
    if (!kept) {
        free(m);
        fmc_set_error("no GPU chunks to map, or out of memory");
        return n > 0 ? FMC_ERR_MEMORY : FMC_ERR_INVALID_ARGUMENT;
    }
    memcpy(kept, sizes, sizeof *kept * (size_t)n);
    int pidfd = fmc_pidfd_open(pid);
    CUdeviceptr va = 0;
    int rc = FMC_OK, done = 0;
    if (pidfd < 0) {
        fmc_set_error("pidfd_open(%d): %s", pid, strerror(errno));
        rc = FMC_ERR_NOT_IMPLEMENTED;
    } else if (cu.mem_reserve(&va, (size_t)span, 0, 0, 0) != 0) {
        fmc_set_error("cannot reserve %llu bytes of GPU address space", (unsigned long long)span);
        rc = FMC_ERR_MEMORY;
    }
    for (uint64_t at = va; rc == FMC_OK && done < n; at += sizes[done++]) {
        int fd = fmc_pidfd_getfd(pidfd, fds[done]);
        if (fd < 0) {
            fmc_set_error("pidfd_getfd(pid %d, fd %d): %s", pid, fds[done], strerror(errno));
            rc = FMC_ERR_NOT_IMPLEMENTED;
            break;
        }
        CUmemHandle h = 0;
        CUresult r = cu.mem_import(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        close(fd);
        if (r == 0) {
            r = cu.mem_map((CUdeviceptr)at, (size_t)sizes[done], 0, h, 0);
            cu.mem_release(h); /* the mapping holds the memory now */
        }
        if (r != 0) {
            fmc_set_error("cannot import and map the peer's GPU chunk %d (error %d)", done, r);
            rc = FMC_ERR_DEVICE_NOT_FOUND;
        }
    }
    if (pidfd >= 0)
        close(pidfd);
    CUmemAccessDesc access = {CU_MEM_LOCATION_TYPE_DEVICE, device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if (rc == FMC_OK && cu.mem_set_access(va, (size_t)span, &access, 1) != 0) {
        fmc_set_error("cannot make the peer's GPU chunks accessible on device %d", device);
        rc = FMC_ERR_DEVICE_NOT_FOUND;
    }
    if (rc != FMC_OK) {
        if (va)
            unmap_range(va, done, sizes, span);
        free(kept);
        free(m);
        return rc;
    }
    *m = (vmm_import){.va = va, .span = span, .n = n, .sizes = kept};
    pthread_mutex_lock(&cu_mu);
    m->next = imports;
    imports = m;
    pthread_mutex_unlock(&cu_mu);
    *mapped = va;
    return FMC_OK;
}

void fmc_cuda_peer_unmap(uint64_t mapped, int device)
{
    if (!mapped || use_device(device) != 0)
        return;
    pthread_mutex_lock(&cu_mu);
    vmm_import **pp = &imports, *m = NULL;
    while (*pp && (*pp)->va != mapped)
        pp = &(*pp)->next;
    if (*pp) {
        m = *pp;
        *pp = m->next;
    }
    pthread_mutex_unlock(&cu_mu);
    if (m) {
        unmap_range(m->va, m->n, m->sizes, m->span);
        free(m->sizes);
        free(m);
    } else {
        cu.ipc_close_mem_handle((CUdeviceptr)mapped);
    }
}
