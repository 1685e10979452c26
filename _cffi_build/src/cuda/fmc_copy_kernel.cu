// The copy kernel of GPU staging (fmc_cuda.c): many (dst, src, len) entries in one launch, so a
// paged KV batch is gathered into, or scattered out of, one pinned chunk by one device operation.
// The core ships its PTX (fmc_copy_kernel_ptx.h), JIT-compiled by the driver: no nvcc at build
// time.  Regenerate: nvcc -ptx -arch=compute_80 fmc_copy_kernel.cu, then lower .version to 7.7
// (CUDA 11.7+ drivers; ptxas accepts it) and paste it into fmc_copy_kernel_ptx.h.
#define FMC_KERNEL_ENTRIES 160
#define FMC_KERNEL_CHUNK 16384  /* bytes per CTA: 256 threads x 4 x 16 B */
struct fmc_copy_entry { unsigned long long dst, src, len; };
struct fmc_copy_params { fmc_copy_entry e[FMC_KERNEL_ENTRIES]; };

extern "C" __global__ void __launch_bounds__(256) fmc_copy_entries(const __grid_constant__ fmc_copy_params p)
{
    const fmc_copy_entry &e = p.e[blockIdx.y];
    unsigned long long begin = (unsigned long long)blockIdx.x * FMC_KERNEL_CHUNK;
    if (begin >= e.len)
        return;
    unsigned long long end = begin + FMC_KERNEL_CHUNK < e.len ? begin + FMC_KERNEL_CHUNK : e.len;
    char *dst = (char *)e.dst;
    const char *src = (const char *)e.src;
    if (((e.dst | e.src | begin | end) & 15) == 0) {
        uint4 *d = (uint4 *)(dst + begin);
        const uint4 *s = (const uint4 *)(src + begin);
        unsigned n = (unsigned)((end - begin) >> 4);
        unsigned i = threadIdx.x;
        for (; i + 768 < n; i += 1024) {
            uint4 a = s[i], b = s[i + 256], c = s[i + 512], x = s[i + 768];
            d[i] = a; d[i + 256] = b; d[i + 512] = c; d[i + 768] = x;
        }
        for (; i < n; i += 256)
            d[i] = s[i];
        return;
    }
    for (unsigned long long i = begin + threadIdx.x; i < end; i += 256)
        dst[i] = src[i];
}
