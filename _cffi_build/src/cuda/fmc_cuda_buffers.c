/* GPU memory for callers without a framework of their own (flagcx_mc.buffers.DeviceBuffer):
 * plain cuMemAlloc allocations, VMM memory laid out the way torch's expandable segments make it,
 * copies in any direction and the device count.  Everything goes through the core's own libcuda
 * (fmc_cuda.c: one dlopen, the same primary contexts the data path uses); without a driver every
 * call returns FMC_ERR_NOT_IMPLEMENTED with the reason in fmc_last_error. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "fmc_internal.h"

/* CUmemAllocationProp and CUmemAccessDesc as cuda.h lays them out. */
typedef struct {
    int type, requested_handle_types;
    int location_type, location_id;
    void *win32_metadata;
    unsigned char compression, gpu_direct_rdma;
    unsigned short usage;
    unsigned char reserved[4];
} buf_alloc_prop;

typedef struct {
    int location_type, location_id, flags;
} buf_access_desc;

#define BUF_ALLOCATION_PINNED 1
#define BUF_HANDLE_POSIX_FD 1
#define BUF_LOCATION_DEVICE 1
#define BUF_ACCESS_READWRITE 3
#define BUF_VMM_GRANULARITY (2ull << 20)

static struct {
    pthread_once_t once;
    int (*device_count)(int *);
    int (*alloc)(uint64_t *, size_t);
    int (*free)(uint64_t);
    /* VMM calls (CUDA 10.2+); all or none are used */
    int (*mem_create)(unsigned long long *, size_t, const buf_alloc_prop *, unsigned long long);
    int (*mem_release)(unsigned long long);
    int (*mem_reserve)(uint64_t *, size_t, size_t, uint64_t, unsigned long long);
    int (*mem_address_free)(uint64_t, size_t);
    int (*mem_map)(uint64_t, size_t, size_t, unsigned long long, unsigned long long);
    int (*mem_unmap)(uint64_t, size_t);
    int (*mem_set_access)(uint64_t, size_t, const buf_access_desc *, size_t);
} bf = {.once = PTHREAD_ONCE_INIT};

static void bind_calls(void)
{
    *(void **)&bf.device_count = fmc_cuda_symbol("cuDeviceGetCount");
    *(void **)&bf.alloc = fmc_cuda_symbol("cuMemAlloc_v2");
    *(void **)&bf.free = fmc_cuda_symbol("cuMemFree_v2");
    *(void **)&bf.mem_create = fmc_cuda_symbol("cuMemCreate");
    *(void **)&bf.mem_release = fmc_cuda_symbol("cuMemRelease");
    *(void **)&bf.mem_reserve = fmc_cuda_symbol("cuMemAddressReserve");
    *(void **)&bf.mem_address_free = fmc_cuda_symbol("cuMemAddressFree");
    *(void **)&bf.mem_map = fmc_cuda_symbol("cuMemMap");
    *(void **)&bf.mem_unmap = fmc_cuda_symbol("cuMemUnmap");
    *(void **)&bf.mem_set_access = fmc_cuda_symbol("cuMemSetAccess");
}

