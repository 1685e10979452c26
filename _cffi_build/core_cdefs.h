/* Only what cffi must see.  Kept in step with src/fmc_core.h by tests/test_core.py. */

enum {
    FMC_OK = 0,
    FMC_ERR_INVALID_ARGUMENT = -1,
    FMC_ERR_TOO_MANY_REQUESTS = -2,
    FMC_ERR_ADDRESS_NOT_REGISTERED = -3,
    FMC_ERR_BATCH_BUSY = -4,
    FMC_ERR_DEVICE_NOT_FOUND = -6,
    FMC_ERR_ADDRESS_OVERLAPPED = -7,
    FMC_ERR_DNS = -101,
    FMC_ERR_SOCKET = -102,
    FMC_ERR_REJECT_HANDSHAKE = -104,
    FMC_ERR_TIMEOUT = -105,
    FMC_ERR_REMOTE_REFUSED = -106,
    FMC_ERR_MEMORY = -302,
    FMC_ERR_NOT_IMPLEMENTED = -303,
};

enum { FMC_OP_READ = 0, FMC_OP_WRITE = 1 };
enum { FMC_PROTO_NATIVE = 0, FMC_PROTO_MOONCAKE = 2 };
enum { FMC_TASK_PENDING = 1 };
/* Registration of host memory: nothing; huge pages asked for future faults and pages touched
 * before registration collapsed into huge pages (commits nothing: the default); that and the
 * whole region faulted in now (commits it). */
enum { FMC_PREFAULT_OFF = 0, FMC_PREFAULT_TOUCHED = 1, FMC_PREFAULT_ALL = 2 };

typedef struct fmc_engine fmc_engine;
typedef struct fmc_peer fmc_peer;
typedef struct fmc_batch fmc_batch;

typedef struct {
    uint64_t bytes_written_out;    /* payload bytes this engine wrote to peers */
    uint64_t bytes_read_in;        /* payload bytes this engine read from peers */
    uint64_t bytes_served_in;      /* payload bytes peers wrote into this engine */
    uint64_t bytes_served_out;     /* payload bytes peers read from this engine */
    uint64_t batches_ok;
    uint64_t batches_failed;
    uint64_t requests_refused;     /* remote requests refused by the registry check */
    uint64_t protocol_errors;      /* connections dropped for malformed input */
    uint64_t server_connections;   /* live inbound data connections */
    uint64_t requests_served;      /* remote requests answered (a vector counts once) */
    uint64_t vectors_served;       /* of which vector requests (many small slices in one) */
    uint64_t zero_copy_answers;    /* read answers sent from registered pages without a copy */
    uint64_t zero_copy_resets;     /* connections reset while such answers were unacknowledged */
    uint64_t zero_copy_sends;      /* write payload runs this engine spliced into sockets */
    uint64_t streams_cut;          /* data streams cut to stop a cancelled or late call */
    uint64_t streams_reconnected;  /* of which connected again (their other calls sent again) */
    uint64_t zero_copy_fences;     /* cut streams whose spliced payloads were taken back from the target */
} fmc_stats;

/* Successful synchronous transfer calls to one peer name, counted by the core as they return
 * (metrics.py adds the failures it sees and reads these; the struct is owned by Python). */
enum { FMC_LATENCY_BUCKETS = 19 }; /* 18 upper bounds and +Inf */
typedef struct {
    uint64_t calls;
    uint64_t bytes_written;
    uint64_t bytes_read;
    uint64_t latency_us;           /* sum over calls */
    uint64_t buckets[19];          /* FMC_LATENCY_BUCKETS */
} fmc_call_stats;

const char *fmc_version(void);
const char *fmc_last_error(void);
int fmc_data_header_size(void);
int fmc_cuda_usable(void);
/* The CUDA driver library to load (before anything loaded it; "" for libcuda.so.1). */
int fmc_cuda_set_library(const char *path);
/* Where a -DFMC_TRACE build writes its event trace at exit (<prefix>.<pid>) and how many events
 * it keeps (0: 1M); FMC_ERR_NOT_IMPLEMENTED in other builds. */
int fmc_trace_configure(const char *prefix, uint64_t events);
/* Whether this kernel takes the per-socket TCP_RTO_MIN_US and TCP_DELACK_MAX_US (Linux 6.15+). */
int fmc_tcp_timer_options_supported(void);
/* GPUs by identity (16-byte UUIDs, as cuDeviceGetUuid gives them), and the devices this process
 * holds a primary context on (count; fills up to cap ordinals and UUIDs). */
