/* Structures shared by the core's modules.  Nothing here is seen by Python.
 *
 * Sources, one directory per part: common/ (errors, clocks, reader, send/receive helpers,
 * registry, message log, SHA-256, huge pages), engine/ (lifecycle, registration, batches, peer
 * tables), tcp/ (the native TCP transport: target server, initiator streams, connecting,
 * sockets, zero-copy, authentication; its framing in tcp/fmc_wire.h), mooncake/ (Mooncake's TCP
 * framing, both sides), samehost/ (process_vm_writev/readv and the control block), cuda/
 * (libcuda). */
#ifndef FMC_INTERNAL_H
#define FMC_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/uio.h>

#include "fmc_core.h"
#include "fmc_worker_pool.h"

/* Timestamps of the data path's steps for diagnosis (common/fmc_trace.c), compiled in only with
 * -DFMC_TRACE (`CFLAGS=-DFMC_TRACE pip install .`): each is (event, a, b) with the thread and a
 * CLOCK_MONOTONIC time, dumped at exit to $FMC_TRACE_FILE.<pid>, and read by
 * `python -m flagcx_mc.tools.trace_report` (which keeps the same names). */
enum fmc_trace_event {
    FMC_TR_CALL = 1,        /* a synchronous transfer starts: a = its tasks */
    FMC_TR_CALL_END = 2,    /* it returns: a = rc */
    FMC_TR_GATHER = 10,     /* a send pipeline queued a piece's gather: a = socket, b = copies */
    FMC_TR_FENCE_WAIT = 11, /* it waits for a piece's gather: a = socket */
    FMC_TR_FENCED = 12,     /* the gather has landed: a = socket */
    FMC_TR_SENT = 13,       /* the piece has left: a = socket, b = iovecs */
    FMC_TR_ROUND = 14,      /* a stream's send round starts: a = socket, b = bytes */
    FMC_TR_HANDOFF = 15,    /* the socket is full: the round's rest waits for room: a = socket */
    FMC_TR_ROUND_END = 16,  /* the round has left: a = socket, b = 0 or the failure */
    FMC_TR_RESUME = 17,     /* the send side takes up a handed-off round: a = socket */
    FMC_TR_REQUEST = 20,    /* a target took a vector request: a = socket, b = entries */
    FMC_TR_RECV = 21,       /* it starts receiving a piece into staging: a = socket, b = entries */
    FMC_TR_RECEIVED = 22,   /* the piece has arrived: a = socket, b = bytes */
    FMC_TR_LAND_WAIT = 23,  /* it waits for a piece's copy to the GPU: a = socket */
    FMC_TR_LANDED = 24,     /* the copy has landed: a = socket */
    FMC_TR_ANSWER = 25,     /* it sends the queued answers: a = socket, b = iovecs */
    FMC_TR_ANSWERED = 26,   /* they have left: a = socket */
    FMC_TR_SERVE = 27,      /* a target's worker takes up a connection: a = socket, b = bytes buffered */
    FMC_TR_SPIN = 28,       /* it polls for the next request: a = socket, b = the last one's bytes */
    FMC_TR_YIELD = 29,      /* it gives the connection back to the pool: a = socket */
    FMC_TR_WAKE = 30,       /* a pool worker takes an event: a = its events, b = 1 serve pool, 0 I/O pool */
    FMC_TR_FINISH = 31,     /* slices end (answered, or failed): a = the first one's batch's tasks */
    FMC_TR_READ_MORE = 32,  /* a target's worker read its socket for a request: a = socket, b = bytes buffered */
    FMC_TR_PARKED = 33,     /* it resumes a write payload that had stalled: a = socket, b = bytes landed */
};
#ifdef FMC_TRACE
void fmc_trace(int event, uint64_t a, uint64_t b);
#define FMC_TR(event, a, b) fmc_trace((event), (uint64_t)(a), (uint64_t)(b))
#else
#define FMC_TR(event, a, b) ((void)0)
#endif

#define FMC_MAX_PINS 512         /* regions one server connection may hold pinned at once */
#define FMC_IOV_MAX 512          /* iovec entries per sendmsg */
#define FMC_COALESCE_BYTES (1u << 20) /* a sender stops gathering slices past this many bytes */
#define FMC_RBUF_SIZE (256u << 10)    /* buffered reader size (headers and small payloads) */
#define FMC_MAX_STREAMS 64

/* ------------------------------------------------------------------------ common/fmc_util.c */
void fmc_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int64_t fmc_now_ms(void);
int64_t fmc_now_us(void);
int fmc_spin_us(const fmc_engine *e); /* the engine's spin_us (common/fmc_util.c) */
/* Transfers up to this size are "small": worth polling for, and (on one idle stream) sent by
 * their calling thread, which may also read their answers itself (tcp/fmc_tcp_transport.c). */
#define FMC_SMALL_TRANSFER_BYTES (256u << 10)
/* A send deadline that means: never block; what the socket does not take now goes to the
 * stream's send side, which goes on once the socket has room (fmc_transfer_start, and the send
 * side's own rounds). */
#define FMC_INLINE_NOWAIT (-2)
/* fmc_spin_us, or 0 after a transfer that is not small. */
int fmc_spin_us_after(const fmc_engine *e, uint64_t bytes);
void fmc_deadline_ts(int64_t timeout_ms, struct timespec *ts);
void fmc_cond_init_monotonic(pthread_cond_t *cv);
/* n bytes from the kernel's generator (common/fmc_random.c); -1 with the error set if it fails:
 * callers fail too, never going on with predictable or uninitialised bytes. */
int fmc_random_bytes(void *p, size_t n);
int fmc_usable_cpus(void); /* CPUs this process may run on (common/fmc_util.c) */
/* pidfd_open(pid) and pidfd_getfd(pidfd, fd): -1 (errno set) where the kernel or a policy refuses. */
int fmc_pidfd_open(int pid);
int fmc_pidfd_getfd(int pidfd, int fd);
/* The process's serve pool of inbound data connections (tcp/fmc_server.c), made with the
 * first engine: its core threads and epoll set exist from then on, idle. */
int fmc_serve_pool_start(void);

