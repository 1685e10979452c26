/* Target side of the native data plane: one accept thread per engine; inbound connections are
 * served by the process's serve pool (below, on fmc_worker_pool.c), one worker at a time per
 * connection while it has input (Mooncake's framing keeps a thread per connection).  Every request is
 * checked against the registry (range and key) before a byte is touched; writes go straight into registered memory and are answered after they land; reads are sent
 * straight from registered memory.  Answers are gathered and flushed when the input runs dry. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_mooncake.h"
#include "fmc_tcp_conn.h"
#include "fmc_wire.h"
#include "fmc_worker_pool.h"

#define FMC_MAX_SERVER_CONNS 4096
#define FMC_PREAMBLE_TIMEOUT_MS 5000
/* A served connection's receive and send timeouts: a write's payload that stops coming for this
 * long is parked (receive_host_write) and its worker freed.  Other blocking reads within a
 * request, and sends of answers, wait on as stalls, outside the pool's cap (fmc_pool_stall), up
 * to FMC_STALL_MS without a byte (fmc_util.c): then the connection is dropped. */
#define FMC_PARK_MS FMC_STALL_TICK_MS

static fmc_worker_pool serve_pool; /* defined with serve_event below; counts the connections it serves */

static void set_served_timeouts(int fd)
{
    fmc_socket_timeout(fd, SO_RCVTIMEO, FMC_PARK_MS);
    fmc_socket_timeout(fd, SO_SNDTIMEO, FMC_PARK_MS);
}

/* Regions are pinned (refs, under the engine lock) while a request touches them; unregister waits
 * for refs to drop.  Taking the lock twice per request made four streams of 4 KiB writes queue on
 * it, so a connection holds one pin on the first region it uses in a flush window (`held`, listed
 * in c->pins so that unregister can cut the connection) until a flush finds it unused; flushes
 * come before the thread can block waiting for a request.  Uses of the held region are counted
 * in `held_uses`, by this thread alone: no lock and no shared cache line per request.  Such a use
 * still sees an unregister: `removed` is set under the lock and read here without it. */

static int region_accepts(const fmc_region *r, const uint32_t *key, int for_write)
{
    return (key ? r->key == *key : r->cuda_dev < 0) /* Mooncake's framing: host memory only */
           && (!for_write || r->writable);
}

/* Pin the region that holds [addr, addr+len) under `key` (NULL: Mooncake's key-less framing), or
 * return NULL.  A write also needs a region that was mapped writable when registered (else the
 * memcpy into it would crash us). */
