/* Mooncake's TCP framing (fmc_mooncake.h), both ways: serving a Mooncake initiator on our data
 * port (a connection fmc_server.c found not to start with our preamble), and the requests and
 * answers of a stream to a Mooncake target (fmc_stream.c). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "fmc_internal.h"
#include "fmc_mooncake.h"
#include "fmc_tcp_conn.h"
#include "fmc_wire.h"

/* ---------------------------------------------------------------- target side */

static void refuse(fmc_conn_state *cs, int is_write, uint64_t addr, uint64_t size)
{
    cs->e->stat_refused++;
    fmc_engine_log(cs->e, "refused Mooncake-framed %s of %llu bytes at 0x%llx: not inside a registered region%s",
                   is_write ? "write" : "read", (unsigned long long)size, (unsigned long long)addr,
                   is_write ? " (or the region is read-only)" : "");
}

void fmc_mc_refuse_connection(fmc_conn_state *cs)
{
    /* A v2 Mooncake initiator gets a rejection it acts on at once (it would otherwise sit out its
     * own status timeout), anything else only the close. */
    if (fmc_reader_fill(&cs->rd, FMC_MC_HDR_SIZE) == 0 && (cs->rd.buf[cs->rd.start + 16] & FMC_MC_V2_FLAG)) {
        uint8_t status[FMC_MC_STATUS_SIZE];
        fmc_put64(status, FMC_MC_STATUS_REJECTED);
        fmc_send_all(cs->c->fd, status, sizeof status);
        fmc_engine_log(cs->e, "refused a Mooncake-framed data connection: that framing is turned off");
    }
}

static void queue_status(fmc_conn_state *cs, int ok, void *data, uint64_t len)
{
    cs->requests++;
    uint8_t *h = cs->hdr[cs->nhdr++];
    fmc_put64(h, ok ? FMC_MC_STATUS_OK : FMC_MC_STATUS_REJECTED);
    cs->iov[cs->niov++] = (struct iovec){.iov_base = h, .iov_len = FMC_MC_STATUS_SIZE};
    cs->out_bytes += FMC_MC_STATUS_SIZE;
    if (data) {
        cs->iov[cs->niov++] = (struct iovec){.iov_base = data, .iov_len = (size_t)len};
        cs->out_bytes += len;
    }
}

/* A Mooncake initiator (v1 or v2 framing).  Mooncake has no keys: any registered region may be
 * addressed, which is why engines with a shared secret turn this framing off.  A refused write's
 * payload is not trusted to follow: v2 gets the rejection frame and the connection closes. */
void fmc_mc_serve(fmc_conn_state *cs, const fmc_conn_ops *ops)
{
    fmc_engine *e = cs->e;
    int first = 1;
    for (;;) {
        if (!first && fmc_reader_buffered(&cs->rd) < FMC_MC_HDR_SIZE) {
            if (fmc_reader_try_more(&cs->rd) < 0)
                break;
            if (fmc_reader_buffered(&cs->rd) < FMC_MC_HDR_SIZE && ops->flush(cs) < 0)
                break;
        }
        if (fmc_reader_fill(&cs->rd, FMC_MC_HDR_SIZE) < 0)
            break;
        if (first)
            fmc_socket_timeout(cs->c->fd, SO_RCVTIMEO, 0);
        first = 0;
        const uint8_t *p = cs->rd.buf + cs->rd.start;
        __atomic_store_n(&cs->c->last_active_ms, fmc_now_ms(), __ATOMIC_RELAXED);
        uint64_t size = fmc_get64(p), addr = fmc_get64(p + 8);
        int v2 = (p[16] & FMC_MC_V2_FLAG) != 0, op = p[16] & 0x7f;
        cs->rd.start += FMC_MC_HDR_SIZE;
        if (op != FMC_MC_OP_READ && op != FMC_MC_OP_WRITE) {
            e->stat_protocol_errors++;
            fmc_engine_log(e, "dropped a Mooncake-framed data connection: bad opcode 0x%02x", p[16]);
            break;
        }
        int is_write = op == FMC_MC_OP_WRITE;
        fmc_region *r = size ? ops->pin(cs, addr, size, NULL, is_write) : NULL;
        if (size && !r) {
            refuse(cs, is_write, addr, size);
            if (v2)
                queue_status(cs, 0, NULL, 0);
            if (!v2 || is_write)
                break; /* v1 learns of a refusal only by the close, as from Mooncake itself */
        } else if (is_write) {
            int rc = size ? fmc_reader_read_region(&cs->rd, (void *)(uintptr_t)addr, (size_t)size) : 0;
            if (r)
                ops->unpin(cs, r);
            if (rc < 0)
                break;
            if (rc == FMC_READ_REFUSED) {
                /* The kernel refused the destination (its protection changed after registration);
                 * the payload was read and dropped, so v2 hears of it and the connection goes on. */
                cs->e->stat_refused++;
                fmc_engine_log(e, "refused Mooncake-framed write of %llu bytes at 0x%llx: the kernel refused to write "
                               "the registered memory (its protection changed after registration?)",
                               (unsigned long long)size, (unsigned long long)addr);
                if (!v2)
                    break;
                queue_status(cs, 0, NULL, 0);
            } else {
                cs->served_in += size;
                if (v2)
                    queue_status(cs, 1, NULL, 0);
            }
        } else {
            if (r)
                cs->read_pins[cs->nread_pins++] = r;
            if (v2)
                queue_status(cs, 1, size ? (void *)(uintptr_t)addr : NULL, size);
            else if (size) {
                cs->iov[cs->niov++] = (struct iovec){.iov_base = (void *)(uintptr_t)addr, .iov_len = (size_t)size};
                cs->out_bytes += size;
            }
            cs->served_out += size;
        }
        if (cs->niov + 2 > FMC_IOV_MAX || cs->out_bytes >= FMC_FLUSH_BYTES) {
            if (ops->flush(cs) < 0)
                break;
        }
    }
    ops->flush(cs);
}

/* ---------------------------------------------------------------- initiator side */

size_t fmc_mc_encode_request(const fmc_slice *s, int is_write, uint8_t *out)
{
    uint8_t op = (uint8_t)((is_write ? FMC_MC_OP_WRITE : FMC_MC_OP_READ) | FMC_MC_V2_FLAG);
    fmc_mc_hdr_encode(out, s->len, s->remote, op);
    return FMC_MC_HDR_SIZE;
}

int fmc_mc_read_answer(fmc_reader *rd, fmc_resp *a)
{
    if (fmc_reader_fill(rd, FMC_MC_STATUS_SIZE) < 0)
        return -1;
    uint64_t v = fmc_get64(rd->buf + rd->start);
    rd->start += FMC_MC_STATUS_SIZE;
    if (v != FMC_MC_STATUS_OK && v != FMC_MC_STATUS_REJECTED)
        return -1;
    a->id = 0;
    a->flags = 0;
    a->len = 0;
    a->status = v == FMC_MC_STATUS_OK ? FMC_OK : FMC_ERR_REMOTE_REFUSED;
    return 0;
}

void fmc_mc_match_answer(const fmc_slice *s, fmc_resp *a)
{
    a->id = s->id;
    a->len = s->batch->opcode == FMC_OP_READ && a->status == FMC_OK ? s->len : 0;
}
