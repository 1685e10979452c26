/* Native data-plane framing (all integers little-endian).
 *
 * A connection starts with a 16-byte preamble from the initiator:
 *     char magic[8] = "FMCNATV1"; u32 version; u32 flags
 * and the target answers 16 bytes:
 *     char magic[8] = "FMCNATOK"; i32 status; u32 reserved
 * The magic read as a Mooncake TCP header `size` would be ~3.5e18 bytes, so a server can tell a
 * native peer from a Mooncake peer by its first 8 bytes (Mooncake's framing: fmc_mooncake.h).
 *
 * Then any number of requests, pipelined:
 *     u8 opcode (1 write, 2 read); u8 flags; u16 reserved; u32 key; u64 id; u64 addr; u64 len
 * followed, for a write, by `len` payload bytes.  The target answers every request, in order:
 *     u64 id; i32 status; u32 flags; u64 len
 * followed, for a successful read, by `len` bytes.  A write is answered only after its bytes are
 * in the target's memory.
 *
 * Vectors (when the initiator sets FMC_PREAMBLE_VECTORS and the target's answer carries
 * FMC_CAP_VECTORS in its last u32): opcode 3 (write) or 4 (read) with `key` = n entries (2 to
 * FMC_VEC_MAX), `id` = the first entry's id, `addr` = 0 and `len` = the sum of the entries'
 * lengths, then n entries of 24 bytes:
 *     u32 key; u32 reserved; u64 addr; u64 len        (len 1 to FMC_VEC_ENTRY_MAX)
 * followed, for a write, by the n payloads back to back.  One answer covers the vector: status 0
 * with len 0 (write) or the sum of the lengths followed by the n payloads (read); or a non-zero
 * status with a table of n i32 entry statuses, then, for a read, the payloads of the entries
 * whose status is 0, and len = 4n + those bytes.  A vector of small slices costs one header and
 * one answer, and each side moves its payloads with one scatter/gather call and no extra copy.
 *
 * A read request (opcode 2) with FMC_REQ_SHARE in its flags is a share of a call spread over
 * several streams: a target copies such an answer below FMC_ZC_SHARE_MIN_BYTES instead of sending
 * it zero-copy (below).  Targets ignore flags they do not know.
 *
 * Zero-copy read answers (when the initiator sets FMC_PREAMBLE_READ_ACKS and the target's answer
 * carries FMC_CAP_ZC_READS): the target may send a read answer's payload from its registered
 * pages without copying them (vmsplice + splice), flagging the answer FMC_RESP_ZC in the answer's
 * u32 after the status.  Those pages are read only when the initiator copies them out of its
 * socket, so the target keeps the regions pinned (unregister waits) until the initiator
 * acknowledges, with a request of opcode 5 (ack) whose `len` counts the flagged answers it has
 * consumed since its last ack (every other field 0; ack requests get no answer).  After taking
 * a flagged payload, the initiator checks that the connection was not reset: a target that has
 * to cut a connection with unacknowledged answers (unregister, shutdown) resets it before the
 * regions are released, so bytes read after their region was released never count as a success.
 *
 * Fences (when the target's answer carries FMC_CAP_FENCE): an initiator names each connection
 * with a request of opcode 6 (name), `addr` = a random 64-bit token, every other field 0, no
 * answer.  When it cuts a connection (a cancelled call) and connects again, the new connection's
 * first request after its name is opcode 7 (fence), `addr` = the cut connection's token: the
 * target shuts that connection down and answers (id 0, status 0, len 0) only once its thread has
 * stopped touching memory, so the calls sent again on the new connection land after anything
 * the cut one still held. */
#ifndef FMC_WIRE_H
#define FMC_WIRE_H

#include <endian.h>
#include <stdint.h>
#include <string.h>