/* Buffered reader over a blocking socket: headers and small payloads come from one recv. */
typedef struct {
    int fd;
    uint8_t *buf;
    size_t cap, start, end;
    size_t max_read; /* 0, or the most one recv takes: leaves payloads that follow a header in
                      * the socket, to be read straight into place (vectors) */
    int64_t deadline_ms; /* 0, or when its blocking reads give up (then timed_out is set):
                          * fmc_reader_set_deadline */
    int64_t base_timeout_ms; /* the socket's receive timeout outside a deadline (0: none) */
    int timed_out;
} fmc_reader;

/* A data stream's socket times its blocking calls out this often outside a caller's deadline
 * (fmc_connection.c), and so does a served connection's (FMC_PARK_MS, fmc_server.c): a pool
 * worker whose call waits one out with no byte moved is stalled on its peer (below). */
#define FMC_STALL_TICK_MS 50

/* This thread's stall accounting (NULL: none): called with 1 when one of its blocking socket
 * calls (a reader's, or fmc_sendv_all / fmc_sendv_zc without a deadline) first waits out the
 * socket's timeout without a byte moving, and with 0 when that call ends.  Pool workers set it
 * while they run a connection (fmc_pool_stall: the serve pool's in fmc_server.c, the I/O pool's
 * in fmc_stream.c), so that a peer stalled mid-payload, or one that stops reading, costs its
 * worker, not the pool's turn.  Such calls go on until `limit_ms` pass without a byte (0: no
 * limit; a thread without a hook: FMC_STALL_MS for reads). */
void fmc_stall_hook_set(void (*hook)(int begins), int64_t limit_ms);
/* For a blocking send without a deadline: the socket's timeout passed with no byte moved
 * (*since: when that began, 0 at first); 1 while the send goes on, and the stall begins.  Only
 * on a thread with a hook: elsewhere the socket's timeout ends the send as it always did (a
 * reader's calls wait on whatever the thread, common/fmc_util.c). */
int fmc_send_stall_goes_on(int64_t *since);
/* At the end of such a call: the stall it began, if any, is over.  Returns rc. */
int fmc_stall_over(int rc);

/* A socket's SO_RCVTIMEO or SO_SNDTIMEO (`optname`), in milliseconds; 0: none. */
void fmc_socket_timeout(int fd, int optname, int64_t ms);
int64_t fmc_socket_timeout_get(int fd, int optname);
int fmc_reader_init(fmc_reader *r, int fd, size_t cap);
void fmc_reader_free(fmc_reader *r);
static inline size_t fmc_reader_buffered(const fmc_reader *r) { return r->end - r->start; }
/* Blocking reads of `r` give up at deadline_ms (a timeout, r->timed_out), through the socket's
 * receive timeout; 0 clears the deadline and puts base_timeout_ms back. */
void fmc_reader_set_deadline(fmc_reader *r, int64_t deadline_ms);
/* Make at least n (<= cap) bytes available; -1 on EOF/error. */
int fmc_reader_fill(fmc_reader *r, size_t n);
/* Try to pull more bytes without blocking; returns 1 if any arrived, 0 if none, -1 on EOF/error. */
int fmc_reader_try_more(fmc_reader *r);
/* Copy n bytes to dst: buffered bytes first, then straight from the socket.  For this process's
 * own buffers (staging, sinks); registered memory takes fmc_reader_read_region. */
int fmc_reader_read_into(fmc_reader *r, void *dst, size_t n);
/* Throw n bytes away. */
int fmc_reader_skip(fmc_reader *r, size_t n);
/* Copies into registered memory, whose protection the application may have changed since it
 * registered it (mprotect, munmap): every byte goes through the kernel, which refuses a page it
 * cannot write (EFAULT) where memcpy would crash this process with SIGSEGV.  Buffered bytes go by
 * process_vm_writev on ourselves, the rest by recv straight into place.  FMC_READ_REFUSED: the
 * kernel refused some of the destination; the rest of the n bytes were read and dropped, so the
 * stream stays in step (bytes of the destination may have changed).  -1: broken connection. */
#define FMC_READ_REFUSED 1
#define FMC_READ_PARKED 2 /* fmc_reader_read_region_some: the payload stalled, part of it landed */
/* Blocking reads of a reader wait this long for a byte before failing, also on a socket whose
 * receive timeout is shorter (the target's serve pool; see keep_waiting in fmc_util.c). */
#define FMC_STALL_MS 10000
int fmc_reader_read_region(fmc_reader *r, void *dst, size_t n);
/* The same, except that a payload that stops coming for the socket's receive timeout returns
 * FMC_READ_PARKED with *landed bytes in place (so far); call again for the rest. */
int fmc_reader_read_region_some(fmc_reader *r, void *dst, size_t n, size_t *landed);
/* The iovecs in order (up to FMC_IOV_MAX, not consumed; entries that continue one another are
 * read as one range), into registered memory: refused[i] = 1 for entries the kernel refused
 * (their bytes dropped), the others land.  0, or -1 on a broken connection. */
int fmc_reader_read_regions(fmc_reader *r, const struct iovec *iov, int iovcnt, uint8_t *refused);
/* n bytes from src to dst through the kernel (process_vm_writev on ourselves); returns how many
 * landed before a page it refused.  Where process_vm_writev is not allowed, memcpy (unchecked). */
size_t fmc_copy_checked(void *dst, const void *src, size_t n);

int fmc_send_all(int fd, const void *buf, size_t len);
int fmc_sendv_all(int fd, struct iovec *iov, int iovcnt);
/* fmc_sendv_all with extra sendmsg flags (MSG_MORE); deadline_ms >= 0: gives up at that time
 * (fmc_now_ms clock), -2, else blocking; -1 on error; consumes iov. */
int fmc_sendv_flags(int fd, struct iovec *iov, int iovcnt, int flags, int64_t deadline_ms);
void fmc_iov_advance(struct iovec **iovp, int *iovcnt, size_t n);
/* Join entries that continue one another in memory, in place; returns the new count.  Payloads
 * cut into blocks that lie back to back (a KV cache's consecutive blocks) then cost the kernel
 * one page-table walk per run instead of one per block: vmsplice of 1024 adjacent 4 KiB blocks
 * spent most of its time in get_user_pages, once per block. */
