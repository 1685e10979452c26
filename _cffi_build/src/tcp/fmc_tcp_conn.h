/* Target side of a data connection (fmc_server.c), as the framings it serves see it: the
 * native framing in fmc_server.c, Mooncake's in fmc_mooncake.c.  Both read requests through the
 * connection's reader, pin regions, queue answers in `iov` and flush them the same way. */
#ifndef FMC_TCP_CONN_H
#define FMC_TCP_CONN_H

#include <sys/uio.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

#define FMC_FLUSH_BYTES (4u << 20) /* queued answer bytes that force a flush */

/* GPU memory through staging chunks (fmc_stage_pool.c), as a pipeline: a request's GPU bytes
 * are cut into pieces of at most one chunk; each piece's copy is queued on this thread's stream
 * and fenced, and the thread goes on with the next piece or request while it runs.  A piece
 * `lands` (its fence waited for) in request order: a write's answer is queued once its last
 * piece landed, a read's header and payload once each piece landed (the chunk then stays with
 * the queued answer until it is sent).  Pins taken for a request are held until it landed. */
#define FMC_LANDINGS FMC_STAGE_DEPTH
typedef struct {
    fmc_chunk *chunk;
    fmc_fence fence;     /* kept across uses: its event is made once */
    int is_read;
    int first, last;     /* the request's first (reads: the header goes first) and last piece */
    int failed;          /* its copy could not be queued */
    int dev;             /* -1: no copy to wait for (a piece of host entries only) */
    uint64_t id;
    int vec_n;           /* 0: a single request; else the vector's entry count */
    int vec_failed;      /* the vector has failed entries: statuses follow its header (cs->vec_status) */
    uint64_t ans_len;    /* reads: the answer's payload length (first piece) */
    uint64_t gpu_bytes;  /* bytes this piece copies (served once landed) */
    int npins;
    fmc_region *pins[FMC_VEC_MAX]; /* released once landed */
    int nparts;
    struct iovec parts[FMC_VEC_MAX]; /* reads: the piece's payloads in order (staged or in place) */
    int gpu_part[FMC_VEC_MAX];       /* reads: parts[i] is a staged GPU entry (a failure fails it) */
} fmc_landing;

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
    uint64_t zc_out;   /* zero-copy answer bytes the last send handed over (the initiator copies them after it) */
    uint64_t served_in, served_out; /* bytes since the last flush, added to the engine's counters there
                                       (one shared atomic add per request made the streams contend) */
    fmc_landing land[FMC_LANDINGS]; /* ring, oldest at land_head */
    int land_head, land_count;
    fmc_chunk *attached[FMC_STAGE_DEPTH]; /* landed read chunks that queued answers point into */
    int nattached;
    int broken;      /* a GPU copy failed: the connection goes at the next flush */
    int wire;        /* 0 until the first bytes told the framing (WIRE_NATIVE, WIRE_MOONCAKE) */
    struct {         /* r set: a host write whose payload stalled, `landed` bytes of it in place */
        fmc_region *r;
        uint64_t id, addr, len, landed;
        int64_t since; /* when it last moved */
    } parked;
} fmc_conn_state;


/* What serving Mooncake's framing (fmc_mooncake.c) uses of a connection, handed in by the
 * server, so that the framing's code never calls into the server.  pin: the region that holds
 * [addr, addr+len) under `key` (NULL: Mooncake's key-less framing, host memory only), writable
 * if asked; NULL if none.  unpin releases one such use.  flush sends every queued answer and
 * releases the pins they needed; -1 on a broken connection. */
typedef struct fmc_conn_ops {
    fmc_region *(*pin)(fmc_conn_state *cs, uint64_t addr, uint64_t len, const uint32_t *key, int for_write);
    void (*unpin)(fmc_conn_state *cs, fmc_region *r);
    int (*flush)(fmc_conn_state *cs);
} fmc_conn_ops;

#endif