#define FMC_PREAMBLE_SIZE 16
#define FMC_REQ_SIZE 32
#define FMC_RESP_SIZE 24
#define FMC_WIRE_VERSION 1u
#define FMC_PREAMBLE_AUTH 1u       /* preamble flag: 16-byte client nonce follows (fmc_auth.c) */
#define FMC_PREAMBLE_CHALLENGE 1   /* preamble answer status: authentication challenge follows */
#define FMC_NONCE_SIZE 16
#define FMC_WIRE_OP_WRITE 1
#define FMC_WIRE_OP_READ 2
#define FMC_WIRE_OP_WRITEV 3
#define FMC_WIRE_OP_READV 4
#define FMC_WIRE_OP_ACK 5          /* zero-copy read answers consumed (see above) */
#define FMC_WIRE_OP_NAME 6         /* this connection's token is `addr` (no answer) */
#define FMC_WIRE_OP_FENCE 7        /* cut the connection named `addr`; answered once it is gone */
#define FMC_PREAMBLE_VECTORS 2u    /* preamble flag: this initiator can send vectors */
#define FMC_PREAMBLE_READ_ACKS 4u  /* preamble flag: this initiator acknowledges zero-copy answers */
#define FMC_CAP_VECTORS 1u         /* preamble answer, last u32: this target takes vectors */
#define FMC_CAP_ZC_READS 2u        /* preamble answer: read answers may be zero-copy (acks wanted) */
#define FMC_CAP_FENCE 4u           /* preamble answer: this target takes names and fences */
#define FMC_RESP_ZC 1u             /* answer flag: zero-copy payload, acknowledge it */
#define FMC_REQ_SHARE 1u           /* read request flag: a share of a spread call (above) */
#define FMC_VEC_MAX 256            /* entries in one vector */
#define FMC_VEC_ENTRY_MAX (64u << 10) /* largest entry: bigger slices go alone (no gain, and a
                                       * refused entry is skipped through a buffer this size) */
#define FMC_VEC_ENTRY_SIZE 24
/* Largest slice a target accepts in one request; larger requests are a protocol error. */
#define FMC_MAX_WIRE_LEN (64ull << 20)

static const char FMC_MAGIC_HELLO[8] = {'F', 'M', 'C', 'N', 'A', 'T', 'V', '1'};
static const char FMC_MAGIC_OK[8] = {'F', 'M', 'C', 'N', 'A', 'T', 'O', 'K'};

typedef struct {
    uint8_t opcode;
    uint8_t flags;
    uint32_t key;
    uint64_t id;
    uint64_t addr;
    uint64_t len;
} fmc_req;

typedef struct {
    uint64_t id;
    int32_t status;
    uint32_t flags;
    uint64_t len;
} fmc_resp;

static inline void fmc_put64(uint8_t *p, uint64_t v) { v = htole64(v); memcpy(p, &v, 8); }
static inline void fmc_put32(uint8_t *p, uint32_t v) { v = htole32(v); memcpy(p, &v, 4); }
static inline uint64_t fmc_get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }
static inline uint32_t fmc_get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }

static inline void fmc_req_encode(uint8_t out[FMC_REQ_SIZE], const fmc_req *r)
{
    out[0] = r->opcode;
    out[1] = r->flags;
    out[2] = 0;
    out[3] = 0;
    fmc_put32(out + 4, r->key);
    fmc_put64(out + 8, r->id);
    fmc_put64(out + 16, r->addr);
    fmc_put64(out + 24, r->len);
}

static inline void fmc_req_decode(const uint8_t in[FMC_REQ_SIZE], fmc_req *r)
{
    r->opcode = in[0];
    r->flags = in[1];
    r->key = fmc_get32(in + 4);
    r->id = fmc_get64(in + 8);
    r->addr = fmc_get64(in + 16);
    r->len = fmc_get64(in + 24);
}

static inline void fmc_vec_entry_encode(uint8_t out[FMC_VEC_ENTRY_SIZE], uint32_t key, uint64_t addr, uint64_t len)
{
    fmc_put32(out, key);
    fmc_put32(out + 4, 0);
    fmc_put64(out + 8, addr);
    fmc_put64(out + 16, len);
}

static inline void fmc_resp_encode(uint8_t out[FMC_RESP_SIZE], const fmc_resp *r)
{
    fmc_put64(out, r->id);
    fmc_put32(out + 8, (uint32_t)r->status);
    fmc_put32(out + 12, r->flags);
    fmc_put64(out + 16, r->len);
}

static inline void fmc_resp_decode(const uint8_t in[FMC_RESP_SIZE], fmc_resp *r)
{
    r->id = fmc_get64(in);
    r->status = (int32_t)fmc_get32(in + 8);
    r->flags = fmc_get32(in + 12);
    r->len = fmc_get64(in + 16);
}

#endif