int fmc_cuda_device_uuid(int ordinal, uint8_t *uuid16);
int fmc_cuda_device_by_uuid(const uint8_t *uuid16);
int fmc_cuda_resolve_peer_device(const uint8_t *uuid16, int peer_ordinal);
int fmc_cuda_contexts(int32_t *ordinals, uint8_t *uuids16, int cap);
/* The device to map a same-host peer's GPU memory on, or why none (fmc_cuda.c says how). */
enum { FMC_MAP_NOT_VISIBLE = -1, FMC_MAP_NO_CONTEXT = -2 };
int fmc_cuda_mapping_device(const uint8_t *uuid16, int peer_ordinal);

/* One engine's settings (flagcx_mc.config.EngineConfig fills them); fmc_options_default gives
 * the core's defaults, which a NULL options pointer also means. */
typedef struct {
    char local_cc[16];   /* congestion control of connections within this host; "" keeps the host's */
    int prefault;        /* FMC_PREFAULT_*: what registration does to host memory's pages */
    int vectors;         /* offer vector requests to the targets this engine connects to */
    int spin_us;         /* poll up to this long before sleeping, after small transfers (0..10000) */
    int copy_threads;    /* threads that copy one large same-host call (0: the CPUs this process may run on; at most 4) */
    int zerocopy;        /* vmsplice + splice for large write payloads and read answers */
    int gpu_copy;        /* FMC_GPU_COPY_*: how scattered GPU blocks are staged for TCP */
    uint64_t gpu_staging; /* bytes of pinned staging chunks GPU memory crosses TCP through */
    int rto_min_us;      /* TCP_RTO_MIN_US of every data connection (0: the kernel's; Linux 6.15+) */
    int delack_max_us;   /* TCP_DELACK_MAX_US of every data connection (0: the kernel's; Linux 6.15+) */
} fmc_options;
enum { FMC_GPU_COPY_AUTO = 0, FMC_GPU_COPY_KERNEL = 1, FMC_GPU_COPY_BATCH = 2, FMC_GPU_COPY_SINGLE = 3 };
void fmc_options_default(fmc_options *opts);
int fmc_engine_create(const char *bind_host, int port_min, int port_max, const fmc_options *opts,
                      fmc_engine **out);
int fmc_engine_data_port(fmc_engine *engine);
void fmc_engine_destroy(fmc_engine *engine);
void fmc_engine_accept_mooncake_wire(fmc_engine *engine, int accept);
int fmc_engine_set_secret(fmc_engine *engine, const uint8_t *key, int len);
int fmc_hmac_sha256_public(const uint8_t *key, int key_len, const uint8_t *msg, int msg_len, uint8_t *out);
void fmc_engine_get_stats(fmc_engine *engine, fmc_stats *out);
uint64_t fmc_engine_batches_ended(fmc_engine *engine);
int fmc_engine_wait_batch_end(fmc_engine *engine, uint64_t seen, int64_t timeout_ms);
void fmc_engine_wake_end_waiters(fmc_engine *engine);
int fmc_engine_drain_log(fmc_engine *engine, char *buf, int cap);

int fmc_register(fmc_engine *engine, uint64_t addr, uint64_t len, uint32_t *key_out);
int fmc_unregister(fmc_engine *engine, uint64_t addr);
/* The registered regions in registration order (the region count; fills up to cap). */
int fmc_region_table(fmc_engine *engine, uint64_t *addrs, uint64_t *lens, uint32_t *keys, int cap);
int fmc_region_slots(fmc_engine *engine, int32_t *slots, uint32_t *gens, int cap);
int fmc_engine_same_host_fd(fmc_engine *engine);
uint64_t fmc_engine_same_host_addr(fmc_engine *engine);
int fmc_region_cuda_ipc(fmc_engine *engine, uint64_t addr, uint8_t *handle64, uint64_t *alloc_base, int *device);
int fmc_region_cuda_vmm(fmc_engine *engine, uint64_t addr, uint64_t *bases, uint64_t *sizes, int32_t *fds, int cap,
                        int *device);

int fmc_peer_create(fmc_engine *engine, const char *host, int data_port, int nstreams,
                    uint64_t slice_size, fmc_peer **out);
int fmc_peer_set_regions(fmc_peer *peer, const uint64_t *addrs, const uint64_t *lens,
                         const uint32_t *keys, int n);
int fmc_peer_find_region(fmc_peer *peer, uint64_t addr, uint64_t len, uint64_t *base_out,
                         uint32_t *key_out);
int fmc_peer_set_protocol(fmc_peer *peer, int proto);
/* The process's serve pool (inbound data connections of every engine): at most n threads
 * (0: twice the CPUs this process may use, at least 4); before the first engine takes a
 * connection.  fmc_serve_pool_counts: its threads now, its cap, and how many times it called a
 * lingering thread back to take waiting connections. */
