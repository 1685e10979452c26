/* The same-host path as batches see it (fmc_samehost_ops): the copy runs now, in the calling
 * thread (fmc_sh_transfer), and the batch handed back has already ended, so there is nothing to
 * cancel and no answer to wait for.  A batch with a task the path cannot reach is declined and
 * goes to the next transport of the peer (TCP). */
#define _GNU_SOURCE
#include <stdlib.h>

#include "fmc_internal.h"

/* Declines (FMC_DECLINED) when some region has no same-host slot, or a GPU range cannot be
 * reached from here (fmc_peer_lookup_routes). */
static int sh_submit(const fmc_transfer_req *req, fmc_batch **out, void **caller_rx)
{
    fmc_peer *p = req->peer;
    int opcode = req->opcode, n = req->n;
    const uint64_t *lens = req->lens;
    /* A caller that must not block still copies here: the copy is the call. */
    int64_t deadline_ms = req->inline_deadline_ms == FMC_INLINE_NOWAIT ? -1 : req->inline_deadline_ms;
    fmc_sh_route *routes = malloc(sizeof *routes * (size_t)(n ? n : 1));
    if (!routes)
        return FMC_ERR_MEMORY;
    if (!fmc_peer_lookup_routes(p, n, req->remote, lens, req->local_dev, routes)) {
        free(routes);
        return FMC_DECLINED;
    }
    int rc = fmc_sh_transfer(p, opcode, n, req->local, req->remote, lens, req->local_dev, routes, deadline_ms);
    fmc_peer_routes_done(p);
    free(routes);
    fmc_batch *b = req->new_batch(req, 0);
    if (!b)
        return FMC_ERR_MEMORY;
    uint64_t bytes = 0;
    for (int i = 0; i < n; i++) {
        b->task_status[i] = rc;
        bytes += lens[i];
    }
    b->first_error = rc;
    b->finished = 1;
    fmc_engine *e = p->engine;
    if (rc == FMC_OK) {
        e->stat_batches_ok++;
        if (opcode == FMC_OP_WRITE)
            e->stat_written_out += bytes;
        else
            e->stat_read_in += bytes;
    } else {
        e->stat_batches_failed++;
    }
    *out = b;
    return FMC_OK;
}

const fmc_transport_ops fmc_samehost_ops = {
    .submit = sh_submit,
    .healthy = NULL, /* its control block stays mapped while the peer lives */
    .cancel_tasks = NULL, /* its batches have ended when submit returns */
    .caller_receive = NULL,
};