int fmc_iov_merge(struct iovec *iov, int iovcnt);
/* Send what the socket takes without blocking; *iov and *iovcnt are left at the unsent rest
 * (*iovcnt 0 when all went).  -1 on error, else 0. */
int fmc_sendv_nowait(int fd, struct iovec **iov, int *iovcnt);
int fmc_recv_all(int fd, void *buf, size_t len);
/* 1 if the connection was reset (or shut down both ways), without waiting: POLLERR/POLLHUP show
 * even while bytes that arrived before the reset are still readable. */
int fmc_socket_reset(int fd);

/* ------------------------------------------------------------------------- tcp/fmc_splice.c */
/* Zero-copy sends: iovecs flagged in zc[] go through vmsplice + splice (through a pipe of the
 * calling thread, opened on first use and closed with the thread), the rest through sendmsg.  Only
 * for memory that stays untouched until the peer has read it: write payloads from the caller,
 * read answers the initiator has yet to acknowledge (fmc_wire.h). */
#define FMC_ZC_MIN_BYTES (128u << 10)
/* A share of a call spread over several streams (a write payload, or a read answer asked for
 * with FMC_REQ_SHARE; not a vector's) goes zero-copy only from this size: between processes of
 * one host, shares of 128-512 KiB moved 1.02-1.45x faster copied on 16 cores and 1.07-1.7x on
 * 2, where a call sent whole on one stream moved faster spliced (BENCHMARKS.md). */
#define FMC_ZC_SHARE_MIN_BYTES (1u << 20)
/* The least payload or answer that goes zero-copy: a share's, or any other's. */
static inline uint64_t fmc_zc_least_bytes(int share) { return share ? FMC_ZC_SHARE_MIN_BYTES : FMC_ZC_MIN_BYTES; }
int fmc_zc_usable(void); /* the kernel has not refused zero-copy sends in this process */
int fmc_zc_enabled(const fmc_engine *e); /* usable, and the engine's zerocopy option is on */
/* deadline_ms >= 0: give up at that time (fmc_now_ms clock), -2; else blocking.  -1 on error. */
int fmc_sendv_zc(int fd, struct iovec *iov, int iovcnt, const uint8_t *zc, int64_t deadline_ms);

/* ------------------------------------------------------------------------- tcp/fmc_socket.c */
int fmc_tcp_listen(const char *host, int port_min, int port_max, int *port_out);
/* Options of every data connection (fmc_tune_socket_opts): local_cc, congestion control if the
 * peer is on this host ("" leaves the host's); rto_min_us and delack_max_us, the kernel's
 * per-socket TCP_RTO_MIN_US and TCP_DELACK_MAX_US (Linux 6.15+), so that a lost packet costs
 * milliseconds, not the 200 ms minimum RTO (0 leaves the kernel's; an older kernel's refusal is
 * ignored), set before the handshake by fmc_tcp_timers_early. */
#define FMC_RTO_MIN_US_DEFAULT 5000
#define FMC_DELACK_MAX_US_DEFAULT 5000
void fmc_tune_socket_opts(int fd, const fmc_options *opts);
void fmc_tcp_timers_early(int fd, const fmc_options *opts); /* before connect, or on a listener */
/* Both ends of a connected socket are on this host (a loopback peer, or our own address). */
int fmc_socket_is_local(int fd);
int fmc_tcp_connect_opts(const char *host, int port, int timeout_ms, const fmc_options *opts);

/* ------------------------------------- authentication (tcp/fmc_auth.c, common/fmc_sha256.c) */
#define FMC_SECRET_MAX 256
typedef struct {
    uint8_t key[FMC_SECRET_MAX];
    size_t len; /* 0: no authentication */
} fmc_secret;

void fmc_hmac_sha256(const uint8_t *key, size_t key_len, const uint8_t *msg, size_t msg_len, uint8_t out[32]);
int fmc_equal_ct(const uint8_t *a, const uint8_t *b, size_t n);
/* `caps`: the target's FMC_CAP_* bits for its final answer; the initiator sends `flags`
 * (FMC_PREAMBLE_*, besides AUTH) and gets the target's bits in *caps. */
int fmc_auth_server(int fd, const fmc_secret *s, const uint8_t *client_nonce, uint32_t caps);
int fmc_auth_client(int fd, const fmc_secret *s, uint32_t flags, uint32_t *caps);

/* ------------------------------------------------------------- GPU memory (cuda/fmc_cuda.c) */
#define FMC_CUDA_IPC_HANDLE_SIZE 64
int fmc_cuda_ipc_export(uint64_t addr, uint8_t *handle, uint64_t *alloc_base, int *device);
int fmc_cuda_ipc_open(const uint8_t *handle, int device, uint64_t *mapped);
/* VMM (cuMemCreate) memory: export the chunks behind [addr, addr+len) as POSIX fds (count, or
 * < 0 with the reason in fmc_last_error); map a same-host peer's chunks here, taking its fds
 * with pidfd_getfd. */
#define FMC_CUDA_VMM_MAX_CHUNKS 8192
int fmc_cuda_vmm_export(uint64_t addr, uint64_t len, int device, int cap, uint64_t *bases, uint64_t *sizes,
                        int32_t *fds);
int fmc_cuda_vmm_import(int pid, int n, const uint64_t *bases, const uint64_t *sizes, const int32_t *fds, int device,
                        uint64_t *mapped);
/* Undo fmc_cuda_ipc_open or fmc_cuda_vmm_import. */
void fmc_cuda_peer_unmap(uint64_t mapped, int device);
int fmc_cuda_available(void);
/* The loaded driver's entry point `name` (NULL: no usable driver, or no such call), and
 * `device`'s primary context made current in this thread (-1 if it cannot be). */
void *fmc_cuda_symbol(const char *name);
int fmc_cuda_use_device(int device);
/* 1 and *device if [addr, addr+len) is GPU memory; 0 if not; -1 if it overruns its allocation. */
int fmc_cuda_device_of(uint64_t addr, uint64_t len, int *device);
int fmc_cuda_copy(uint64_t dst, uint64_t src, size_t len, int device); /* returns once landed */
int fmc_cuda_copy_async(uint64_t dst, uint64_t src, size_t len, int device); /* then fmc_cuda_wait */
int fmc_cuda_wait(int device);
/* Queue n copies (arrays are rewritten: contiguous neighbours merge), as one batch call where the
 * driver has one; then fmc_cuda_wait. */
