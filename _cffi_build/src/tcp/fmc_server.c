/* Target side of the native data plane: one accept thread, one thread per inbound connection.
 * Every request is checked against the registry (range and key) before a byte is touched;
 * writes go straight into registered memory and are answered after they land; reads are sent
 * straight from registered memory.  Answers are gathered and flushed when the input runs dry. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fmc_internal.h"
#include "fmc_mooncake.h"
#include "fmc_tcp_conn.h"
#include "fmc_wire.h"

#define FMC_MAX_SERVER_CONNS 4096
#define FMC_PREAMBLE_TIMEOUT_MS 5000

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

/* The queued answers, zero-copy payloads through the connection's pipe. */
static int send_answers(fmc_conn_state *cs)
{
    if (!cs->niov)
        return 0;
    int rc;
    if (!cs->nzc) {
        rc = fmc_sendv_all(cs->c->fd, cs->iov, cs->niov);
    } else {
        rc = fmc_sendv_zc(cs->c->fd, cs->iov, cs->niov, cs->zc, cs->zc_pipe);
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

/* Send what is queued now (pins stay until the flush): room for a run's answers. */
static int send_queued(fmc_conn_state *cs)
{
    int rc = send_answers(cs);
    cs->niov = cs->nhdr = 0;
    cs->out_bytes = 0;
    return rc;
}

/* Answer the writes of the run in flight once its copy has landed. */
static void land_flying(fmc_conn_state *cs)
{
    fmc_gpu_run *f = &cs->gpu_flying;
    if (!f->n)
        return;
    int rc = fmc_cuda_wait(f->dev);
    unpin(cs, f->region);
    if (rc == FMC_OK)
        cs->served_in += f->len;
    int n = f->n;
    f->n = 0;
    if (cs->niov + n + 2 > FMC_IOV_MAX)
        send_queued(cs); /* a failure shows at the next send */
    for (int i = 0; i < n; i++)
        push_answer(cs, f->ids[i], rc == FMC_OK ? FMC_OK : FMC_ERR_DEVICE_NOT_FOUND, NULL, 0);
}

/* Land the run in flight, then start the open run's copy: it becomes the one in flight. */
static void launch_open(fmc_conn_state *cs)
{
    fmc_gpu_run *o = &cs->gpu_open;
    if (!o->n)
        return;
    land_flying(cs);
    const fmc_staging *st = o->in_stage2 ? &cs->stage2 : &cs->stage;
    if (fmc_cuda_copy_async(o->addr, (uint64_t)(uintptr_t)st->buf, (size_t)o->len, o->dev) != FMC_OK) {
        unpin(cs, o->region);
        for (int i = 0; i < o->n; i++)
            push_answer(cs, o->ids[i], FMC_ERR_DEVICE_NOT_FOUND, NULL, 0);
        o->n = 0;
        return;
    }
    cs->gpu_flying = *o;
    o->n = 0;
}

/* Every GPU write received so far landed and answered: answers keep request order, so this runs
 * before any other answer is queued, and before a flush. */
static void finish_gpu_writes(fmc_conn_state *cs)
{
    launch_open(cs);
    land_flying(cs);
}

/* A write into GPU memory.  It joins the open run when its destination follows the run's (a
 * paged KV layout often does), so that one copy serves many writes; otherwise the open run's
 * copy starts and this write opens the next run in the other staging buffer, received while
 * that copy runs.  Returns -1 on a broken connection. */
static int receive_into_gpu(fmc_conn_state *cs, fmc_region *r, uint64_t id, uint64_t addr, uint64_t len)
{
    fmc_gpu_run *o = &cs->gpu_open;
    fmc_staging *st = o->in_stage2 ? &cs->stage2 : &cs->stage;
    if (o->n && r == o->region && addr == o->addr + o->len && o->n < FMC_GPU_RUN_MAX && o->len + len <= st->cap) {
        int rc = fmc_reader_read_into(&cs->rd, st->buf + o->len, (size_t)len);
        unpin(cs, r); /* the run's first pin holds the region */
        if (rc < 0)
            return -1;
        o->ids[o->n++] = id;
        o->len += len;
        return 0;
    }
    launch_open(cs);
    int use2 = cs->gpu_flying.n && !cs->gpu_flying.in_stage2;
    st = use2 ? &cs->stage2 : &cs->stage;
    if (fmc_staging_reserve(st, len > FMC_GPU_RUN_BYTES ? (size_t)len : FMC_GPU_RUN_BYTES, r->cuda_dev) != 0 ||
        fmc_reader_read_into(&cs->rd, st->buf, (size_t)len) < 0) {
        unpin(cs, r);
        return -1;
    }
    *o = (fmc_gpu_run){.n = 1, .in_stage2 = use2, .dev = r->cuda_dev, .addr = addr, .len = len, .region = r};
    o->ids[0] = id;
    return 0;
}

static int flush(fmc_conn_state *cs)
{
    finish_gpu_writes(cs);
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
    int rc = send_answers(cs);
    for (int i = 0; i < cs->nread_pins; i++)
        unpin(cs, cs->read_pins[i]);
    release_held(cs); /* last: the uses above were counted against it */
    cs->niov = cs->nhdr = cs->nread_pins = 0;
    cs->out_bytes = 0;
    return rc;
}

/* pin, unpin and flush for Mooncake's framing (fmc_mooncake.c); the native loop calls the
 * static versions, which the compiler may inline. */
fmc_region *fmc_conn_pin(fmc_conn_state *cs, uint64_t addr, uint64_t len, const uint32_t *key, int for_write)
{
    return pin(cs, addr, len, key, for_write);
}

void fmc_conn_unpin(fmc_conn_state *cs, fmc_region *r) { unpin(cs, r); }

int fmc_conn_flush(fmc_conn_state *cs) { return flush(cs); }

static void queue_answer(fmc_conn_state *cs, uint64_t id, int32_t status, void *data, uint64_t len)
{
    finish_gpu_writes(cs); /* earlier GPU writes answer first */
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

/* A successful read from host region r, zero-copy when the ledger takes it. */
static void queue_read_answer(fmc_conn_state *cs, uint64_t id, fmc_region *r, uint64_t addr, uint64_t len)
{
    finish_gpu_writes(cs);
    cs->read_pins[cs->nread_pins++] = r;
    int zc = zc_claim(cs, &r, 1, len);
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

enum { WIRE_NATIVE = 0, WIRE_MOONCAKE = 1 };

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
    fmc_set_recv_timeout(cs->c->fd, FMC_PREAMBLE_TIMEOUT_MS / 1000);
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
    uint32_t caps = (flags & FMC_PREAMBLE_VECTORS) ? FMC_CAP_VECTORS : 0;
    if ((flags & FMC_PREAMBLE_READ_ACKS) && fmc_zc_enabled(cs->e))
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
        fmc_set_recv_timeout(cs->c->fd, 0);
        use_vectors(cs, caps);
        return WIRE_NATIVE;
    }
    fmc_put32(reply + 8, (uint32_t)(ok ? 0 : FMC_ERR_REMOTE_REFUSED));
    fmc_put32(reply + 12, ok ? caps : 0);
    if (fmc_send_all(cs->c->fd, reply, sizeof reply) < 0 || !ok)
        return -1;
    fmc_set_recv_timeout(cs->c->fd, 0);
    use_vectors(cs, caps);
    return WIRE_NATIVE;
}

/* After answering a small request, poll briefly for the next one before sleeping (the
 * engine's spin_us): back-to-back small requests then find this thread awake. */
static int spin_for_more(const fmc_engine *e, fmc_reader *rd, size_t need, uint64_t last_len)
{
    int spin = fmc_spin_us_after(e, last_len);
    if (spin <= 0)
        return 0;
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

/* Copies between the staging buffer and a vector's GPU entries (reg[i] a GPU region), grouped
 * by device: to the GPU (`to_gpu`, from stage[i]) or from it (into stage[i]), as one gather per
 * device, then waited for (this thread's copies only). */
static int stage_copy(fmc_conn_state *cs, fmc_region **reg, const uint64_t *addr, const uint64_t *len,
                      void *const *stage, int n, int to_gpu)
{
    uint64_t dst[FMC_VEC_MAX], src[FMC_VEC_MAX];
    size_t sz[FMC_VEC_MAX];
    int mode = cs->stage.pinned ? cs->e->opts.gpu_copy : FMC_GPU_COPY_BATCH;
    int rc = FMC_OK;
    uint64_t devices = 0;
    for (int i = 0, m = 0, dev = -1; i <= n; i++) {
        int d = i < n ? (reg[i] ? reg[i]->cuda_dev : -1) : -2;
        if (i < n && d < 0)
            continue;
        if (m > 0 && d != dev) {
            if (fmc_cuda_gather_async(dst, src, sz, m, dev, mode) != FMC_OK)
                rc = FMC_ERR_DEVICE_NOT_FOUND;
            m = 0;
        }
        if (i == n)
            break;
        dev = d;
        devices |= 1ull << (d & 63);
        uint64_t staged = (uint64_t)(uintptr_t)stage[i];
        dst[m] = to_gpu ? addr[i] : staged;
        src[m] = to_gpu ? staged : addr[i];
        sz[m++] = (size_t)len[i];
    }
    for (int d = 0; d < 64; d++)
        if (((devices >> d) & 1) && fmc_cuda_wait(d) != FMC_OK)
            rc = FMC_ERR_DEVICE_NOT_FOUND;
    return rc;
}

static int scatter_to_gpu(fmc_conn_state *cs, fmc_region **reg, const uint64_t *addr, const uint64_t *len,
                          const struct iovec *iov, int n)
{
    void *stage[FMC_VEC_MAX];
    for (int i = 0; i < n; i++)
        stage[i] = iov[i].iov_base;
    return stage_copy(cs, reg, addr, len, stage, n, 1);
}

static int gather_from_gpu(fmc_conn_state *cs, fmc_region **reg, const uint64_t *addr, const uint64_t *len,
                           void *const *src, int n)
{
    return stage_copy(cs, reg, addr, len, src, n, 0);
}

/* A vector request (fmc_wire.h): every entry is checked and pinned like a single request, then
 * a write's payloads are received with one scatter read straight into place and a read's are
 * sent with the answer's gather.  GPU entries go one by one through the staging buffer.
 * Returns -1 to drop the connection. */
static int serve_vector(fmc_conn_state *cs, const fmc_req *q)
{
    fmc_engine *e = cs->e;
    int n = (int)q->key, is_write = q->opcode == FMC_WIRE_OP_WRITEV;
    if (!cs->vectors || n < 2 || n > FMC_VEC_MAX || q->addr != 0) {
        e->stat_protocol_errors++;
        fmc_engine_log(e, "dropped a data connection: bad vector request (%d entries)", n);
        return -1;
    }
    /* Room for the answer and its pins (reads), taken before anything is pinned. */
    if ((cs->niov + n + 3 > FMC_IOV_MAX || cs->nread_pins + n > FMC_IOV_MAX || cs->c->npins + n >= FMC_MAX_PINS ||
         cs->gpu_open.n || cs->gpu_flying.n) &&
        flush(cs) < 0)
        return -1;
    if (fmc_reader_fill(&cs->rd, (size_t)n * FMC_VEC_ENTRY_SIZE) < 0)
        return -1;
    uint64_t addr[FMC_VEC_MAX], len[FMC_VEC_MAX], sum = 0, ok_bytes = 0, gpu_bytes = 0;
    fmc_region *reg[FMC_VEC_MAX];
    int failed = 0, gpu_dev = -1; /* the first GPU entry's device: the staging buffer is pinned for it */
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
        if (reg[i]->cuda_dev >= 0) {
            gpu_bytes += len[i];
            if (gpu_dev < 0)
                gpu_dev = reg[i]->cuda_dev;
        }
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
    if (is_write) {
        struct iovec iov[FMC_VEC_MAX];
        if (rc == 0 && failed && !cs->sink && !(cs->sink = malloc(FMC_VEC_ENTRY_MAX)))
            rc = -1;
        uint8_t refused[FMC_VEC_MAX] = {0}; /* destinations the kernel refused to write */
        /* GPU destinations' payloads land side by side in the staging buffer, everything else
         * in place, all by one scatter read; then one gather copy puts the staged ones in place
         * and is waited for (this thread's copies only) before the answer is queued. */
        if (rc == 0 && gpu_bytes && fmc_staging_reserve(&cs->stage, (size_t)gpu_bytes, gpu_dev) != 0)
            rc = -1;
        uint64_t off = 0;
        for (int i = 0; rc == 0 && i < n; i++) {
            void *at = reg[i] ? (void *)(uintptr_t)addr[i] : cs->sink;
            if (reg[i] && reg[i]->cuda_dev >= 0) {
                at = cs->stage.buf + off;
                off += len[i];
            }
            iov[i] = (struct iovec){.iov_base = at, .iov_len = (size_t)len[i]};
        }
        if (rc == 0)
            rc = fmc_reader_read_regions(&cs->rd, iov, n, refused);
        if (rc == 0 && gpu_bytes && scatter_to_gpu(cs, reg, addr, len, iov, n) != FMC_OK) {
            for (int i = 0; i < n; i++) {
                if (reg[i] && reg[i]->cuda_dev >= 0) {
                    cs->vec_status[i] = FMC_ERR_DEVICE_NOT_FOUND;
                    ok_bytes -= len[i];
                    failed = 1;
                }
            }
        }
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
        /* GPU sources are copied out first, into the staging buffer the answer then points at;
         * nothing is queued until every source is in place. */
        void *src[FMC_VEC_MAX];
        size_t off = 0;
        if (gpu_bytes && fmc_staging_reserve(&cs->stage, (size_t)gpu_bytes, gpu_dev) != 0)
            rc = -1;
        for (int i = 0; i < n; i++) {
            src[i] = (void *)(uintptr_t)addr[i];
            if (!reg[i] || reg[i]->cuda_dev < 0)
                continue;
            src[i] = rc == 0 ? cs->stage.buf + off : NULL;
            off += len[i];
        }
        /* One gather of every GPU source into the staging buffer, waited for before the pins go. */
        if (rc == 0 && gpu_bytes && gather_from_gpu(cs, reg, addr, len, src, n) != FMC_OK)
            rc = -1;
        for (int i = 0; gpu_bytes && i < n; i++) {
            if (reg[i] && reg[i]->cuda_dev >= 0) {
                unpin(cs, reg[i]);
                reg[i] = NULL; /* staged: needs no pin any more */
            }
        }
        if (rc < 0) {
            for (int i = 0; i < n; i++)
                if (reg[i])
                    unpin(cs, reg[i]);
            return -1;
        }
        int zc = !gpu_bytes && zc_claim(cs, reg, n, ok_bytes); /* staged sources are reused */
        queue_vector_answer(cs, q->id, n, failed, ok_bytes, zc);
        for (int i = 0; i < n; i++) {
            if (cs->vec_status[i] != FMC_OK)
                continue;
            if (reg[i])
                cs->read_pins[cs->nread_pins++] = reg[i];
            push_payload(cs, src[i], len[i], zc);
        }
        cs->served_out += ok_bytes;
    }
    /* Statuses and staged bytes live in per-connection buffers: send them before they are reused. */
    if ((failed || gpu_bytes) && flush(cs) < 0)
        return -1;
    return 0;
}

static void serve(fmc_conn_state *cs)
{
    fmc_engine *e = cs->e;
    int wire = handshake(cs);
    if (wire < 0) {
        e->stat_protocol_errors++;
        return;
    }
    if (wire == WIRE_MOONCAKE) {
        fmc_mc_serve(cs);
        return;
    }
    for (;;) {
        if (fmc_reader_buffered(&cs->rd) < FMC_REQ_SIZE) {
            int more = fmc_reader_try_more(&cs->rd);
            if (more < 0)
                break;
            if (fmc_reader_buffered(&cs->rd) < FMC_REQ_SIZE) {
                if (flush(cs) < 0 || spin_for_more(cs->e, &cs->rd, FMC_REQ_SIZE, cs->last_len) < 0 ||
                    fmc_reader_fill(&cs->rd, FMC_REQ_SIZE) < 0)
                    break;
            }
            /* Stamped when the socket is read, not per request: a busy connection passes here
             * often enough for eviction's half-second idleness test. */
            __atomic_store_n(&cs->c->last_active_ms, fmc_now_ms(), __ATOMIC_RELAXED);
        }
        fmc_req q;
        fmc_req_decode(cs->rd.buf + cs->rd.start, &q);
        cs->rd.start += FMC_REQ_SIZE;
        cs->last_len = q.len;
        if (q.opcode == FMC_WIRE_OP_ACK) {
            if (zc_acknowledge(cs, q.len) < 0) {
                e->stat_protocol_errors++;
                fmc_engine_log(e, "dropped a data connection: acknowledged %llu zero-copy answers, %u outstanding",
                               (unsigned long long)q.len, cs->ledger_count);
                break;
            }
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
                rc = fmc_reader_read_region(&cs->rd, (void *)(uintptr_t)q.addr, (size_t)q.len);
                unpin(cs, r);
                if (rc == 0)
                    cs->served_in += q.len;
                if (rc == FMC_READ_REFUSED) {
                    refuse_protected(cs, q.addr, q.len);
                    r = NULL; /* answered as refused */
                    rc = 0;
                }
            } else {
                refuse(cs, &q);
                rc = fmc_reader_skip(&cs->rd, (size_t)q.len);
            }
            if (rc < 0)
                break;
            if (rc == 0)
                queue_answer(cs, q.id, r ? FMC_OK : FMC_ERR_REMOTE_REFUSED, NULL, 0);
        } else if (r && r->cuda_dev >= 0) {
            /* A GPU source: stage it, answer now (the staging buffer serves one answer). */
            if (flush(cs) < 0 || fmc_staging_reserve(&cs->stage, (size_t)q.len, r->cuda_dev) != 0 ||
                fmc_cuda_copy((uint64_t)(uintptr_t)cs->stage.buf, q.addr, (size_t)q.len, r->cuda_dev) != FMC_OK) {
                unpin(cs, r);
                break;
            }
            unpin(cs, r);
            queue_answer(cs, q.id, FMC_OK, cs->stage.buf, q.len);
            cs->served_out += q.len;
            if (flush(cs) < 0)
                break;
        } else if (r) {
            queue_read_answer(cs, q.id, r, q.addr, q.len);
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
}

void fmc_server_conn_cut_locked(fmc_server_conn *c)
{
    c->cut = 1;
    shutdown(c->fd, SHUT_RDWR); /* fd -1 once closed early (conn_main): nothing to do */
}

static void *conn_main(void *arg)
{
    fmc_conn_state *cs = arg;
    fmc_engine *e = cs->e;
    serve(cs);
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
    /* Closed under mu, once unlinked: nobody can shutdown() this fd number any more, and
     * fmc_engine_destroy returns only after every data socket is really closed. */
    if (c->fd >= 0)
        close(c->fd);
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    fmc_reader_free(&cs->rd);
    fmc_staging_release(&cs->stage);
    fmc_staging_release(&cs->stage2);
    fmc_zc_pipe_close(cs->zc_pipe);
    free(cs->sink);
    free(c);
    free(cs);
    return NULL;
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
    fmc_tune_socket_cc(fd, e->opts.local_cc);
    c->fd = fd;
    cs->e = e;
    cs->c = c;
    cs->zc_pipe[0] = cs->zc_pipe[1] = -1;
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
    c->next = e->conns;
    if (e->conns)
        e->conns->prev = c;
    e->conns = c;
    e->nconns++;
    pthread_mutex_unlock(&e->mu);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256u << 10);
    pthread_t t;
    if (pthread_create(&t, &attr, conn_main, cs) != 0) {
        /* Run the clean-up path without serving. */
        shutdown(fd, SHUT_RDWR);
        conn_main(cs);
    }
    pthread_attr_destroy(&attr);
}

void *fmc_server_accept_main(void *arg)
{
    fmc_engine *e = arg;
    for (;;) {
        struct pollfd pfd[2] = {{.fd = e->listen_fd, .events = POLLIN}, {.fd = e->wake_pipe[0], .events = POLLIN}};
        int n = poll(pfd, 2, 1000);
        pthread_mutex_lock(&e->mu);
        int stopping = e->stopping;
        pthread_mutex_unlock(&e->mu);
        if (stopping)
            break;
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
