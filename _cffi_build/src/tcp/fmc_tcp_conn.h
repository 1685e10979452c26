/* Target side of a data connection (fmc_server.c), as the framings it serves see it: the
 * native framing in fmc_server.c, Mooncake's in fmc_mooncake.c.  Both read requests through the
 * connection's reader, pin regions, queue answers in `iov` and flush them the same way. */
#ifndef FMC_TCP_CONN_H
#define FMC_TCP_CONN_H

#include <sys/uio.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

#define FMC_FLUSH_BYTES (4u << 20) /* queued answer bytes that force a flush */

#define FMC_GPU_RUN_BYTES (2u << 20) /* a run of contiguous GPU writes is copied as one, up to this */
#define FMC_GPU_RUN_MAX 64           /* and up to this many writes */

typedef struct {
    int n; /* writes in the run; 0: none */
    int in_stage2, dev;
    uint64_t addr, len; /* the destination range so far */
    uint64_t ids[FMC_GPU_RUN_MAX];
    fmc_region *region; /* pinned by the run's first write, which covers the others */
} fmc_gpu_run;

/* Zero-copy read answers (fmc_wire.h): the initiator copies their bytes out of our pages only
 * when it reads its socket, so each such answer keeps its regions pinned until acknowledged.
 * A connection holds one pin per region (`fmc_zc_hold`) for all its unacknowledged answers, so the
 * ledger costs no lock per answer and few of the connection's FMC_MAX_PINS. */
#define ZC_LEDGER 256 /* unacknowledged zero-copy answers per connection; beyond, answers are copied */
#define ZC_HOLDS 8    /* regions they may hold pinned */
#define ZC_REGIONS 4  /* regions one zero-copy answer may span (more: copied) */

typedef struct {
    fmc_region *r;    /* NULL: free */
    uint32_t answers; /* unacknowledged answers that use it */
} fmc_zc_hold;

typedef struct {
    uint8_t hold[ZC_REGIONS];
    uint8_t n;
} fmc_zc_answer;

typedef struct fmc_conn_state {
    fmc_engine *e;
    fmc_server_conn *c;
    fmc_reader rd;
    struct iovec iov[FMC_IOV_MAX];
    uint8_t zc[FMC_IOV_MAX]; /* iov[i] is a zero-copy payload; cleared once sent */
    int nzc;                 /* how many are set */
    int zc_reads;            /* the initiator acknowledges zero-copy answers, and splice works */
    int zc_pipe[2];
    fmc_zc_hold holds[ZC_HOLDS];
    fmc_zc_answer ledger[ZC_LEDGER]; /* ring, oldest at ledger_head */
    uint32_t ledger_head, ledger_count;
    uint8_t hdr[FMC_IOV_MAX][FMC_RESP_SIZE];
    int niov, nhdr;
    size_t out_bytes;
    fmc_region *read_pins[FMC_IOV_MAX];
    int nread_pins;
    fmc_region *held; /* pinned until a flush finds it unused; see pin() */
    int held_uses;
    int vectors;                       /* the initiator may send vectors (fmc_wire.h) */
    int32_t vec_status[FMC_VEC_MAX];   /* a vector answer's entry statuses, until its flush */
    uint8_t *sink;                     /* refused vector entries are received here */
    uint64_t requests, vectors_answered, zc_answered; /* answered since the last flush */
    uint64_t last_len; /* bytes the last request moved: polling for the next pays only after small ones */
    uint64_t served_in, served_out; /* bytes since the last flush, added to the engine's counters there
                                       (one shared atomic add per request made the streams contend) */
    fmc_staging stage; /* GPU regions: payloads pass through here (and, alternating, stage2) */
    fmc_staging stage2;
    /* Writes into GPU memory: `gpu_open` collects consecutive writes whose destinations follow
     * each other into one staging buffer; `gpu_flying` is the run whose host-to-device copy is
     * running while the next one is received.  Answered (and unpinned) once its copy landed. */
    fmc_gpu_run gpu_open, gpu_flying;
} fmc_conn_state;

/* Pin the region that holds [addr, addr+len) under `key` (NULL: Mooncake's key-less framing,
 * host memory only), writable if asked; NULL if none.  Unpin releases one such use. */
fmc_region *fmc_conn_pin(fmc_conn_state *cs, uint64_t addr, uint64_t len, const uint32_t *key, int for_write);
void fmc_conn_unpin(fmc_conn_state *cs, fmc_region *r);
/* Send every queued answer and release the pins they needed; -1 on a broken connection. */
int fmc_conn_flush(fmc_conn_state *cs);

#endif