int fmc_cuda_copy_many_async(uint64_t *dst, uint64_t *src, size_t *len, int n, int device);
/* The same for staging (one side pinned host memory, which the kernel reaches by unified
 * addressing): `mode` (fmc_options.gpu_copy) picks the copy kernel (many entries in one launch;
 * in auto, runs of 32 KiB or more into GPU memory (`into_gpu`), 16 KiB or more out of it, on the
 * copy engines), the driver's batched copy, or one copy per run.  Then fmc_cuda_wait, which
 * waits for this thread's copies only. */
int fmc_cuda_gather_async(uint64_t *dst, uint64_t *src, size_t *len, int n, int device, int mode, int into_gpu);

/* A point in this thread's copy stream on one device (events where the driver has them): recorded
 * behind the copies this thread queued so far, then waited for by the same thread, so that a
 * pipeline waits for the copies of one chunk and not for those queued after it. */
typedef struct {
    void *ev;
    int dev;
    int armed; /* recorded and not yet waited for */
} fmc_fence;
int fmc_cuda_fence_record(fmc_fence *f, int device);
int fmc_cuda_fence_wait(fmc_fence *f); /* FMC_OK once every copy queued before the record landed */
void fmc_cuda_fence_free(fmc_fence *f);

/* Staging chunks (cuda/fmc_stage_pool.c): pinned host buffers of FMC_STAGE_CHUNK bytes, from a
 * per-engine pool of fmc_options.gpu_staging bytes, half for each class.  SEND chunks hold GPU
 * bytes on their way out (an initiator's write payloads, a target's read answers) and may be held
 * while a send blocks; RECV chunks hold bytes that arrived for GPU memory and are held only until
 * their copy to the GPU lands.  The classes are apart so that a receiver never waits for chunks
 * held by senders blocked on a peer's receiver.  A pipeline holds at most FMC_STAGE_DEPTH chunks;
 * it waits for one only while it holds none (fmc_stage_get with a deadline), and takes further
 * ones only if free right away (deadline 0), so no holder ever waits for another. */
#define FMC_STAGE_CHUNK (512u << 10)
#define FMC_STAGE_DEPTH 4
#define FMC_GPU_ROUND_BYTES (2 * FMC_STAGE_DEPTH * FMC_STAGE_CHUNK) /* a send round of GPU sources */
enum { FMC_STAGE_SEND = 0, FMC_STAGE_RECV = 1 };
typedef struct fmc_chunk {
    uint8_t *buf;
    int pinned; /* page-locked (the copy kernel reaches it); else plain memory, no CUDA here */
    int dev;    /* the device it was allocated under */
    int cls;
    struct fmc_chunk *next; /* free list */
} fmc_chunk;
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    fmc_chunk *free_list[2];
    int made[2], limit[2];
    int waiters[2];
} fmc_stage_pool;
void fmc_stage_pool_init(fmc_stage_pool *p, uint64_t bytes);
void fmc_stage_pool_free(fmc_stage_pool *p);
/* A chunk of class `cls` for copies of `device`: deadline_ms 0 = only one free now, < 0 = wait
 * as long as it takes, else until that time (fmc_now_ms); a wait also ends when *stop turns
 * non-zero, and a pool worker waits outside its pool's cap.  NULL if none. */
fmc_chunk *fmc_stage_get(fmc_stage_pool *p, int cls, int device, int64_t deadline_ms, const int *stop);
void fmc_stage_put(fmc_stage_pool *p, fmc_chunk *c);
/* Queue one piece's copies between `device` and `chunk` (fmc_cuda_gather_async: into GPU memory
 * if `into_gpu`, else out of it) and record `fence` behind them; FMC_OK if both are queued.  The
 * engine's gpu_copy picks how; a chunk that is not pinned takes the driver's batch (the kernel
 * cannot reach it). */
int fmc_stage_copy(const fmc_engine *e, const fmc_chunk *chunk, fmc_fence *fence, uint64_t *dst, uint64_t *src,
                   size_t *len, int n, int device, int into_gpu);

/* A growable host buffer through which GPU bytes cross the network. */
typedef struct {
    uint8_t *buf;
    size_t cap;
    int pinned;
    int device; /* the GPU it was allocated for (pinned under that device's context) */
} fmc_staging;
/* Host memory for copies of GPU `device`: pinned (*pinned = 1) where CUDA is usable. */
void *fmc_staging_alloc(size_t len, int device, int *pinned);
void fmc_staging_free(void *p, int pinned, int device);
/* At least `len` bytes, for copies of GPU `device`. */
int fmc_staging_reserve(fmc_staging *s, size_t len, int device);
void fmc_staging_release(fmc_staging *s);

/* ------------------------------------------------------ same host (samehost/fmc_samehost.c) */
#define FMC_SH_MAX_SLOTS 4096
#define FMC_SH_WORDS_PER_PEER 4   /* concurrent same-host copies to one peer */
/* Busy words of a target's control block: FMC_SH_WORDS_PER_PEER for each initiating engine, so
 * that a thousand engines (a host's workers, each reaching every other) copy into one target. */
#define FMC_SH_BUSY_WORDS 4096
typedef struct {
    uint64_t magic;
    _Atomic uint64_t slot_state[FMC_SH_MAX_SLOTS]; /* (generation << 1) | active */
    _Atomic uint64_t busy[FMC_SH_BUSY_WORDS];      /* 0, or slot + 1 while copying */
    _Atomic int busy_pid[FMC_SH_BUSY_WORDS];       /* owner of each busy word */
} fmc_sh_ctrl;

/* --------------------------------------------------------- registry (common/fmc_registry.c) */
typedef struct fmc_region {
    uint64_t addr, len;
    uint64_t seq; /* registration number: the region table lists regions in this order */
    uint32_t key;
    int refs;     /* remote operations currently touching the region */
    int removed;  /* unregistered: no new pins (set under the lock, read atomically) */
    int writable; /* mapped writable when registered; remote writes to others are refused */
    int cuda_dev;     /* GPU ordinal of device memory, -1 for host memory */
    int sh_slot;      /* same-host control slot, -1 if none */
    uint32_t sh_gen;  /* generation of that slot */
    struct fmc_vmm_export *vmm; /* GPU VMM memory exported for same-host peers (NULL: not yet) */
} fmc_region;

