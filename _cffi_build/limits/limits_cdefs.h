/* The benchmark's physical limits as cffi sees them (flagcx_mc.tools.bench._limits_cffi); the C
 * compiler reads this very text too.  Each returns 0 and writes GB/s through gbps_out, or one of
 * the core's FMC_ERR_* codes with the reason in fmc_last_error (FMC_ERR_NOT_IMPLEMENTED: this
 * machine cannot measure it). */
const char *fmc_last_error(void);
/* Congestion control of the raw socket's loopback connections, as an engine's local_cc ("" keeps
 * the host's); "reno" until set. */
int fmc_limits_set_local_cc(const char *cc);
int fmc_baseline_memcpy(uint64_t block, uint64_t span, uint64_t total, double *gbps_out);
int fmc_baseline_tcp(int streams, uint64_t block, uint64_t span, uint64_t total, double *gbps_out);
int fmc_baseline_tcp_calls(int streams, int cpus, uint64_t block, uint64_t span, uint64_t total, double *gbps_out);
int fmc_baseline_tcp_staged(int streams, int device, uint64_t block, uint64_t span, uint64_t total,
                            double *gbps_out);
int fmc_baseline_pvm(uint64_t block, uint64_t span, uint64_t total, double *gbps_out);
int fmc_baseline_cuda_d2d(int src_device, int dst_device, uint64_t block, uint64_t span, uint64_t total,
                          int wait_each_batch, double *gbps_out);
int fmc_baseline_cuda_host(int device, int to_device, uint64_t block, uint64_t span, uint64_t total,
                           double *gbps_out);