int fmc_serve_pool_set_threads(int n);
void fmc_serve_pool_counts(int *workers, int *cap, uint64_t *recalls);
/* The process's I/O pool (the send and receive sides of every engine's outbound streams): as
 * many threads not blocked on a stalled peer at most, the same default. */
int fmc_io_pool_set_threads(int n);
void fmc_io_pool_counts(int *workers, int *cap, uint64_t *recalls);
int fmc_peer_set_owner_pid(fmc_peer *peer, int pid);
int fmc_peer_set_region_slots(fmc_peer *peer, const uint64_t *addrs, const int32_t *slots,
                              const uint32_t *gens, int n);
int fmc_peer_enable_same_host(fmc_peer *peer, int pid, int ctrl_fd, uint64_t ctrl_addr);
int fmc_peer_is_same_host(fmc_peer *peer);
int fmc_peer_set_region_shm(fmc_peer *peer, uint64_t addr, int memfd, uint64_t size);
int fmc_peer_shared_region_count(fmc_peer *peer);
int fmc_peer_set_region_ipc(fmc_peer *peer, uint64_t addr, const uint8_t *handle64, uint64_t alloc_base, int device);
int fmc_peer_set_region_device(fmc_peer *peer, uint64_t addr, int device);
int fmc_peer_set_region_vmm(fmc_peer *peer, uint64_t addr, int device, int n, const uint64_t *bases,
                            const uint64_t *sizes, const int32_t *fds);
int fmc_peer_connect(fmc_peer *peer, int timeout_ms);
int fmc_peer_is_healthy(fmc_peer *peer);
/* Streams connected so far: the first at connect, the others once a large transfer comes. */
int fmc_peer_streams_ready(fmc_peer *peer);
/* Milliseconds since the peer's last transfer started, or -1 while a batch of it is alive. */
int64_t fmc_peer_idle_ms(fmc_peer *peer);
void fmc_peer_set_call_stats(fmc_peer *peer, fmc_call_stats *stats);
uint64_t fmc_latency_bucket_bound_us(int index);
void fmc_peer_close(fmc_peer *peer);
void fmc_peer_release(fmc_peer *peer);

int fmc_batch_submit(fmc_peer *peer, int opcode, int n, const uint64_t *local,
                     const uint64_t *remote, const uint64_t *lens, fmc_batch **out);
int fmc_batch_wait(fmc_batch *batch, int64_t timeout_ms);
int fmc_batch_wait_done(fmc_batch *batch, int64_t timeout_ms);
int fmc_batch_poll(fmc_batch *batch);
int fmc_batch_task_status(fmc_batch *batch, int index);
int fmc_batch_cancel(fmc_batch *batch);
int fmc_batch_cancel_tasks(fmc_batch *batch, int first, int count);
void fmc_batch_free(fmc_batch *batch);
int fmc_transfer(fmc_peer *peer, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                 const uint64_t *lens, int64_t timeout_ms);
int fmc_transfer_one(fmc_peer *peer, int opcode, uint64_t local, uint64_t remote, uint64_t len, int64_t timeout_ms);
int fmc_transfer_packed(fmc_peer *peer, int opcode, int n, const char *packed, int64_t timeout_ms);
int fmc_transfer_start(fmc_peer *peer, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                       const uint64_t *lens, int64_t poll_us, fmc_batch **pending);
int fmc_transfer_start_one(fmc_peer *peer, int opcode, uint64_t local, uint64_t remote, uint64_t len,
                           int64_t poll_us, fmc_batch **pending);
int fmc_transfer_start_packed(fmc_peer *peer, int opcode, int n, const char *packed, int64_t poll_us,
                              fmc_batch **pending);
int fmc_transfer_start_group(fmc_peer *peer, int opcode, int n, const char *packed, int64_t poll_us,
                             fmc_batch **pending);

/* device buffers: GPU memory without a framework (flagcx_mc.buffers.DeviceBuffer), through the
 * core's libcuda; FMC_ERR_NOT_IMPLEMENTED where there is no driver */
int fmc_cuda_device_count(int *count_out);
int fmc_cuda_buffer_alloc(int device, uint64_t size, uint64_t *ptr_out);
int fmc_cuda_buffer_alloc_vmm(int device, uint64_t size, uint64_t chunk, int shareable, uint64_t *ptr_out);
int fmc_cuda_buffer_free(int device, uint64_t ptr);
int fmc_cuda_buffer_free_vmm(int device, uint64_t ptr, uint64_t size, uint64_t chunk);
int fmc_cuda_buffer_copy(int device, uint64_t dst, uint64_t src, uint64_t len);