/* A region's VMM chunks as file descriptors, open while it is registered (fmc_region_free). */
typedef struct fmc_vmm_export {
    int n;
    uint64_t base[FMC_CUDA_VMM_MAX_CHUNKS], size[FMC_CUDA_VMM_MAX_CHUNKS];
    int32_t fd[FMC_CUDA_VMM_MAX_CHUNKS];
} fmc_vmm_export;

typedef struct {
    fmc_region **items; /* sorted by addr, non-overlapping: lookups */
    fmc_region **order; /* the same regions by seq, oldest first: what descriptors list */
    int count, cap;
    uint64_t next_seq;
} fmc_registry;

/* 1 if [base, base+size) wholly holds [addr, addr+len) (len > 0, no wrap-around: checked by
 * the caller).  Our regions and a peer's region table both use it. */
static inline int fmc_range_holds(uint64_t base, uint64_t size, uint64_t addr, uint64_t len)
{
    return addr >= base && addr - base <= size && len <= size - (addr - base);
}

static inline int fmc_region_holds(const fmc_region *r, uint64_t addr, uint64_t len)
{
    return fmc_range_holds(r->addr, r->len, addr, len);
}

/* Returns the region that wholly holds [addr, addr+len), or NULL.  Caller holds engine->mu. */
fmc_region *fmc_registry_find(fmc_registry *reg, uint64_t addr, uint64_t len);
int fmc_registry_add(fmc_registry *reg, uint64_t addr, uint64_t len, uint32_t key, int writable);
fmc_region *fmc_registry_remove(fmc_registry *reg, uint64_t addr);
void fmc_registry_free(fmc_registry *reg);
void fmc_region_free(fmc_region *r); /* and what it owns */
void fmc_vmm_export_free(fmc_vmm_export *x); /* closes its descriptors; NULL: nothing */
int fmc_check_mapped(uint64_t addr, uint64_t len);
/* 1 if every page of [addr, addr+len) is mapped writable (per /proc/self/maps), else 0. */
int fmc_range_writable(uint64_t addr, uint64_t len);

/* ----------------------------------------------------------- target side (tcp/fmc_server.c) */
typedef struct fmc_server_conn {
    int fd;
    int64_t last_active_ms;  /* last request (or the accept); read by the accept thread */
    fmc_region *pins[FMC_MAX_PINS]; /* guarded by engine->mu */
    int npins;
    int zc_pins;             /* of which held for unacknowledged zero-copy answers (likewise) */
    int cut;                 /* shut down by this engine (unregister, eviction, destroy; likewise) */
    uint64_t token;          /* the initiator's name for it (fmc_wire.h's fences), 0: none; likewise */
    int handshaken;          /* its preamble was answered (likewise); fmc_server_accept_main drops
                              * connections that stay silent for FMC_PREAMBLE_TIMEOUT_MS */
    int64_t born_ms;
    struct fmc_server_conn *prev, *next;
} fmc_server_conn;

/* Shut a data connection down from outside its thread (caller holds engine->mu). */
void fmc_server_conn_cut_locked(fmc_server_conn *c);

/* ------------------------------------------------------------- engine (engine/fmc_engine.c) */
#define FMC_LOG_CAP 8192

struct fmc_engine {
    pthread_mutex_t mu;  /* regions, pins, server connections */
    pthread_cond_t cv;   /* region refs dropped / connection gone */
    fmc_registry reg;
    fmc_server_conn *conns;
    int nconns;
    int listen_fd, data_port;
    int wake_pipe[2];
    pthread_t accept_thread;
    int stopping;
    int accept_mooncake_wire; /* serve Mooncake's TCP framing on the data port too */
    fmc_secret secret;        /* set before any connection; guarded by mu when changed */
    fmc_sh_ctrl *sh;          /* same-host control block (memfd), NULL if unavailable */
    int sh_fd;
    uint8_t sh_slot_used[FMC_SH_MAX_SLOTS]; /* guarded by mu */
    atomic_uint_fast64_t stat_written_out, stat_read_in, stat_served_in, stat_served_out;
    atomic_uint_fast64_t stat_requests, stat_vectors, stat_zc_answers, stat_zc_resets;
    atomic_uint_fast64_t stat_zc_sends, stat_streams_cut, stat_streams_reconnected, stat_zc_fences;
    atomic_uint_fast64_t stat_batches_ok, stat_batches_failed, stat_refused, stat_protocol_errors;
    atomic_uint_fast64_t next_batch_seq;
    fmc_options opts;         /* set at creation, never changed */
    int cores;                /* CPUs this process may run on, at creation (at least 1) */
    fmc_stage_pool stage;     /* GPU staging chunks for TCP (cuda/fmc_stage_pool.c) */
    pthread_mutex_t log_mu;
    char log[FMC_LOG_CAP];
    int log_len;
    struct fmc_collapser *collapser; /* huge-page collapsing thread (fmc_hugepages.c), guarded by mu */
    /* Batches of this engine that have ended, counted, for a thread that waits for the next
     * one to end whichever it is (fmc_engine_wait_batch_end: the async facade's poller between
     * its batches).  done_mu and done_cv are touched only while someone waits. */
    uint64_t batches_ended;
    int end_waiters;
    int end_wakes;            /* fmc_engine_wake_end_waiters calls; guarded by done_mu */
    pthread_mutex_t done_mu;
    pthread_cond_t done_cv;
};

/* Registered host memory in huge pages (common/fmc_hugepages.c), by the engine's prefault mode:
 * prepare = ask for huge pages on future faults (and, FMC_PREFAULT_ALL, fault the region in now);
 * collapse_later = turn wholly resident 2 MiB chunks into huge pages, in the background; stop =
 * end the engine's background thread (engine destroy). */
void fmc_hugepages_prepare(const fmc_engine *e, uint64_t addr, uint64_t len);
void fmc_hugepages_collapse_later(fmc_engine *e, uint64_t addr, uint64_t len, uint32_t key);
void fmc_hugepages_stop(fmc_engine *e);
/* The region registered at addr under that key, or NULL (caller holds e->mu).  Pin it (NULL if
 * none): unregister waits for the pin to go.  Unpin takes it back.  (common/fmc_registry.c) */
