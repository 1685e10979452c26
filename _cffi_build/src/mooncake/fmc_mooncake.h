/* Mooncake's TCP transport (tcp_transport_session_impl.h): a raw 24-byte header
 *     u64 size; u64 addr; u8 opcode (0 read, 1 write; | 0x80 = protocol v2); 7 padding bytes
 * followed by `size` bytes for a write.  v2 targets answer every request with an 8-byte status
 * (after a write's bytes landed; before a read's bytes).  v1 answers nothing, so a v1 write can
 * never be confirmed: we only speak v2 as an initiator and accept both as a target.
 *
 * Everything that knows this framing is here and in fmc_mooncake.c; the TCP transport
 * (src/tcp/) calls in through the functions below. */
#ifndef FMC_MOONCAKE_H
#define FMC_MOONCAKE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

#define FMC_MC_HDR_SIZE 24
#define FMC_MC_STATUS_SIZE 8
#define FMC_MC_OP_READ 0
#define FMC_MC_OP_WRITE 1
#define FMC_MC_V2_FLAG 0x80
#define FMC_MC_STATUS_OK 0x4D43545600000000ull
#define FMC_MC_STATUS_REJECTED 0x4D43545600000001ull

static inline void fmc_mc_hdr_encode(uint8_t out[FMC_MC_HDR_SIZE], uint64_t size, uint64_t addr, uint8_t opcode)
{
    memset(out, 0, FMC_MC_HDR_SIZE);
    fmc_put64(out, size);
    fmc_put64(out + 8, addr);
    out[16] = opcode;
}

/* ---------------------------------------------------------------- serving a Mooncake initiator */
struct fmc_conn_state;
struct fmc_conn_ops;
/* Serve a data connection whose first bytes are not our preamble, in Mooncake's framing (v1 or
 * v2), until it ends, through the server's `ops`; the connection's answers are flushed before
 * it returns. */
void fmc_mc_serve(struct fmc_conn_state *cs, const struct fmc_conn_ops *ops);
/* Mooncake's framing is turned off on this engine: a v2 initiator gets a rejection it acts on at
 * once; the caller then closes the connection. */
void fmc_mc_refuse_connection(struct fmc_conn_state *cs);

/* ---------------------------------------------------------------- talking to a Mooncake target */
/* One v2 request header for slice s into out (room for FMC_REQ_SIZE); returns its length. */
size_t fmc_mc_encode_request(const fmc_slice *s, int is_write, uint8_t *out);
/* The next status answer, as a native answer with id 0 and no length (fmc_mc_match_answer
 * fills them in); -1 on EOF or a status that is neither OK nor REJECTED. */
int fmc_mc_read_answer(fmc_reader *rd, fmc_resp *a);
/* Mooncake answers carry no id: in-order delivery is the match, so the answer takes the id of
 * the slice at the head of the stream's in-flight list, and a successful read's length. */
void fmc_mc_match_answer(const fmc_slice *s, fmc_resp *a);

#endif