/* The driver's calls bound, or FMC_ERR_NOT_IMPLEMENTED. */
static int bound(void)
{
    pthread_once(&bf.once, bind_calls);
    if (!bf.device_count || !bf.alloc || !bf.free) {
        fmc_set_error("no usable CUDA driver (libcuda.so.1)");
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    return 0;
}

/* The driver bound, `device` present and its primary context current in this thread. */
static int open_device(int device)
{
    int rc = bound(), count = 0;
    if (rc < 0)
        return rc;
    if (bf.device_count(&count) != 0 || device < 0 || device >= count) {
        fmc_set_error("CUDA device %d not present (%d devices)", device, count);
        return FMC_ERR_DEVICE_NOT_FOUND;
    }
    if (fmc_cuda_use_device(device) != 0) {
        fmc_set_error("cannot open a context on CUDA device %d", device);
        return FMC_ERR_DEVICE_NOT_FOUND;
    }
    return 0;
}

static int have_vmm(void)
{
    return bf.mem_create && bf.mem_release && bf.mem_reserve && bf.mem_address_free && bf.mem_map && bf.mem_unmap &&
           bf.mem_set_access;
}

int fmc_cuda_device_count(int *count_out)
{
    if (count_out == NULL)
        return FMC_ERR_INVALID_ARGUMENT;
    *count_out = 0;
    int rc = bound();
    if (rc < 0)
        return rc;
    if (bf.device_count(count_out) != 0) {
        *count_out = 0;
        fmc_set_error("cuDeviceGetCount failed");
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    return 0;
}

int fmc_cuda_buffer_alloc(int device, uint64_t size, uint64_t *ptr_out)
{
    if (size == 0 || ptr_out == NULL)
        return FMC_ERR_INVALID_ARGUMENT;
    int rc = open_device(device);
    if (rc < 0)
        return rc;
    if (bf.alloc(ptr_out, (size_t)size) != 0) {
        fmc_set_error("cuMemAlloc of %llu bytes failed on device %d", (unsigned long long)size, device);
        return FMC_ERR_MEMORY;
    }
    return 0;
}

int fmc_cuda_buffer_free(int device, uint64_t ptr)
{
    int rc = open_device(device);
    if (rc < 0)
        return rc;
    if (bf.free(ptr) != 0) {
        fmc_set_error("cuMemFree of 0x%llx failed", (unsigned long long)ptr);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    return 0;
}

/* Unmap the first `mapped` bytes of a VMM range in `chunk` steps (each unmapping releases its
 * chunk's memory, whose handle was released right after mapping) and free all `size` bytes of
 * its address range. */
static int release_vmm(uint64_t va, uint64_t mapped, uint64_t size, uint64_t chunk)
{
    for (uint64_t off = 0; off < mapped; off += chunk)
        bf.mem_unmap(va + off, (size_t)chunk);
    if (size && bf.mem_address_free(va, (size_t)size) != 0) {
        fmc_set_error("cuMemAddressFree of 0x%llx failed", (unsigned long long)va);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    return 0;
}

/* The device's context made current, and the driver's VMM calls present. */
static int open_vmm_device(int device)
{
    int rc = open_device(device);
    if (rc < 0)
        return rc;
    if (!have_vmm()) {
        fmc_set_error("the CUDA driver lacks the VMM calls");
        return FMC_ERR_NOT_IMPLEMENTED;
    }
    return 0;
}

/* `size` bytes (a multiple of `chunk`, itself a multiple of the 2 MiB granularity) of address
 * space backed by one cuMemCreate allocation per chunk, mapped side by side, readable and
 * writable by `device`; shareable: the chunks allow POSIX file descriptor handles, which is what
 * lets same-host peers map them (fmc_cuda_vmm_export). */
int fmc_cuda_buffer_alloc_vmm(int device, uint64_t size, uint64_t chunk, int shareable, uint64_t *ptr_out)
{
    if (size == 0 || chunk == 0 || size % chunk != 0 || chunk % BUF_VMM_GRANULARITY != 0 || ptr_out == NULL) {
        fmc_set_error("VMM memory needs a size that is a whole number of chunks of a multiple of 2 MiB "
                      "(got %llu in chunks of %llu)", (unsigned long long)size, (unsigned long long)chunk);
        return FMC_ERR_INVALID_ARGUMENT;
    }
    int rc = open_vmm_device(device);
    if (rc < 0)
        return rc;
    uint64_t va = 0, mapped = 0;
    if (bf.mem_reserve(&va, (size_t)size, 0, 0, 0) != 0) {
        fmc_set_error("cuMemAddressReserve of %llu bytes failed", (unsigned long long)size);
        return FMC_ERR_MEMORY;
    }
    buf_alloc_prop prop;
    memset(&prop, 0, sizeof prop);
    prop.type = BUF_ALLOCATION_PINNED;
    prop.requested_handle_types = shareable ? BUF_HANDLE_POSIX_FD : 0;
    prop.location_type = BUF_LOCATION_DEVICE;
    prop.location_id = device;
    for (; mapped < size; mapped += chunk) {
        unsigned long long h = 0;
        if (bf.mem_create(&h, (size_t)chunk, &prop, 0) != 0)
            break;
        int bad = bf.mem_map(va + mapped, (size_t)chunk, 0, h, 0);
        bf.mem_release(h); /* the mapping holds the memory from here on */
        if (bad)
            break;
    }
    buf_access_desc access = {BUF_LOCATION_DEVICE, device, BUF_ACCESS_READWRITE};
    if (mapped < size || bf.mem_set_access(va, (size_t)size, &access, 1) != 0) {
        release_vmm(va, mapped, size, chunk);
        fmc_set_error("cannot create and map %llu bytes of VMM memory on device %d", (unsigned long long)size,
                      device);
        return FMC_ERR_MEMORY;
    }
    *ptr_out = va;
    return 0;
}

/* Undo fmc_cuda_buffer_alloc_vmm: unmap the chunks of [ptr, ptr+size) and free the range. */
int fmc_cuda_buffer_free_vmm(int device, uint64_t ptr, uint64_t size, uint64_t chunk)
{
    if (chunk == 0 || size % chunk != 0)
        return FMC_ERR_INVALID_ARGUMENT;
    int rc = open_vmm_device(device);
    if (rc < 0)
        return rc;
    return release_vmm(ptr, size, size, chunk);
}

/* Any direction (host or device addresses: unified addressing), on the core's copy stream of
 * `device`; returns once the bytes are there. */
int fmc_cuda_buffer_copy(int device, uint64_t dst, uint64_t src, uint64_t len)
{
    if (dst == 0 || src == 0 || len == 0)
        return FMC_ERR_INVALID_ARGUMENT;
    int rc = open_device(device);
    if (rc < 0)
        return rc;
    if (fmc_cuda_copy(dst, src, (size_t)len, device) != FMC_OK) {
        fmc_set_error("copy of %llu bytes on CUDA device %d failed", (unsigned long long)len, device);
        return FMC_ERR_DEVICE_NOT_FOUND;
    }
    return 0;
}
