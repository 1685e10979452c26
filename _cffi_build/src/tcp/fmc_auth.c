/* Mutual shared-secret authentication of native data connections (both sides hold the secret).
 *
 *   initiator -> target  preamble (flags |= FMC_PREAMBLE_AUTH) + client nonce (16)
 *   target -> initiator  "FMCNATOK", status FMC_PREAMBLE_CHALLENGE, 0, server nonce (16),
 *                        HMAC(secret, "S" | client nonce | server nonce) (32)
 *   initiator -> target  HMAC(secret, "C" | server nonce | client nonce) (32)
 *   target -> initiator  "FMCNATOK", status 0 (or FMC_ERR_REJECT_HANDSHAKE, then close)
 *
 * Both proofs bind both fresh nonces, so neither side can be replayed or impersonated without
 * the secret.  The payload that follows is not encrypted or MAC'd (see the README's threat
 * model). */
#define _GNU_SOURCE
#include <string.h>
#include <sys/socket.h>

#include "fmc_internal.h"
#include "fmc_wire.h"

static void proof(const fmc_secret *s, char who, const uint8_t a[FMC_NONCE_SIZE], const uint8_t b[FMC_NONCE_SIZE],
                  uint8_t out[32])
{
    uint8_t msg[1 + 2 * FMC_NONCE_SIZE];
    msg[0] = (uint8_t)who;
    memcpy(msg + 1, a, FMC_NONCE_SIZE);
    memcpy(msg + 1 + FMC_NONCE_SIZE, b, FMC_NONCE_SIZE);
    fmc_hmac_sha256(s->key, s->len, msg, sizeof msg, out);
}

static void preamble_reply(uint8_t out[FMC_PREAMBLE_SIZE], int32_t status, uint32_t caps)
{
    memset(out, 0, FMC_PREAMBLE_SIZE);
    memcpy(out, FMC_MAGIC_OK, 8);
    fmc_put32(out + 8, (uint32_t)status);
    fmc_put32(out + 12, caps);
}

int fmc_auth_server(int fd, const fmc_secret *s, const uint8_t *client_nonce, uint32_t caps)
{
    uint8_t reply[FMC_PREAMBLE_SIZE + FMC_NONCE_SIZE + 32];
    uint8_t server_nonce[FMC_NONCE_SIZE], expected[32], got[32];
    if (fmc_random_bytes(server_nonce, sizeof server_nonce) < 0)
        return FMC_ERR_NOT_IMPLEMENTED; /* no fresh nonce, no proof: the caller drops the connection */
    preamble_reply(reply, FMC_PREAMBLE_CHALLENGE, 0);
    memcpy(reply + FMC_PREAMBLE_SIZE, server_nonce, FMC_NONCE_SIZE);
    proof(s, 'S', client_nonce, server_nonce, reply + FMC_PREAMBLE_SIZE + FMC_NONCE_SIZE);
    if (fmc_send_all(fd, reply, sizeof reply) < 0 || fmc_recv_all(fd, got, sizeof got) < 0)
        return FMC_ERR_SOCKET;
    proof(s, 'C', server_nonce, client_nonce, expected);
    int ok = fmc_equal_ct(expected, got, sizeof got);
    preamble_reply(reply, ok ? FMC_OK : FMC_ERR_REJECT_HANDSHAKE, ok ? caps : 0);
    if (fmc_send_all(fd, reply, FMC_PREAMBLE_SIZE) < 0)
        return FMC_ERR_SOCKET;
    return ok ? FMC_OK : FMC_ERR_REJECT_HANDSHAKE;
}

/* Initiator side; the socket has a receive timeout set by the caller. */
int fmc_auth_client(int fd, const fmc_secret *s, uint32_t flags, uint32_t *caps)
{
    uint8_t hello[FMC_PREAMBLE_SIZE + FMC_NONCE_SIZE] = {0};
    uint8_t client_nonce[FMC_NONCE_SIZE], reply[FMC_PREAMBLE_SIZE], challenge[FMC_NONCE_SIZE + 32], expected[32];
    memcpy(hello, FMC_MAGIC_HELLO, 8);
    fmc_put32(hello + 8, FMC_WIRE_VERSION);
    fmc_put32(hello + 12, flags | (s->len ? FMC_PREAMBLE_AUTH : 0));
    *caps = 0;
    if (fmc_random_bytes(client_nonce, sizeof client_nonce) < 0)
        return FMC_ERR_NOT_IMPLEMENTED; /* nothing sent yet */
    memcpy(hello + FMC_PREAMBLE_SIZE, client_nonce, FMC_NONCE_SIZE);
    size_t hello_len = s->len ? sizeof hello : FMC_PREAMBLE_SIZE;
    if (fmc_send_all(fd, hello, hello_len) < 0 || fmc_recv_all(fd, reply, sizeof reply) < 0)
        return FMC_ERR_SOCKET;
    if (memcmp(reply, FMC_MAGIC_OK, 8) != 0)
        return FMC_ERR_REMOTE_REFUSED; /* not a flagcx_mc data port */
    int32_t status = (int32_t)fmc_get32(reply + 8);
    *caps = fmc_get32(reply + 12); /* from the final answer: the challenge carries none */
    if (!s->len)
        return status == FMC_OK ? FMC_OK : status == FMC_ERR_REJECT_HANDSHAKE ? status : FMC_ERR_REMOTE_REFUSED;
    if (status != FMC_PREAMBLE_CHALLENGE) /* a target without our secret must not get our data */
        return FMC_ERR_REJECT_HANDSHAKE;
    if (fmc_recv_all(fd, challenge, sizeof challenge) < 0)
        return FMC_ERR_SOCKET;
    proof(s, 'S', client_nonce, challenge, expected);
    if (!fmc_equal_ct(expected, challenge + FMC_NONCE_SIZE, 32))
        return FMC_ERR_REJECT_HANDSHAKE;
    uint8_t answer[32];
    proof(s, 'C', challenge, client_nonce, answer);
    if (fmc_send_all(fd, answer, sizeof answer) < 0 || fmc_recv_all(fd, reply, sizeof reply) < 0)
        return FMC_ERR_SOCKET;
    *caps = fmc_get32(reply + 12);
    return (int32_t)fmc_get32(reply + 8) == FMC_OK ? FMC_OK : FMC_ERR_REJECT_HANDSHAKE;
}