static fmc_region *pin(fmc_conn_state *cs, uint64_t addr, uint64_t len, const uint32_t *key, int for_write)
{
    fmc_region *h = cs->held;
    if (h && fmc_region_holds(h, addr, len) && region_accepts(h, key, for_write) &&
        !__atomic_load_n(&h->removed, __ATOMIC_ACQUIRE)) {
        cs->held_uses++;
        return h;
    }
    fmc_engine *e = cs->e;
    pthread_mutex_lock(&e->mu);
    fmc_region *r = fmc_registry_find(&e->reg, addr, len);
    if (r && (r->removed || cs->c->npins >= FMC_MAX_PINS || !region_accepts(r, key, for_write)))
        r = NULL;
    if (r) {
        r->refs++;
        cs->c->pins[cs->c->npins++] = r;
        if (cs->held == NULL) { /* this pin becomes the held one, and this its first use */
            cs->held = r;
            cs->held_uses = 1;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return r;
}

static void unpin_locked(fmc_engine *e, fmc_server_conn *c, fmc_region *r)
{
    for (int i = 0; i < c->npins; i++) {
        if (c->pins[i] == r) {
            c->pins[i] = c->pins[--c->npins];
            break;
        }
    }
    if (--r->refs == 0 && r->removed)
        pthread_cond_broadcast(&e->cv);
}

/* Release one use of r; a use of the held region only lowers the count. */
static void unpin(fmc_conn_state *cs, fmc_region *r)
{
    if (r == cs->held && cs->held_uses > 0) {
        cs->held_uses--;
        return;
    }
    pthread_mutex_lock(&cs->e->mu);
    unpin_locked(cs->e, cs->c, r);
    pthread_mutex_unlock(&cs->e->mu);
}

/* Drop the held region's pin once nothing uses it; called at every flush. */
static void release_held(fmc_conn_state *cs)
{
    if (!cs->held || cs->held_uses > 0)
        return;
    pthread_mutex_lock(&cs->e->mu);
    unpin_locked(cs->e, cs->c, cs->held);
    cs->held = NULL;
    pthread_mutex_unlock(&cs->e->mu);
}

static void push_answer(fmc_conn_state *cs, uint64_t id, int32_t status, void *data, uint64_t len);
static void push_header(fmc_conn_state *cs, uint64_t id, int32_t status, uint64_t len, uint32_t flags);

/* Take a read answer of `bytes` from host regions `regs` (NULLs skipped) into the zero-copy
 * ledger; 0 (copy it instead) when the connection does not do zero-copy answers, the answer is
 * small, or the ledger has no room.  Its regions stay pinned until zc_acknowledge. */
static int zc_claim(fmc_conn_state *cs, fmc_region *const *regs, int n, uint64_t bytes)
{
    if (!cs->zc_reads || bytes < FMC_ZC_MIN_BYTES || cs->ledger_count == ZC_LEDGER || !fmc_zc_enabled(cs->e))
        return 0;
    fmc_zc_answer a = {.n = 0};
    int fresh = 0; /* holds this answer needs that do not exist yet */
    fmc_region *want[ZC_REGIONS];
    for (int i = 0; i < n; i++) {
        fmc_region *r = regs[i];
        int seen = 0;
        for (int j = 0; j < fresh && !seen; j++)
            seen = want[j] == r;
        for (int j = 0; j < a.n && !seen; j++)
            seen = cs->holds[a.hold[j]].r == r;
        if (!r || seen)
            continue;
        int h = 0;
        while (h < ZC_HOLDS && cs->holds[h].r != r)
            h++;
        if (a.n + fresh == ZC_REGIONS)
            return 0;
        if (h < ZC_HOLDS)
            a.hold[a.n++] = (uint8_t)h;
        else
            want[fresh++] = r;
    }
    int free_holds = 0;
    for (int h = 0; h < ZC_HOLDS; h++)
        free_holds += cs->holds[h].r == NULL;
    if (fresh > free_holds || (fresh && cs->c->npins + fresh >= FMC_MAX_PINS / 2))
        return 0;
    if (fresh) {
        pthread_mutex_lock(&cs->e->mu);
        for (int j = 0, h = 0; j < fresh; j++, h++) {
            while (cs->holds[h].r)
                h++;
            cs->holds[h].r = want[j]; /* pinned by this answer's read pins until now, so alive */
            want[j]->refs++;
            cs->c->pins[cs->c->npins++] = want[j];
            cs->c->zc_pins++;
            a.hold[a.n++] = (uint8_t)h;
        }
        pthread_mutex_unlock(&cs->e->mu);
    }
    for (int j = 0; j < a.n; j++)
        cs->holds[a.hold[j]].answers++;
    cs->ledger[(cs->ledger_head + cs->ledger_count++) % ZC_LEDGER] = a;
    cs->zc_answered++;
    return 1;
}

/* The initiator consumed its `n` oldest zero-copy answers: release what they held.  -1 when it
 * acknowledges more than it was sent (a protocol error). */
static int zc_acknowledge(fmc_conn_state *cs, uint64_t n)
{
    if (n == 0 || n > cs->ledger_count)
        return -1;
    int locked = 0;
    for (; n; n--) {
        fmc_zc_answer *a = &cs->ledger[cs->ledger_head];
        cs->ledger_head = (cs->ledger_head + 1) % ZC_LEDGER;
        cs->ledger_count--;
        for (int j = 0; j < a->n; j++) {
            fmc_zc_hold *h = &cs->holds[a->hold[j]];
            if (--h->answers)
                continue;
            if (!locked++)
                pthread_mutex_lock(&cs->e->mu);
            unpin_locked(cs->e, cs->c, h->r);
            cs->c->zc_pins--;
            h->r = NULL;
        }
    }
    if (locked)
        pthread_mutex_unlock(&cs->e->mu);
    return 0;
}

/* Queue payload iovecs of an answer, flagged for zero-copy when the answer is. */
static void push_payload(fmc_conn_state *cs, void *data, uint64_t len, int zc)
{
    cs->zc[cs->niov] = (uint8_t)zc;
    cs->nzc += zc;
    cs->iov[cs->niov++] = (struct iovec){.iov_base = data, .iov_len = (size_t)len};
    cs->out_bytes += len;
}

/* A write payload of FMC_ZC_MIN_BYTES or more may have been sent zero-copy (fmc_splice.c): its
 * bytes are read out of the initiator's pages only now.  An initiator that reset the connection
 * has failed that call and may be reusing those pages, so such a payload must not land: one
 * poll() says whether the connection was reset (bytes queued before the reset stay readable). */
static int initiator_gave_up(fmc_conn_state *cs, uint64_t payload_len)
{
    return payload_len >= FMC_ZC_MIN_BYTES && fmc_socket_reset(cs->c->fd);
}

/* The queued answers, zero-copy payloads through this thread's pipe.  An initiator that stops
 * reading them makes this a stall after FMC_PARK_MS (fmc_pool_stall). */
static int send_answers(fmc_conn_state *cs)
{
    if (!cs->niov)
        return 0; /* zc_out keeps the last answers that did go out */
    cs->zc_out = 0;
    int rc;
    if (!cs->nzc) {
        rc = fmc_sendv_all(cs->c->fd, cs->iov, cs->niov);
    } else {
        for (int i = 0; i < cs->niov; i++)
            cs->zc_out += cs->zc[i] ? cs->iov[i].iov_len : 0;
        rc = fmc_sendv_zc(cs->c->fd, cs->iov, cs->niov, cs->zc, -1);
        memset(cs->zc, 0, (size_t)cs->niov);
        cs->nzc = 0;
    }
    /* The kernel checks every byte it sends: a region made unreadable after registration fails
     * the send (part of the answers may be on the wire already, so the connection goes). */
    if (rc < 0 && errno == EFAULT)
        fmc_engine_log(cs->e, "dropped a data connection: the kernel refused to read registered memory for a read "
                       "answer (its protection changed after registration?)");
    return rc;
}

/* Send what is queued now, then release what the queued answers needed: the read pins and the
 * staging chunks they pointed into.  The held pin and the counters wait for a flush. */
static int send_out(fmc_conn_state *cs)
{
    FMC_TR(FMC_TR_ANSWER, cs->rd.fd, cs->niov);
    int rc = cs->broken ? -1 : send_answers(cs);
    FMC_TR(FMC_TR_ANSWERED, cs->rd.fd, 0);
    for (int i = 0; i < cs->nread_pins; i++)
        unpin(cs, cs->read_pins[i]);
    for (int i = 0; i < cs->nattached; i++)
        fmc_stage_put(&cs->e->stage, cs->attached[i]);
    cs->niov = cs->nhdr = cs->nread_pins = cs->nattached = 0;
    cs->out_bytes = 0;
    return rc;
}

static void queue_vector_answer(fmc_conn_state *cs, uint64_t id, int n, int failed, uint64_t len, int zc);

/* A copy to or from GPU memory failed (the device is gone, or its context broken): the bytes
 * of that request cannot be trusted, so the connection goes (the initiator fails what it had in
 * flight), logged once. */
static void gpu_broken(fmc_conn_state *cs)
{
    if (!cs->broken)
        fmc_engine_log(cs->e, "dropped a data connection: a copy between GPU memory and staging failed");
    cs->broken = 1;
}

/* The oldest piece in the pipeline lands: its fence is waited for; a write's pins and chunk go
 * and, at its request's last piece, the answer is queued; a read's header (first piece) and
 * payloads are queued, its chunk kept until they are sent. */
static void land_oldest(fmc_conn_state *cs)
{
    fmc_landing *l = &cs->land[cs->land_head];
    cs->land_head = (cs->land_head + 1) % FMC_LANDINGS;
    cs->land_count--;
    FMC_TR(FMC_TR_LAND_WAIT, cs->rd.fd, 0);
    if (l->failed || fmc_cuda_fence_wait(&l->fence) != FMC_OK)
        gpu_broken(cs);
    FMC_TR(FMC_TR_LANDED, cs->rd.fd, 0);
    if (cs->broken) { /* nothing more is answered on this connection */
        for (int i = 0; i < l->npins; i++)
            unpin(cs, l->pins[i]);
        fmc_stage_put(&cs->e->stage, l->chunk);
        l->chunk = NULL;
        return;
    }
    if (cs->niov + l->nparts + 3 > FMC_IOV_MAX || cs->nhdr + 1 >= FMC_IOV_MAX ||
        cs->nread_pins + l->npins > FMC_IOV_MAX || cs->nattached == FMC_STAGE_DEPTH)
        send_out(cs); /* a failure shows at the next send */
    if (!l->is_read) {
        for (int i = 0; i < l->npins; i++)
            unpin(cs, l->pins[i]);
        fmc_stage_put(&cs->e->stage, l->chunk);
        cs->served_in += l->gpu_bytes;
        if (l->last && l->vec_n)
            queue_vector_answer(cs, l->id, l->vec_n, l->vec_failed, 0, 0);
        else if (l->last)
            push_answer(cs, l->id, FMC_OK, NULL, 0);
    } else {
        if (l->first && l->vec_n)
            queue_vector_answer(cs, l->id, l->vec_n, l->vec_failed, l->ans_len, 0);
        else if (l->first)
            push_header(cs, l->id, FMC_OK, l->ans_len, 0);
        for (int i = 0; i < l->nparts; i++)
            push_payload(cs, l->parts[i].iov_base, l->parts[i].iov_len, 0);
        for (int i = 0; i < l->npins; i++) {
            if (l->pins[i]->cuda_dev >= 0)
                unpin(cs, l->pins[i]); /* staged: the answer no longer reads it */
            else
                cs->read_pins[cs->nread_pins++] = l->pins[i]; /* sent from in place */
        }
        cs->attached[cs->nattached++] = l->chunk;
    }
    l->chunk = NULL;
}

/* Every piece in the pipeline landed, its answers queued: answers keep request order, so this
 * runs before any other answer is queued, and before a flush.  Once a chunk's worth of answers
 * is queued it leaves before the next piece is waited for, so a read's first pieces are on the
 * wire while its later gathers finish (a vector of one stream's 2 MiB share otherwise waited for
 * all four gathers first; on the H200, contiguous 16 KiB GPU reads moved 11.1-11.3 instead of
 * 10.3-10.5 GB/s, paged 64 KiB 17-20 instead of 16-17.5).  Small answers still go together. */
static void land_all(fmc_conn_state *cs)
{
    while (cs->land_count) {
        land_oldest(cs);
        if (cs->land_count && cs->out_bytes >= FMC_STAGE_CHUNK && send_out(cs) < 0)
            cs->broken = 1; /* what is left lands and is let go; the connection goes */
    }
}

/* A staging chunk of class `cls` for a piece on `dev`: the connection holds at most
 * FMC_STAGE_DEPTH (in the pipeline or under queued answers); at that many, or with none free in
 * the pool, queued answers are sent, else the oldest piece lands, and the chunk is asked for
 * again.  Only a connection that holds none waits for the pool (outside the pool's count,
 * fmc_stage_get: the chunks may be held by connections whose initiators stopped mid-payload).
 * NULL: cut, or no memory. */
static fmc_chunk *conn_chunk(fmc_conn_state *cs, int cls, int dev)
{
    for (;;) {
        int held = cs->land_count + cs->nattached;
        if (held < FMC_STAGE_DEPTH) {
            fmc_chunk *k = fmc_stage_get(&cs->e->stage, cls, dev, held ? 0 : -1, &cs->c->cut);
            if (k || !held)
                return k;
        }
        if (cs->nattached) {
            if (send_out(cs) < 0)
                return NULL;
        } else {
            land_oldest(cs);
        }
    }
}

/* The next slot of the pipeline (conn_chunk left room), cleared. */
static fmc_landing *land_slot(fmc_conn_state *cs, fmc_chunk *chunk, int dev, int is_read, uint64_t id)
{
    fmc_landing *l = &cs->land[(cs->land_head + cs->land_count) % FMC_LANDINGS];
    cs->land_count++;
    l->chunk = chunk;
    l->dev = dev;
    l->is_read = is_read;
    l->id = id;
    l->first = l->last = l->failed = l->vec_n = l->vec_failed = 0;
    l->ans_len = l->gpu_bytes = 0;
    l->npins = l->nparts = 0;
    return l;
}

/* A single write into GPU memory: received piece by piece into staging chunks, each copied to
 * the GPU while the next arrives; answered once its last piece landed.  -1 on a broken
 * connection (r unpinned). */
static int receive_into_gpu(fmc_conn_state *cs, fmc_region *r, uint64_t id, uint64_t addr, uint64_t len)
{
    for (uint64_t off = 0; off < len;) {
        size_t piece = len - off < FMC_STAGE_CHUNK ? (size_t)(len - off) : FMC_STAGE_CHUNK;
        fmc_chunk *k = conn_chunk(cs, FMC_STAGE_RECV, r->cuda_dev);
        FMC_TR(FMC_TR_RECV, cs->rd.fd, 1);
        if (!k || fmc_reader_read_into(&cs->rd, k->buf, piece) < 0) {
            fmc_stage_put(&cs->e->stage, k);
            /* Earlier pieces' copies may still be writing into the region, whose pin only the
             * last piece would have held: they land before it is let go. */
            land_all(cs);
            unpin(cs, r);
            return -1;
        }
        FMC_TR(FMC_TR_RECEIVED, cs->rd.fd, piece);
        fmc_landing *l = land_slot(cs, k, r->cuda_dev, 0, id);
        l->failed = fmc_cuda_copy_async(addr + off, (uint64_t)(uintptr_t)k->buf, piece, r->cuda_dev) != FMC_OK ||
                    fmc_cuda_fence_record(&l->fence, r->cuda_dev) != FMC_OK;
        l->gpu_bytes = piece;
        off += piece;
        l->last = off == len;
        if (l->last)
            l->pins[l->npins++] = r; /* held until the last piece landed */
    }
    return 0;
}

/* A single read from GPU memory: gathered piece by piece into staging chunks, each queued as
 * part of the answer once landed, while the next pieces' copies run.  -1 if it cannot go on. */
static int send_from_gpu(fmc_conn_state *cs, fmc_region *r, uint64_t id, uint64_t addr, uint64_t len)
{
    for (uint64_t off = 0; off < len;) {
        size_t piece = len - off < FMC_STAGE_CHUNK ? (size_t)(len - off) : FMC_STAGE_CHUNK;
        fmc_chunk *k = conn_chunk(cs, FMC_STAGE_SEND, r->cuda_dev);
        if (!k) {
            land_all(cs); /* earlier pieces' gathers still read the region (see receive_into_gpu) */
            unpin(cs, r);
            return -1;
        }
        fmc_landing *l = land_slot(cs, k, r->cuda_dev, 1, id);
        l->failed = fmc_cuda_copy_async((uint64_t)(uintptr_t)k->buf, addr + off, piece, r->cuda_dev) != FMC_OK ||
                    fmc_cuda_fence_record(&l->fence, r->cuda_dev) != FMC_OK;
        l->first = off == 0;
        l->ans_len = len;
        l->parts[l->nparts++] = (struct iovec){.iov_base = k->buf, .iov_len = piece};
        off += piece;
        l->last = off == len;
        if (l->last)
            l->pins[l->npins++] = r;
    }
    cs->served_out += len;
    return 0;
}

static int flush(fmc_conn_state *cs)
{
    land_all(cs);
    /* Counted before the answers leave, so an initiator that has its answer sees the counters
     * include it (tests and metrics read them right after a call returns). */
    if (cs->requests | cs->served_in | cs->served_out) {
        cs->e->stat_served_in += cs->served_in;
        cs->e->stat_served_out += cs->served_out;
        cs->e->stat_requests += cs->requests;
        cs->e->stat_vectors += cs->vectors_answered;
        cs->e->stat_zc_answers += cs->zc_answered;
        cs->served_in = cs->served_out = cs->requests = cs->vectors_answered = cs->zc_answered = 0;
    }
    int rc = send_out(cs);
    release_held(cs); /* last: the uses above were counted against it */
    return rc < 0 || cs->broken ? -1 : rc;
}

/* pin, unpin and flush for Mooncake's framing (fmc_mooncake.c); the native loop calls them
 * directly, where the compiler may inline them. */
static const fmc_conn_ops conn_ops = {.pin = pin, .unpin = unpin, .flush = flush};

static void queue_answer(fmc_conn_state *cs, uint64_t id, int32_t status, void *data, uint64_t len)
{
    land_all(cs); /* earlier GPU requests answer first */
    push_answer(cs, id, status, data, len);
}

/* Queue one answer header (native framing) announcing `len` bytes to follow. */
static void push_header(fmc_conn_state *cs, uint64_t id, int32_t status, uint64_t len, uint32_t flags)
{
    cs->requests++;
    fmc_resp resp = {.id = id, .status = status, .flags = flags, .len = len};
    uint8_t *h = cs->hdr[cs->nhdr++];
    fmc_resp_encode(h, &resp);
    cs->iov[cs->niov++] = (struct iovec){.iov_base = h, .iov_len = FMC_RESP_SIZE};
    cs->out_bytes += FMC_RESP_SIZE;
}

static void push_answer(fmc_conn_state *cs, uint64_t id, int32_t status, void *data, uint64_t len)
{
    push_header(cs, id, status, data ? len : 0, 0);
    if (data)
        push_payload(cs, data, len, 0);
}

/* A successful read from host region r, zero-copy when the ledger takes it (a share of a call
 * spread over several streams, FMC_REQ_SHARE, only from FMC_ZC_SHARE_MIN_BYTES: copied, such
 * answers moved faster). */
static void queue_read_answer(fmc_conn_state *cs, const fmc_req *q, fmc_region *r)
{
    land_all(cs);
    cs->read_pins[cs->nread_pins++] = r;
    uint64_t id = q->id, addr = q->addr, len = q->len;
    int zc = len >= fmc_zc_least_bytes((q->flags & FMC_REQ_SHARE) != 0) && zc_claim(cs, &r, 1, len);
    push_header(cs, id, FMC_OK, len, zc ? FMC_RESP_ZC : 0);
    push_payload(cs, (void *)(uintptr_t)addr, len, zc);
}

static void refuse(fmc_conn_state *cs, const fmc_req *q)
{
    cs->e->stat_refused++;
    const char *what = q->opcode == FMC_WIRE_OP_WRITE ? "write" : "read";
    const char *ro = q->opcode == FMC_WIRE_OP_WRITE ? " (or the region is read-only)" : "";
    fmc_engine_log(cs->e, "refused %s of %llu bytes at 0x%llx (key %u): not inside a registered region with that key%s",
                   what, (unsigned long long)q->len, (unsigned long long)q->addr, q->key, ro);
}

/* A write whose destination the kernel refused to write (the region was made read-only or
 * unmapped after registration): its payload was dropped and the request is refused. */
static void refuse_protected(fmc_conn_state *cs, uint64_t addr, uint64_t len)
{
    cs->e->stat_refused++;
    fmc_engine_log(cs->e, "refused write of %llu bytes at 0x%llx: the kernel refused to write the registered "
                   "memory (its protection changed after registration?)",
                   (unsigned long long)len, (unsigned long long)addr);
}

enum { WIRE_NATIVE = 1, WIRE_MOONCAKE = 2 };

/* An initiator that sends vectors gets small reads: a vector's payloads then stay in the socket
 * until their destinations are known, and go there with one recvmsg. */
#define FMC_VEC_READ_AHEAD (8u << 10)
static void use_vectors(fmc_conn_state *cs, uint32_t caps)
{
    cs->zc_reads = (caps & FMC_CAP_ZC_READS) != 0;
    cs->vectors = (caps & FMC_CAP_VECTORS) != 0;
    if (cs->vectors)
        cs->rd.max_read = FMC_VEC_READ_AHEAD;
}

/* The first 8 bytes tell the framing: our preamble's magic, or (anything else) the `size` field
 * of a Mooncake header.  Returns WIRE_NATIVE / WIRE_MOONCAKE, or -1 to drop the connection. */
static int handshake(fmc_conn_state *cs)
{
    fmc_socket_timeout(cs->c->fd, SO_RCVTIMEO, FMC_PREAMBLE_TIMEOUT_MS);
    if (fmc_reader_fill(&cs->rd, 8) < 0)
        return -1;
    if (memcmp(cs->rd.buf + cs->rd.start, FMC_MAGIC_HELLO, 8) != 0) {
        pthread_mutex_lock(&cs->e->mu);
        int mooncake = cs->e->accept_mooncake_wire;
        pthread_mutex_unlock(&cs->e->mu);
        if (mooncake)
            return WIRE_MOONCAKE; /* keeps the receive timeout until a whole header arrived */
        fmc_mc_refuse_connection(cs);
        return -1;
    }
    if (fmc_reader_fill(&cs->rd, FMC_PREAMBLE_SIZE) < 0)
        return -1;
    const uint8_t *p = cs->rd.buf + cs->rd.start;
    uint32_t version = fmc_get32(p + 8), flags = fmc_get32(p + 12);
    int ok = memcmp(p, FMC_MAGIC_HELLO, 8) == 0 && version == FMC_WIRE_VERSION;
    cs->rd.start += FMC_PREAMBLE_SIZE;
    uint8_t client_nonce[FMC_NONCE_SIZE];
    if (ok && (flags & FMC_PREAMBLE_AUTH)) {
        if (fmc_reader_fill(&cs->rd, FMC_NONCE_SIZE) < 0)
            return -1;
        memcpy(client_nonce, cs->rd.buf + cs->rd.start, FMC_NONCE_SIZE);
        cs->rd.start += FMC_NONCE_SIZE;
    }
    fmc_secret secret;
    pthread_mutex_lock(&cs->e->mu);
    secret = cs->e->secret;
    pthread_mutex_unlock(&cs->e->mu);
    uint32_t caps = FMC_CAP_FENCE | ((flags & FMC_PREAMBLE_VECTORS) ? FMC_CAP_VECTORS : 0);
    if ((flags & FMC_PREAMBLE_READ_ACKS) && fmc_zc_enabled(cs->e) && fmc_socket_is_local(cs->c->fd))
        caps |= FMC_CAP_ZC_READS;
    uint8_t reply[FMC_PREAMBLE_SIZE] = {0};
    memcpy(reply, FMC_MAGIC_OK, 8);
    if (ok && secret.len) {
        int rc = (flags & FMC_PREAMBLE_AUTH) ? fmc_auth_server(cs->c->fd, &secret, client_nonce, caps)
                                             : FMC_ERR_REJECT_HANDSHAKE;
        memset(&secret, 0, sizeof secret);
        if (rc != FMC_OK) {
            if (!(flags & FMC_PREAMBLE_AUTH)) {
                fmc_put32(reply + 8, (uint32_t)FMC_ERR_REJECT_HANDSHAKE);
                fmc_send_all(cs->c->fd, reply, sizeof reply);
            }
            fmc_engine_log(cs->e, "refused a data connection: %s",
                           rc == FMC_ERR_NOT_IMPLEMENTED ? fmc_last_error()
                           : flags & FMC_PREAMBLE_AUTH  ? "wrong shared secret"
                                                        : "no shared secret offered");
            return -1;
        }
        set_served_timeouts(cs->c->fd);
        use_vectors(cs, caps);
        return WIRE_NATIVE;
    }
    fmc_put32(reply + 8, (uint32_t)(ok ? 0 : FMC_ERR_REMOTE_REFUSED));
    fmc_put32(reply + 12, ok ? caps : 0);
    if (fmc_send_all(cs->c->fd, reply, sizeof reply) < 0 || !ok)
        return -1;
    set_served_timeouts(cs->c->fd);
    use_vectors(cs, caps);
    return WIRE_NATIVE;
}

/* Microseconds an initiator takes to copy n bytes out of a zero-copy answer: n >> 13, 8 GB/s. */
#define COPY_OUT_US(n) ((int)((n) >> 13))

/* After answering a small request, poll briefly for the next one before sleeping (the
 * engine's spin_us): back-to-back small requests then find this thread awake.  After a
 * zero-copy answer (zc_out bytes) the window opens that much later: our send returned once the
 * pages were queued, and the initiator copies them only then, so its next request comes after
 * that copy (back-to-back 256 KiB reads on 2 CPUs found this thread asleep in 0-2 % of calls,
 * against 12-26 %).  At most a small transfer's copy is added: after the answers to many reads
 * the initiator takes long enough that polling would only burn a CPU. */
static int spin_for_more(const fmc_engine *e, fmc_reader *rd, size_t need, uint64_t last_len, uint64_t zc_out)
{
    int spin = fmc_spin_us_after(e, last_len);
    if (spin <= 0)
        return 0;
    spin += COPY_OUT_US(zc_out < FMC_SMALL_TRANSFER_BYTES ? zc_out : FMC_SMALL_TRANSFER_BYTES);
    FMC_TR(FMC_TR_SPIN, rd->fd, last_len);
    int64_t until = fmc_now_us() + spin;
    while (fmc_reader_buffered(rd) < need && fmc_now_us() < until) {
        if (fmc_reader_try_more(rd) < 0)
            return -1;
        sched_yield();
    }
    return 0;
}

/* Queue a vector's answer header, and its entry statuses when some entry failed. */
static void queue_vector_answer(fmc_conn_state *cs, uint64_t id, int n, int failed, uint64_t len, int zc)
{
    cs->vectors_answered++;
    push_header(cs, id, failed ? FMC_ERR_REMOTE_REFUSED : FMC_OK, len + (failed ? (uint64_t)n * 4 : 0),
                zc ? FMC_RESP_ZC : 0);
    if (failed) {
        for (int i = 0; i < n; i++)
            cs->vec_status[i] = (int32_t)htole32((uint32_t)cs->vec_status[i]);
        cs->iov[cs->niov++] = (struct iovec){.iov_base = cs->vec_status, .iov_len = (size_t)n * 4};
        cs->out_bytes += (size_t)n * 4;
    }
}

/* The end of the piece of a vector's entries that starts at `i`: entries up to the next GPU
 * entry that would not fit in one chunk or lies on another device (host entries ride along);
 * *dev gets the piece's device. */
static int piece_end(fmc_region *const *reg, const uint64_t *len, int i, int n, int *dev)
{
    uint64_t staged = 0;
    *dev = -1;
    for (; i < n; i++) {
        if (!reg[i] || reg[i]->cuda_dev < 0)
            continue;
        if (*dev >= 0 && (reg[i]->cuda_dev != *dev || staged + len[i] > FMC_STAGE_CHUNK))
            break;
        *dev = reg[i]->cuda_dev;
        staged += len[i];
    }
    return i;
}

/* Queue one gather (the copy kernel or the driver's batch, by gpu_copy) of a piece's GPU entries
 * between GPU memory and the chunk, and fence it. */
static void piece_copy(fmc_conn_state *cs, fmc_landing *l, uint64_t *dst, uint64_t *src, size_t *sz, int m)
{
    l->failed = fmc_stage_copy(cs->e, l->chunk, &l->fence, dst, src, sz, m, l->dev, !l->is_read) != FMC_OK;
}

/* A vector write with GPU entries, all its entries pinned or refused: piece by piece, the
 * payloads are received with one scatter read (GPU entries side by side into a chunk, host
 * entries in place, refused ones into the sink) and the chunk's copy to the GPU is queued while
 * the next piece arrives.  Answered when its last piece has landed.  -1: connection broken. */
static int vector_write_gpu(fmc_conn_state *cs, const fmc_req *q, int n, const uint64_t *addr, const uint64_t *len,
                            fmc_region **reg, int failed, uint64_t ok_bytes)
{
    uint64_t host_bytes = ok_bytes;
    for (int i = 0, j, dev; i < n; i = j) {
        j = piece_end(reg, len, i, n, &dev);
        fmc_chunk *k = conn_chunk(cs, FMC_STAGE_RECV, dev);
        struct iovec iov[FMC_VEC_MAX];
        uint8_t refused[FMC_VEC_MAX] = {0};
        uint64_t dst[FMC_VEC_MAX], src[FMC_VEC_MAX], off = 0;
        size_t sz[FMC_VEC_MAX];
        int m = 0;
        for (int e = i; k && e < j; e++) {
            void *at = reg[e] ? (void *)(uintptr_t)addr[e] : cs->sink;
            if (reg[e] && reg[e]->cuda_dev >= 0) {
                at = k->buf + off;
                dst[m] = addr[e];
                src[m] = (uint64_t)(uintptr_t)at;
                sz[m++] = (size_t)len[e];
                off += len[e];
            }
            iov[e - i] = (struct iovec){.iov_base = at, .iov_len = (size_t)len[e]};
        }
        FMC_TR(FMC_TR_RECV, cs->rd.fd, j - i);
        if (!k || fmc_reader_read_regions(&cs->rd, iov, j - i, refused) < 0) {
            fmc_stage_put(&cs->e->stage, k);
            for (int e = i; e < n; e++)
                if (reg[e])
                    unpin(cs, reg[e]);
            return -1;
        }
        FMC_TR(FMC_TR_RECEIVED, cs->rd.fd, off);
        fmc_landing *l = land_slot(cs, k, dev, 0, q->id);
        piece_copy(cs, l, dst, src, sz, m);
        l->gpu_bytes = off;
        host_bytes -= off;
        for (int e = i; e < j; e++) {
            if (!reg[e])
                continue;
            if (reg[e]->cuda_dev >= 0) {
                l->pins[l->npins++] = reg[e]; /* until its copy landed */
                continue;
            }
            unpin(cs, reg[e]);
            if (refused[e - i]) {
                refuse_protected(cs, addr[e], len[e]);
                cs->vec_status[e] = FMC_ERR_REMOTE_REFUSED;
                host_bytes -= len[e];
                failed = 1;
            }
        }
        l->last = j == n;
        l->vec_n = n;
        l->vec_failed = failed;
    }
    cs->served_in += host_bytes;
    return failed;
}

/* A vector read with GPU entries: piece by piece, the GPU entries are gathered into a chunk and
 * the piece's payloads (staged, or in place for host entries) queued once it landed, while the
 * next pieces' gathers run.  -1 if it cannot go on. */
static int vector_read_gpu(fmc_conn_state *cs, const fmc_req *q, int n, const uint64_t *addr, const uint64_t *len,
                           fmc_region **reg, int failed, uint64_t ok_bytes)
{
    for (int i = 0, j, dev; i < n; i = j) {
        j = piece_end(reg, len, i, n, &dev);
        fmc_chunk *k = conn_chunk(cs, FMC_STAGE_SEND, dev);
        if (!k) {
            for (int e = i; e < n; e++)
                if (reg[e])
                    unpin(cs, reg[e]);
            return -1;
        }
        fmc_landing *l = land_slot(cs, k, dev, 1, q->id);
        uint64_t dst[FMC_VEC_MAX], src[FMC_VEC_MAX], off = 0;
        size_t sz[FMC_VEC_MAX];
        int m = 0;
        for (int e = i; e < j; e++) {
            if (!reg[e])
                continue; /* refused: no payload */
            void *from = (void *)(uintptr_t)addr[e];
            if (reg[e]->cuda_dev >= 0) {
                from = k->buf + off;
                dst[m] = (uint64_t)(uintptr_t)from;
                src[m] = addr[e];
                sz[m++] = (size_t)len[e];
                off += len[e];
            }
            l->parts[l->nparts++] = (struct iovec){.iov_base = from, .iov_len = (size_t)len[e]};
            l->pins[l->npins++] = reg[e];
        }
        piece_copy(cs, l, dst, src, sz, m);
        l->gpu_bytes = off;
        l->first = i == 0;
        l->last = j == n;
        l->vec_n = n;
        l->vec_failed = failed;
        l->ans_len = ok_bytes;
    }
    cs->served_out += ok_bytes;
    return failed;
}

/* A vector request (fmc_wire.h): every entry is checked and pinned like a single request, then
 * a write's payloads are received with one scatter read straight into place and a read's are
 * sent with the answer's gather; GPU entries go through staging chunks, pipelined (above).
 * Returns -1 to drop the connection. */
static int serve_vector(fmc_conn_state *cs, const fmc_req *q)
{
    FMC_TR(FMC_TR_REQUEST, cs->rd.fd, q->key);
    fmc_engine *e = cs->e;
    int n = (int)q->key, is_write = q->opcode == FMC_WIRE_OP_WRITEV;
    if (!cs->vectors || n < 2 || n > FMC_VEC_MAX || q->addr != 0) {
        e->stat_protocol_errors++;
        fmc_engine_log(e, "dropped a data connection: bad vector request (%d entries)", n);
        return -1;
    }
    /* Room for the answer and its pins (reads), taken before anything is pinned. */
    if ((cs->niov + n + 3 > FMC_IOV_MAX || cs->nread_pins + n > FMC_IOV_MAX || cs->c->npins + n >= FMC_MAX_PINS) &&
        flush(cs) < 0)
        return -1;
    if (fmc_reader_fill(&cs->rd, (size_t)n * FMC_VEC_ENTRY_SIZE) < 0)
        return -1;
    uint64_t addr[FMC_VEC_MAX], len[FMC_VEC_MAX], sum = 0, ok_bytes = 0, gpu_bytes = 0;
    fmc_region *reg[FMC_VEC_MAX];
    int failed = 0;
    const uint8_t *t = cs->rd.buf + cs->rd.start;
    for (int i = 0; i < n; i++, t += FMC_VEC_ENTRY_SIZE) {
        uint32_t key = fmc_get32(t);
        addr[i] = fmc_get64(t + 8);
        len[i] = fmc_get64(t + 16);
        if (len[i] == 0 || len[i] > FMC_VEC_ENTRY_MAX)
            break;
        sum += len[i];
        reg[i] = pin(cs, addr[i], len[i], &key, is_write);
        cs->vec_status[i] = reg[i] ? FMC_OK : FMC_ERR_REMOTE_REFUSED;
        if (!reg[i]) {
            fmc_req one = {.opcode = is_write ? FMC_WIRE_OP_WRITE : FMC_WIRE_OP_READ, .key = key,
                           .addr = addr[i], .len = len[i]};
            refuse(cs, &one);
            failed = 1;
            continue;
        }
        ok_bytes += len[i];
        if (reg[i]->cuda_dev >= 0)
            gpu_bytes += len[i];
    }
    int parsed = (int)((t - (cs->rd.buf + cs->rd.start)) / FMC_VEC_ENTRY_SIZE);
    cs->rd.start += (size_t)n * FMC_VEC_ENTRY_SIZE;
    if (parsed != n || sum != q->len) {
        for (int i = 0; i < parsed; i++)
            if (reg[i])
                unpin(cs, reg[i]);
        e->stat_protocol_errors++;
        fmc_engine_log(e, "dropped a data connection: bad vector entry lengths");
        return -1;
    }
    int rc = 0;
    if (is_write && ok_bytes && initiator_gave_up(cs, q->len))
        rc = -1; /* its payloads may be zero-copy from pages the initiator reuses: drop them */
    if (rc == 0 && is_write && failed && !cs->sink && !(cs->sink = malloc(FMC_VEC_ENTRY_MAX)))
        rc = -1;
    if (rc < 0) {
        for (int i = 0; i < n; i++)
            if (reg[i])
                unpin(cs, reg[i]);
        return -1;
    }
    if (gpu_bytes) {
        failed = is_write ? vector_write_gpu(cs, q, n, addr, len, reg, failed, ok_bytes)
                          : vector_read_gpu(cs, q, n, addr, len, reg, failed, ok_bytes);
        if (failed < 0)
            return -1;
        /* Entry statuses live in a per-connection buffer: sent before the next vector. */
        return failed && flush(cs) < 0 ? -1 : 0;
    }
    land_all(cs); /* earlier GPU requests answer first */
    if (is_write) {
        struct iovec iov[FMC_VEC_MAX];
        uint8_t refused[FMC_VEC_MAX] = {0}; /* destinations the kernel refused to write */
        for (int i = 0; i < n; i++)
            iov[i] = (struct iovec){.iov_base = reg[i] ? (void *)(uintptr_t)addr[i] : cs->sink,
                                    .iov_len = (size_t)len[i]};
        rc = fmc_reader_read_regions(&cs->rd, iov, n, refused);
        for (int i = 0; i < n; i++)
            if (reg[i])
                unpin(cs, reg[i]);
        if (rc < 0)
            return -1;
        for (int i = 0; i < n; i++) {
            if (reg[i] && refused[i]) {
                refuse_protected(cs, addr[i], len[i]);
                cs->vec_status[i] = FMC_ERR_REMOTE_REFUSED;
                ok_bytes -= len[i];
                failed = 1;
            }
        }
        cs->served_in += ok_bytes;
        queue_vector_answer(cs, q->id, n, failed, 0, 0);
    } else {
        int zc = zc_claim(cs, reg, n, ok_bytes);
        queue_vector_answer(cs, q->id, n, failed, ok_bytes, zc);
        for (int i = 0; i < n; i++) {
            if (cs->vec_status[i] != FMC_OK)
                continue;
            cs->read_pins[cs->nread_pins++] = reg[i];
            push_payload(cs, (void *)(uintptr_t)addr[i], len[i], zc);
        }
        cs->served_out += ok_bytes;
    }
    /* Statuses live in a per-connection buffer: send them before it is reused. */
    if (failed && flush(cs) < 0)
        return -1;
    return 0;
}

/* A fence (fmc_wire.h): shut the connection named `token` down and return once its thread has
 * left it, i.e. stopped touching memory; FMC_OK, or FMC_ERR_TIMEOUT if it has not within
 * FMC_FENCE_WAIT_MS (a thread blocked on a socket that was shut down leaves at once; one landing
 * GPU copies, within their copy time).  The wait is a stall outside the pool's count: a
 * connection idle in the set leaves only once a worker takes its shutdown, and the fencing
 * worker may be the one the cap allowed. */
#define FMC_FENCE_WAIT_MS 10000
static int32_t fence(fmc_conn_state *cs, uint64_t token)
{
    fmc_engine *e = cs->e;
    struct timespec until;
    fmc_deadline_ts(FMC_FENCE_WAIT_MS, &until);
    int rc = FMC_OK;
    fmc_pool_blocking_begin();
    pthread_mutex_lock(&e->mu);
    for (;;) {
        fmc_server_conn *old = NULL;
        for (fmc_server_conn *c = e->conns; c && token; c = c->next)
            if (c != cs->c && c->token == token)
                old = c;
        if (!old)
            break;
        if (!old->cut)
            fmc_server_conn_cut_locked(old);
        if (pthread_cond_timedwait(&e->cv, &e->mu, &until) == ETIMEDOUT) {
            rc = FMC_ERR_TIMEOUT;
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
    fmc_pool_blocking_end();
    return rc;
}

enum { SERVE_YIELD, SERVE_DONE, SERVE_MOONCAKE };

/* The first bytes of a connection: wait (without a worker) until the preamble, or what tells
 * Mooncake's framing, has come; then the handshake.  SERVE_YIELD while they have not. */
static int first_bytes(fmc_conn_state *cs)
{
    if (fmc_reader_try_more(&cs->rd) < 0)
        return SERVE_DONE;
    size_t have = fmc_reader_buffered(&cs->rd);
    int native = have >= 8 && memcmp(cs->rd.buf + cs->rd.start, FMC_MAGIC_HELLO, 8) == 0;
    if (have < 8 || (native && have < FMC_PREAMBLE_SIZE))
        return SERVE_YIELD; /* a connection that stays silent is dropped by the accept thread */
    int wire = handshake(cs);
    if (wire < 0) {
        cs->e->stat_protocol_errors++;
        return SERVE_DONE;
    }
    pthread_mutex_lock(&cs->e->mu);
    cs->c->handshaken = 1;
    pthread_mutex_unlock(&cs->e->mu);
    cs->wire = wire;
    return wire == WIRE_MOONCAKE ? SERVE_MOONCAKE : SERVE_YIELD;
}

/* A write's payload into host memory, then its answer.  The connection's receive timeout is
 * short (FMC_PARK_MS): a payload that stops coming is *parked* (1): what landed stays, the region
 * stays pinned, and the connection goes back to the pool's set until more comes, so a stalled
 * initiator holds no thread; resumed from `landed`.  A payload that moves no byte for
 * FMC_STALL_MS ends the connection (-1).  0: answered. */
static int receive_host_write(fmc_conn_state *cs, fmc_region *r, uint64_t id, uint64_t addr, uint64_t len,
                              uint64_t landed)
{
    size_t got = 0;
    int rc = fmc_reader_read_region_some(&cs->rd, (void *)(uintptr_t)(addr + landed), (size_t)(len - landed), &got);
    if (rc == FMC_READ_PARKED) {
        int64_t now = fmc_now_ms();
        int moved = got > 0 || !cs->parked.r;
        if (moved || now - cs->parked.since < FMC_STALL_MS) {
            cs->parked.r = r;
            cs->parked.id = id;
            cs->parked.addr = addr;
            cs->parked.len = len;
            cs->parked.landed = landed + got;
            if (moved)
                cs->parked.since = now;
            return 1;
        }
        rc = -1;
    }
    cs->parked.r = NULL;
    unpin(cs, r);
    if (rc < 0)
        return -1;
    if (rc == FMC_READ_REFUSED) {
        refuse_protected(cs, addr, len);
        queue_answer(cs, id, FMC_ERR_REMOTE_REFUSED, NULL, 0);
        return 0;
    }
    cs->served_in += len;
    queue_answer(cs, id, FMC_OK, NULL, 0);
    return 0;
}

/* Serve requests until the input runs dry (SERVE_YIELD: answers flushed, GPU pieces landed) or
 * the connection ends (SERVE_DONE). */
static int serve_some(fmc_conn_state *cs)
{
    fmc_engine *e = cs->e;
    FMC_TR(FMC_TR_SERVE, cs->rd.fd, fmc_reader_buffered(&cs->rd));
    if (!cs->wire) {
        int first = first_bytes(cs);
        if (first != SERVE_YIELD || !cs->wire)
            return first;
    }
    if (cs->parked.r) { /* a write whose payload stalled: its rest first */
        FMC_TR(FMC_TR_PARKED, cs->rd.fd, cs->parked.landed);
        int rc = receive_host_write(cs, cs->parked.r, cs->parked.id, cs->parked.addr, cs->parked.len,
                                    cs->parked.landed);
        if (rc == 1)
            return flush(cs) < 0 ? SERVE_DONE : SERVE_YIELD;
        if (rc < 0) {
            flush(cs);
            return SERVE_DONE;
        }
    }
    while (!cs->broken) {
        if (fmc_reader_buffered(&cs->rd) < FMC_REQ_SIZE) {
            int more = fmc_reader_try_more(&cs->rd);
            FMC_TR(FMC_TR_READ_MORE, cs->rd.fd, fmc_reader_buffered(&cs->rd));
            if (more < 0)
                break;
            if (fmc_reader_buffered(&cs->rd) < FMC_REQ_SIZE) {
                if (flush(cs) < 0 || spin_for_more(cs->e, &cs->rd, FMC_REQ_SIZE, cs->last_len, cs->zc_out) < 0)
                    break;
                if (fmc_reader_buffered(&cs->rd) < FMC_REQ_SIZE) {
                    FMC_TR(FMC_TR_YIELD, cs->rd.fd, 0);
                    return SERVE_YIELD; /* back to the pool's set until more comes */
                }
            }
            /* Stamped when the socket is read, not per request: a busy connection passes here
             * often enough for eviction's half-second idleness test. */
            __atomic_store_n(&cs->c->last_active_ms, fmc_now_ms(), __ATOMIC_RELAXED);
        }
        fmc_req q;
        fmc_req_decode(cs->rd.buf + cs->rd.start, &q);
        cs->rd.start += FMC_REQ_SIZE;
        if (q.opcode == FMC_WIRE_OP_ACK) {
            if (zc_acknowledge(cs, q.len) < 0) {
                e->stat_protocol_errors++;
                fmc_engine_log(e, "dropped a data connection: acknowledged %llu zero-copy answers, %u outstanding",
                               (unsigned long long)q.len, cs->ledger_count);
                break;
            }
            continue;
        }
        cs->last_len = q.len; /* an acknowledgement is no transfer: it leaves the poll's choice alone */
        if (q.opcode == FMC_WIRE_OP_NAME) {
            pthread_mutex_lock(&e->mu);
            cs->c->token = q.addr;
            pthread_mutex_unlock(&e->mu);
            continue;
        }
        if (q.opcode == FMC_WIRE_OP_FENCE) {
            queue_answer(cs, q.id, fence(cs, q.addr), NULL, 0);
            if (flush(cs) < 0)
                break;
            continue;
        }
        if (q.opcode == FMC_WIRE_OP_WRITEV || q.opcode == FMC_WIRE_OP_READV) {
            if (q.len == 0 || q.len > FMC_MAX_WIRE_LEN || serve_vector(cs, &q) < 0)
                break;
            if (cs->niov + 2 > FMC_IOV_MAX || cs->out_bytes >= FMC_FLUSH_BYTES) {
                if (flush(cs) < 0)
                    break;
            }
            continue;
        }
        if ((q.opcode != FMC_WIRE_OP_WRITE && q.opcode != FMC_WIRE_OP_READ) || q.len == 0 ||
            q.len > FMC_MAX_WIRE_LEN) {
            e->stat_protocol_errors++;
            fmc_engine_log(e, "dropped a data connection: bad request header (opcode %u, length %llu)",
                           q.opcode, (unsigned long long)q.len);
            break;
        }
        fmc_region *r = pin(cs, q.addr, q.len, &q.key, q.opcode == FMC_WIRE_OP_WRITE);
        if (q.opcode == FMC_WIRE_OP_WRITE && r && initiator_gave_up(cs, q.len)) {
            unpin(cs, r);
            break;
        }
        if (q.opcode == FMC_WIRE_OP_WRITE) {
            int rc;
            if (r && r->cuda_dev >= 0) {
                if (receive_into_gpu(cs, r, q.id, q.addr, q.len) < 0)
                    break;
                rc = 1; /* answered when its copy lands */
            } else if (r) {
                rc = receive_host_write(cs, r, q.id, q.addr, q.len, 0);
                if (rc < 0)
                    break;
                if (rc == 1) { /* parked */
                    if (flush(cs) < 0)
                        break;
                    return SERVE_YIELD;
                }
                rc = 1; /* answered */
            } else {
                refuse(cs, &q);
                rc = fmc_reader_skip(&cs->rd, (size_t)q.len);
            }
            if (rc < 0)
                break;
            if (rc == 0)
                queue_answer(cs, q.id, r ? FMC_OK : FMC_ERR_REMOTE_REFUSED, NULL, 0);
        } else if (r && r->cuda_dev >= 0) {
            if (send_from_gpu(cs, r, q.id, q.addr, q.len) < 0)
                break;
        } else if (r) {
            queue_read_answer(cs, &q, r);
            cs->served_out += q.len;
        } else {
            refuse(cs, &q);
            queue_answer(cs, q.id, FMC_ERR_REMOTE_REFUSED, NULL, 0);
        }
        if (cs->niov + 2 > FMC_IOV_MAX || cs->out_bytes >= FMC_FLUSH_BYTES) {
            if (flush(cs) < 0)
                break;
        }
    }
    flush(cs); /* best effort: a peer that only half-closed still reads its answers; releases pins */
    return SERVE_DONE;
}

void fmc_server_conn_cut_locked(fmc_server_conn *c)
{
    c->cut = 1;
    shutdown(c->fd, SHUT_RDWR); /* fd -1 once closed early (conn_finish): nothing to do */
}

/* A connection's end: reset it if zero-copy answers are unacknowledged, release its pins, unlink
 * and close it, free its state. */
static void conn_finish(fmc_conn_state *cs)
{
    fmc_engine *e = cs->e;
    fmc_server_conn *c = cs->c;
    if (cs->ledger_count) {
        /* Unacknowledged zero-copy answers may still sit in the initiator's socket, to be copied
         * out of our pages later: reset the connection (the initiator then fails those reads,
         * fmc_wire.h) before their regions are released, and give the reset a moment to arrive
         * (a loopback peer handles it in softirq context, normally before close returns). */
        struct pollfd pfd = {.fd = c->fd, .events = POLLRDHUP};
        pthread_mutex_lock(&e->mu);
        int cut = c->cut;
        pthread_mutex_unlock(&e->mu);
        if (cut || !(poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)))) {
            /* ended on our side (cut, a protocol error), not by the initiator closing it */
            e->stat_zc_resets++;
            fmc_engine_log(e, "reset a data connection with %u zero-copy read answers unacknowledged",
                           cs->ledger_count);
        }
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        pthread_mutex_lock(&e->mu);
        close(c->fd);
        c->fd = -1; /* still linked: shutdown(-1) by unregister or eviction does nothing */
        pthread_mutex_unlock(&e->mu);
        usleep(2000);
    }
    pthread_mutex_lock(&e->mu);
    while (c->npins > 0) /* a write pin left by a failed receive; zero-copy holds */
        unpin_locked(e, c, c->pins[0]);
    if (c->prev)
        c->prev->next = c->next;
    else
        e->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    e->nconns--;
    fmc_pool_owners_add(&serve_pool, -1);
    /* Closed under mu, once unlinked: nobody can shutdown() this fd number any more, and
     * fmc_engine_destroy returns only after every data socket is really closed. */
    if (c->fd >= 0)
        close(c->fd);
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    fmc_reader_free(&cs->rd);
    for (int i = 0; i < FMC_LANDINGS; i++) /* serve() landed every piece and sent their answers */
        fmc_cuda_fence_free(&cs->land[i].fence);
    free(cs->sink);
    free(c);
    free(cs);
}

/* Mooncake's framing is served by a thread of its own per connection (fmc_mooncake.c's loop
 * blocks for each request): an interoperability path, not the one a cluster scales on. */
static void *mooncake_main(void *arg)
{
    fmc_conn_state *cs = arg;
    fmc_mc_serve(cs, &conn_ops);
    conn_finish(cs);
    return NULL;
}

static void start_mooncake_thread(fmc_conn_state *cs)
{
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256u << 10);
    pthread_t t;
    if (pthread_create(&t, &attr, mooncake_main, cs) != 0) {
        shutdown(cs->c->fd, SHUT_RDWR); /* the clean-up path without serving */
        conn_finish(cs);
    }
    pthread_attr_destroy(&attr);
}

/* The serve pool: one per process, shared by every engine's inbound data connections, instead
 * of one thread per connection.  A worker takes a connection that has input and serves it
 * (serve_event) until its input runs dry, then hands it back to the set.  A connection stalled
 * inside a request holds its worker until the socket's stall timeout drops it; a stalled write
 * payload is parked instead. */
static void serve_event(void *cs, uint32_t events);
/* Up to 8 workers while it serves the connections of one initiator's streams, as the I/O pool
 * (fmc_stream.c): on 2 CPUs a worker of its own per connection moved 4 MiB writes 1.04x as fast
 * as 4 workers that hand connections on through the set. */
static fmc_worker_pool serve_pool = FMC_WORKER_POOL_INIT("serve", serve_event, 0, 8);

int fmc_serve_pool_set_threads(int n) { return fmc_pool_set_cap(&serve_pool, n); }

int fmc_serve_pool_start(void) { return fmc_pool_start(&serve_pool); }

void fmc_serve_pool_counts(int *workers, int *cap, uint64_t *recalls)
{
    fmc_pool_counts(&serve_pool, workers, cap, recalls);
}

/* Watch a connection for input, once (op: EPOLL_CTL_ADD for a new one, EPOLL_CTL_MOD after
 * serving).  The set exists: every engine made it (fmc_serve_pool_start) before it could
 * accept a connection. */
static int watch_conn(fmc_conn_state *cs, int fd, int op)
{
    return fmc_pool_watch(&serve_pool, fd, cs, EPOLLIN | EPOLLRDHUP, op);
}

/* How long a worker stays with a connection that ran dry, waiting on its socket alone before it
 * goes back to the pool's set (fmc_pool_linger): a busy initiator's next request then wakes that
 * worker directly. */
#define SERVE_LINGER_MS 10

static void serve_connection(void *owner);

/* Serve a connection that has input until it runs dry (then it goes back to the pool's set) or
 * ends (then it is closed and freed).  A blocking read or send of it that waits out its socket's
 * timeout (FMC_PARK_MS) with no byte moved is a stall (fmc_pool_stall): initiators stopped
 * mid-payload (a vector's, or one bound for GPU memory, which are not parked) or not reading
 * their answers cost a thread each, not the other connections' turn, and are dropped after
 * FMC_STALL_MS without a byte. */
static void serve_event(void *owner, uint32_t events)
{
    (void)events;
    fmc_stall_hook_set(fmc_pool_stall, FMC_STALL_MS);
    serve_connection(owner);
    fmc_stall_hook_set(NULL, 0);
}

static void serve_connection(void *owner)
{
    fmc_conn_state *cs = owner;
    int rc;
    while ((rc = serve_some(cs)) == SERVE_YIELD && fmc_pool_linger(cs->c->fd, SERVE_LINGER_MS))
        ;
    switch (rc) {
    case SERVE_YIELD:
        if (watch_conn(cs, cs->c->fd, EPOLL_CTL_MOD) == FMC_OK)
            return;
        flush(cs);
        conn_finish(cs);
        return;
    case SERVE_MOONCAKE:
        start_mooncake_thread(cs);
        return;
    default:
        conn_finish(cs);
    }
}

/* At the connection cap, the connection idle the longest (and at least FMC_EVICT_IDLE_MS) makes
 * room: a flood of silent connections cannot lock real initiators out, it only makes the idlest
 * ones reconnect.  A connection whose only pins are zero-copy answers its initiator never
 * acknowledged counts as idle: it is reset on the way out.  Caller holds e->mu; the evicted
 * thread cleans up as after any disconnect. */
#define FMC_EVICT_IDLE_MS 500
#define FMC_EVICTION_SLACK 64
static void evict_idlest_locked(fmc_engine *e)
{
    int64_t now = fmc_now_ms();
    fmc_server_conn *victim = NULL;
    int64_t oldest = now - FMC_EVICT_IDLE_MS;
    for (fmc_server_conn *sc = e->conns; sc; sc = sc->next) {
        int64_t t = __atomic_load_n(&sc->last_active_ms, __ATOMIC_RELAXED);
        if (t <= oldest && sc->npins == sc->zc_pins) { /* idle, or only awaiting acknowledgements */
            oldest = t;
            victim = sc;
        }
    }
    if (victim) {
        __atomic_store_n(&victim->last_active_ms, now, __ATOMIC_RELAXED); /* do not pick it twice */
        fmc_server_conn_cut_locked(victim);
        fmc_engine_log(e, "connection cap reached: closed the longest idle data connection");
    }
}

static void start_conn(fmc_engine *e, int fd)
{
    fmc_conn_state *cs = calloc(1, sizeof *cs);
    fmc_server_conn *c = calloc(1, sizeof *c);
    if (!cs || !c || fmc_reader_init(&cs->rd, fd, FMC_RBUF_SIZE) != 0) {
        free(cs ? cs->rd.buf : NULL);
        free(cs);
        free(c);
        close(fd);
        return;
    }
    fmc_tune_socket_opts(fd, &e->opts);
    c->fd = fd;
    cs->e = e;
    cs->c = c;
    pthread_mutex_lock(&e->mu);
    __atomic_store_n(&c->last_active_ms, fmc_now_ms(), __ATOMIC_RELAXED);
    if (!e->stopping && e->nconns >= FMC_MAX_SERVER_CONNS)
        evict_idlest_locked(e);
    if (e->stopping || e->nconns >= FMC_MAX_SERVER_CONNS + FMC_EVICTION_SLACK) {
        pthread_mutex_unlock(&e->mu);
        fmc_engine_log(e, "refused a data connection: %s", e->stopping ? "engine closing" : "too many connections");
        fmc_reader_free(&cs->rd);
        free(cs);
        free(c);
        close(fd);
        return;
    }
    c->born_ms = fmc_now_ms();
    c->next = e->conns;
    if (e->conns)
        e->conns->prev = c;
    e->conns = c;
    e->nconns++;
    pthread_mutex_unlock(&e->mu);
    fmc_pool_owners_add(&serve_pool, 1); /* until conn_finish unlinks it */
    if (watch_conn(cs, fd, EPOLL_CTL_ADD) != FMC_OK) {
        fmc_engine_log(e, "refused a data connection: %s", fmc_last_error());
        shutdown(fd, SHUT_RDWR); /* the clean-up path without serving */
        conn_finish(cs);
    }
}

/* Connections that sent no preamble within FMC_PREAMBLE_TIMEOUT_MS are shut down (their worker
 * then closes them): a silent connection holds no thread, only its socket. */
static void drop_silent(fmc_engine *e)
{
    int64_t too_old = fmc_now_ms() - FMC_PREAMBLE_TIMEOUT_MS;
    pthread_mutex_lock(&e->mu);
    for (fmc_server_conn *c = e->conns; c; c = c->next)
        if (!c->handshaken && !c->cut && c->born_ms < too_old) {
            e->stat_protocol_errors++; /* counted as a preamble that never came */
            fmc_server_conn_cut_locked(c);
        }
    pthread_mutex_unlock(&e->mu);
}

void *fmc_server_accept_main(void *arg)
{
    fmc_engine *e = arg;
    int64_t swept = 0;
    for (;;) {
        struct pollfd pfd[2] = {{.fd = e->listen_fd, .events = POLLIN}, {.fd = e->wake_pipe[0], .events = POLLIN}};
        int n = poll(pfd, 2, 1000);
        pthread_mutex_lock(&e->mu);
        int stopping = e->stopping;
        pthread_mutex_unlock(&e->mu);
        if (stopping)
            break;
        /* Once a second, as when idle: a burst of connections does not walk the list (under the
         * engine's lock) once per accept. */
        int64_t now = fmc_now_ms();
        if (now - swept >= 1000) {
            drop_silent(e);
            swept = now;
        }
        if (n <= 0 || !(pfd[0].revents & POLLIN))
            continue;
        int fd = accept4(e->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE)
                usleep(10000);
            continue;
        }
        start_conn(e, fd);
    }
    return NULL;
}