fmc_region *fmc_region_at_locked(fmc_engine *e, uint64_t addr, uint32_t key);
fmc_region *fmc_region_pin(fmc_engine *e, uint64_t addr, uint32_t key);
void fmc_region_unpin(fmc_engine *e, fmc_region *r);

/* A line for the engine's message log (common/fmc_log.c). */
void fmc_engine_log(fmc_engine *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void *fmc_server_accept_main(void *arg);
/* 1 if every range lies in one registered region (writable if asked), with cuda_dev[i] its GPU
 * (-1: host memory); one lock for all.  On failure *bad_index names the first bad range. */
int fmc_local_ranges_ok(fmc_engine *e, int n, const uint64_t *addr, const uint64_t *len, int need_write,
                        int32_t *cuda_dev, int *bad_index);

/* -------------- batches and peers (engine/), streams (tcp/fmc_stream.c, fmc_peer_connect.c) */
typedef struct fmc_slice {
    struct fmc_batch *batch;
    struct fmc_slice *next;
    uint64_t local, remote, len, id;
    uint32_t key;
    int task;
    int local_dev;    /* GPU ordinal when the local side is device memory, else -1 */
    /* Guarded by the owning stream's mu.  `sending`: a write slice inside the sender's current
     * sendmsg (its memory may still be read).  An answer that arrives meanwhile is parked on the
     * stream's `answered` list with its status, and the sender finishes the slice once sendmsg
     * returns: a target that answers before taking every byte must not end the batch early. */
    int sending;
    int answer_status;
    int vec_n;        /* set when sent: >= 2 on the first slice of a vector of that many, else 1 */
} fmc_slice;

typedef struct {
    fmc_slice *head, *tail;
} fmc_slice_list;

/* Append one slice at the tail of `l`. */
static inline void fmc_slice_list_push(fmc_slice_list *l, fmc_slice *s)
{
    s->next = NULL;
    if (l->tail)
        l->tail->next = s;
    else
        l->head = s;
    l->tail = s;
}

struct fmc_batch {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct fmc_peer *peer;
    int opcode;
    int ntasks, nslices;
    int outstanding;     /* slices not yet in a final state */
    int first_error;
    int finished;        /* 1 once outstanding hit 0 */
    int cancelled;
    int counts_end;      /* its end counts in the engine's batches_ended (started for a poller) */
    int local_gpu;       /* some task's local range is GPU memory (a synchronous caller polls longer) */
    int spread;          /* tcp: its slices went out over more than one stream (shares, see
                          * FMC_ZC_SHARE_MIN_BYTES) */
    uint64_t bytes;
    int32_t *task_status;   /* FMC_TASK_PENDING, 0, or <0 */
    int32_t *task_remaining;
    uint8_t *task_cancelled; /* fmc_batch_cancel_tasks: its slices end, innocent ones are sent again */
    const struct fmc_transport_ops *ops; /* the transport that took it, for cancels and receives */
    fmc_slice *slices;
};

typedef struct fmc_stream {
    struct fmc_peer *peer;
    int index;
    int fd;
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* work queued or stream died */
    fmc_slice_list pending;   /* queued, not yet sent */
    fmc_slice_list inflight;  /* sent (or being sent), answer not yet consumed */
    fmc_slice_list receiving; /* answered, payload being read into local memory */
    fmc_slice_list answered;  /* answered while still `sending`; the sender finishes them */
    int sending_active;       /* a send round (thread or inline caller) owns the socket's send side */
    int handoff;              /* an inline round that could not block left its rest to the sender thread */
    int tx_lingering;         /* the send side's worker waits on cv for the next round (tx_run) */
    /* Both sides of the stream run on the process's I/O pool (fmc_stream.c) as two roles, each
     * taken by a worker once the socket has what it waits for and handed back (the socket
     * watched again) when it would block: threads follow the streams moving bytes now, not
     * the streams that exist.  The receive side watches for EPOLLRDHUP while nothing is in
     * flight (a peer closing an idle stream kills it) and for EPOLLIN once answers are due;
     * while a synchronous caller reads its own answers (`caller_recv`) nobody watches.  After a
     * bulk batch it keeps watching EPOLLIN, so the next batch's answers wake it themselves and
     * senders need not re-watch the socket before their first byte leaves; small calls keep
     * the quiet watch, so that their callers can claim their own answers (a caller claiming a
     * side that watches EPOLLIN quietens it first).  The send side is
     * armed (EPOLLOUT) while slices wait and no caller sends them itself, or while a round
     * waits for room in the socket. */
    fmc_reader rd;            /* answers read so far; used only by the receive side's owner */
    struct fmc_io_handle *io; /* what the pool's events and timers name: it outlives the stream */
    int rx_state, tx_state;   /* FMC_ROLE_* */
    uint32_t rx_events;       /* what an armed receive side waits for */
    uint32_t watched;         /* what the socket is watched for now (0: nothing, or it fired) */
    int roles_alive;          /* sides still on the connection */
    int leaving;              /* the last side out is settling the slices the stream held */
    struct rx_ring *rx_gpu;   /* the receive side's GPU landing pipeline (made with the stream) */
    int caller_recv;          /* a caller owns the receive side */
    int rx_lingering;         /* the receive side's worker waits on the socket alone (rx_wait): a
                               * caller may still claim the side, which the worker then parks */
    int bulk;                 /* the last batch queued here moved more than FMC_SMALL_TRANSFER_BYTES */
    fmc_fence send_fence[FMC_STAGE_DEPTH]; /* GPU sources' staging pieces, owned by whoever holds sending_active */
    struct send_scratch *scratch; /* a send round's headers and iovecs, likewise (made once) */
    int zc_link;              /* the connection stays within this host: zero-copy sends pay off */
    uint64_t zc_owed;         /* zero-copy read answers consumed, not yet acknowledged (fmc_wire.h) */
    int zc_ack_idle;          /* the stream idled with some owed: acknowledge them now */
    int64_t idle_since_ms;    /* when the receive side last parked with nothing in flight (ack timer) */
    int dead;
    int restart;              /* cut by a cancel: reconnect and send the innocent slices again */
    int reconnecting;         /* dead, but the sender is connecting again (slices may queue) */
    uint64_t token;           /* this connection's name at the target, for fences (0: none) */
    int target_fd;            /* the same-host target's fd of this connection, -1 unknown (fmc_zc_fence.c) */
} fmc_stream;

/* A side of a stream (fmc_stream's rx_state, tx_state). */
enum { FMC_ROLE_OFF, FMC_ROLE_ARMED, FMC_ROLE_RUNNING, FMC_ROLE_DONE };

/* One data connection to the peer, ready for requests (tcp/fmc_connection.c): the fd, or a
 * negative code with the error set; `fenced`: a cut connection's token the target must let go
 * of first; `slot`: a stream whose fd holds it meanwhile (a kill interrupts the wait). */
int fmc_open_data_connection(struct fmc_peer *p, int64_t deadline, uint64_t fenced, uint64_t *token,
                             fmc_stream *slot);
/* A stream's reader moves to connection fd (tcp/fmc_connection.c): nothing buffered, and outside a
 * deadline the socket's receive timeout is the stall tick fmc_open_data_connection set. */
void fmc_stream_reader_attach(fmc_reader *rd, int fd);
/* Reconnect a stream cut by a cancel (tcp/fmc_connection.c), with the target told to let go of
 * the old connection first; FMC_OK once the stream's socket is usable again. */
int fmc_stream_reconnect(fmc_stream *st);
/* Zero-copy fence (tcp/fmc_zc_fence.c): find the same-host target's end of each stream's socket
 * (zero-copy sends are used only where it is found), and close a stream's socket taking back
 * the spliced payloads its target has not read yet.  fmc_zc_fence_close: caller holds st->mu. */
void fmc_zc_fence_attach(struct fmc_peer *p, fmc_stream *const *streams, int n);
void fmc_zc_fence_close(fmc_stream *st);
/* Mark every task of a batch cancelled (a call past its deadline), or the unfinished ones of
 * [first, first + count) (1 if there was any).  (engine/fmc_completion.c) */
void fmc_batch_mark_cancelled(struct fmc_batch *b);
int fmc_batch_mark_tasks_cancelled(struct fmc_batch *b, int first, int count);
/* A transport's reason for a failure its slices will report: the batch's first error unless it
 * has one already.  (engine/fmc_completion.c) */
void fmc_batch_report_error(struct fmc_batch *b, int status);

/* ---------------------------------------------- transports: what engine/fmc_batch.c drives */
/* One transfer call's tasks as fmc_batch.c hands them to a transport, checked already: every
 * remote range lies in one region of the peer's table (keys[i] its key) and every local range in
 * one registered region (local_dev[i] its GPU, -1: host memory). */
typedef struct fmc_transfer_req {
    struct fmc_peer *peer;
    int opcode;
    int n;
    const uint64_t *local, *remote, *lens;
    const uint32_t *keys;
    const int32_t *local_dev;
    /* >= 0: the caller waits for the batch until this deadline (fmc_transfer), so the transport
     * may do the work in its thread; FMC_INLINE_NOWAIT: the caller waits, but must not block
     * (fmc_transfer_start polling); -1: the caller does not wait here. */
    int64_t inline_deadline_ms;
    int group;                  /* several calls gathered by the async facade (engine/coalesce.py) */
    int counts_end;             /* the batch's end counts in batches_ended (fmc_batch.counts_end) */
    const struct fmc_transport_ops *ops; /* the transport being asked (set by fmc_batch.c) */
    /* The batch for these tasks with room for `nslices` slices, made by fmc_batch.c and
     * stamped with `ops` and `counts_end`; NULL when memory runs out.  Handed in, as the Mooncake
     * codec is handed fmc_conn_ops, so that transports never call the file that drives them. */
    struct fmc_batch *(*new_batch)(const struct fmc_transfer_req *req, int nslices);
} fmc_transfer_req;

/* A transport declined a batch (fmc_transport_ops.submit): the next one in the peer's list gets it. */
#define FMC_DECLINED 1

/* What a batch needs from a transport.  A peer lists the transports that may carry its batches
 * (fmc_peer.transports, tried in order: same host first where it is enabled, then TCP); a new
 * transport (verbs, say) provides one of these and is added to the list where the peer is set
 * up for it.  Transports report how slices end through engine/fmc_completion.c alone. */
typedef struct fmc_transport_ops {
    /* Take a batch: make it (req->new_batch) and start it, or finish it here, with *out set,
     * returning FMC_OK; FMC_DECLINED (nothing made) when some task is not for this transport;
     * another code with the error set when it fails.  caller_rx: NULL, or where the transport
     * may leave something the caller must hand back through caller_receive (a small
     * synchronous write's receive side, which the caller then reads itself). */
    int (*submit)(const fmc_transfer_req *req, struct fmc_batch **out, void **caller_rx);
    /* 1 while the peer's connection through this transport takes batches (a cut stream coming
     * back counts); NULL: always.  A batch is refused (FMC_ERR_SOCKET) while any transport of
     * its peer is not, as the session whose connections broke is closed whole (sessions.py). */
    int (*healthy)(struct fmc_peer *p);
    /* Tasks [first, first + count) of one of its batches were marked cancelled: take back their
     * unstarted work and stop what is under way (returns without waiting; their slices end
     * through fmc_slices_finish).  NULL for a transport whose batches end inside submit. */
    void (*cancel_tasks)(struct fmc_batch *b, int first, int count);
    /* The caller of a batch submitted with *caller_rx set polls for its answers itself until
     * until_us, then hands back what caller_rx names.  wait_until_ms >= 0: it may also wait in a
     * receive for an answer that has begun to arrive, until then (the call's deadline); < 0: it
     * never blocks (an event loop's thread).  NULL if submit never sets it. */
    void (*caller_receive)(void *caller_rx, struct fmc_batch *b, int64_t until_us, int64_t wait_until_ms);
} fmc_transport_ops;

#define FMC_MAX_TRANSPORTS 4
extern const fmc_transport_ops fmc_tcp_ops;      /* tcp/fmc_tcp_transport.c: native and Mooncake framing */
extern const fmc_transport_ops fmc_samehost_ops; /* samehost/fmc_samehost_transport.c */

struct fmc_peer {
    fmc_engine *engine;
    char host[256];
    int data_port;
    int nstreams;
    int proto;                /* FMC_PROTO_NATIVE or FMC_PROTO_MOONCAKE (v2) */
    /* The transports its batches are offered to, in order (p->mu; set up before transfers):
     * TCP from fmc_peer_create, same host put first by fmc_peer_enable_same_host. */
    const fmc_transport_ops *transports[FMC_MAX_TRANSPORTS];
    int ntransports;
    int vectors;              /* the target takes vector requests (fmc_wire.h); set at connect */
    uint64_t slice_size;
    pthread_mutex_t mu;       /* remote table, state */
    uint64_t *r_addr, *r_len;
    uint32_t *r_key;
    int32_t *r_slot;          /* same-host slot of each region (-1: none) */
    uint32_t *r_gen;
    int32_t *r_dev;           /* GPU of each remote region (-1: host memory) */
    uint64_t *r_ipc_base;     /* its allocation's base over there, */
    uint64_t *r_ipc_mapped;   /* and where CUDA IPC mapped that allocation here (0: not mapped) */
    uint64_t *r_shm_mapped;   /* where the peer's shared memfd region is mapped here (0: not) */
    int r_count;
    /* Same-host copies in flight hold the mappings their routes point into (`map_users`); a
     * mapping dropped meanwhile (the region left the peer's table) is retired, and unmapped by
     * the last copy out, never under a copy (a GPU copy into an unmapped range would poison the
     * process's CUDA context). */
    int map_users;
    struct fmc_retired_map *retired;
    fmc_sh_ctrl *sh;          /* mapped control block of a same-host peer, else NULL */
    int sh_pid;
    int sh_words[FMC_SH_WORDS_PER_PEER]; /* busy words we own in the peer's control block */
    int sh_nwords;
    unsigned sh_free;         /* bit i: sh_words[i] not in use by a copy (guarded by sh_mu) */
    pthread_mutex_t sh_mu;
    pthread_cond_t sh_cv;     /* a busy word came free */
    int connected, closed;
    int connect_timeout_ms;   /* fmc_peer_connect's, for reconnecting a cut stream */
    /* Streams [0, nready) are connected: fmc_peer_connect connects the first, the I/O pool the
     * others as transfers come that would use them (fmc_peer_grow: up to grow_want). */
    atomic_int nready;
    atomic_int grow_want;
    atomic_int grow_queued;   /* a pool worker will connect up to grow_want */
    int growing;              /* the pool is connecting them (p->mu); a closing peer waits */
    pthread_cond_t grow_cv;
    fmc_pool_timer grow;      /* queues that work on the I/O pool */
    int owner_pid;            /* the peer's process when it runs on this host, else 0 */
    int64_t last_used_ms;     /* when its last transfer started (fmc_peer_idle_ms) */
    atomic_int refs;
    atomic_uint_fast32_t rr;  /* round-robin start stream */
    atomic_int hot_stream;    /* the stream small batches prefer (tcp/fmc_tcp_transport.c) */
    atomic_uint_fast64_t next_id;
    fmc_call_stats *call_stats; /* set once before the first transfer, or NULL */
    fmc_stream streams[FMC_MAX_STREAMS];
};

/* Have the I/O pool connect the peer's streams up to `want` (no-op if they are up). */
void fmc_peer_grow(struct fmc_peer *p, int want);
/* Run t's fire on the I/O pool as soon as a worker is free (fmc_stream.c). */
void fmc_io_pool_run_soon(fmc_pool_timer *t);

/* A same-host call's routes are done with: release the mappings they pointed into. */
void fmc_peer_routes_done(struct fmc_peer *p);
int fmc_peer_lookup_keys(struct fmc_peer *p, int n, const uint64_t *remote, const uint64_t *lens,
                         uint32_t *keys, int *bad_index);
int fmc_sh_engine_init(fmc_engine *e);
void fmc_sh_engine_free(fmc_engine *e);
void fmc_sh_slot_assign(fmc_engine *e, fmc_region *r);
int fmc_sh_slot_revoke(fmc_engine *e, fmc_region *r);
void fmc_sh_peer_release(struct fmc_peer *p);
void *fmc_map_peer_fd(int pid, int fd, size_t size); /* NULL (error set) if it cannot */
/* Per-task same-host route: slot/gen, and for GPU regions the address to copy at (in our
 * mapping) and the device.  0 if some task cannot take the same-host path. */
typedef struct {
    int32_t slot;
    uint32_t gen;
    int32_t dev;       /* -1: host memory; >= 0: cuMemcpy through the IPC mapping */
    uint64_t mapped;   /* remote address translated into our IPC or shared mapping (0: none) */
} fmc_sh_route;
int fmc_peer_lookup_routes(struct fmc_peer *p, int n, const uint64_t *remote, const uint64_t *lens,
                           const int32_t *local_dev, fmc_sh_route *routes);
int fmc_sh_transfer(struct fmc_peer *p, int opcode, int n, const uint64_t *local, const uint64_t *remote,
                    const uint64_t *lens, const int32_t *local_dev, const fmc_sh_route *routes, int64_t deadline_ms);
/* A list of slices, each with `status`, or with its own answer_status if status is FMC_TASK_PENDING. */
void fmc_slices_finish(fmc_slice *s, int status);
void fmc_stream_kill(fmc_stream *st);
int fmc_stream_enqueue(fmc_stream *st, fmc_slice_list *list);
int fmc_stream_enqueue_inline(fmc_stream *st, fmc_slice_list *list, int64_t deadline_ms, int claim_recv, int *claimed);
void fmc_stream_caller_receive(fmc_stream *st, struct fmc_batch *b, int64_t until_us, int64_t wait_until_ms);
int fmc_slice_cancelled(const fmc_slice *s);
void fmc_stream_cut(fmc_stream *st);
/* A connected stream's sides start on the I/O pool (fd set, dead clear); once a closing peer
 * killed it, fmc_stream_wait_gone returns when both sides have left, and fmc_stream_release
 * frees what the stream owns. */
int fmc_stream_start(fmc_stream *st);
void fmc_stream_wait_gone(fmc_stream *st);
void fmc_stream_release(fmc_stream *st);

#endif
