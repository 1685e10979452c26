"""Optional shared-secret authentication of the control plane (the data plane's is in C).

With a secret, every handshake request except Probe carries an HMAC-SHA256 over its type, a
timestamp, a fresh nonce and its canonical JSON; the server refuses stale, replayed or forged
requests and signs its reply over the request's nonce, so the client knows the reply came from
a holder of the secret too.  Nothing is encrypted: see the README's threat model.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping

import orjson

from .. import errors
from .codec import DEFAULT_MAX_LENGTH, Message, MessageType
from .handshake import Handler, request

__all__ = ["AUTH_KEY", "sign_request", "RequestVerifier", "sign_reply", "verify_reply", "authed_request",
           "guard_handlers", "secret_from_env"]

AUTH_KEY = "flagcx_mc_auth"
WINDOW_MS = 60_000
_UNAUTHENTICATED = frozenset({MessageType.PROBE})


def secret_from_env(value: str | None) -> bytes | None:
    return value.encode() if value else None


def _mac(secret: bytes, label: str, mtype: int, nonce: str, extra: str, payload: Mapping) -> str:
    body = orjson.dumps({k: v for k, v in payload.items() if k != AUTH_KEY}, option=orjson.OPT_SORT_KEYS)
    head = f"{label}|{int(mtype)}|{nonce}|{extra}|".encode()
    return hmac.new(secret, head + body, hashlib.sha256).hexdigest()


def sign_request(secret: bytes, mtype: int, payload: dict) -> tuple[dict, str]:
    """Return the payload with its proof, and the nonce the reply must be bound to."""
    nonce = secrets.token_hex(16)
    ts = str(int(time.time() * 1000))
    proof = {"ts": ts, "nonce": nonce, "mac": _mac(secret, "req", mtype, nonce, ts, payload)}
    return {**payload, AUTH_KEY: proof}, nonce


class RequestVerifier:
    """Checks request proofs; remembers nonces inside the time window to refuse replays."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._seen: dict[str, float] = {}

    def verify(self, mtype: int, payload: Mapping) -> str:
        proof = payload.get(AUTH_KEY)
        if not isinstance(proof, dict):
            raise errors.HandshakeRejectedError("this engine requires the shared secret")
        ts, nonce, mac = proof.get("ts"), proof.get("nonce"), proof.get("mac")
        # isdecimal, not isdigit: "²" is a digit that int() refuses (a ValueError, not a rejection)
        if not (isinstance(ts, str) and isinstance(nonce, str) and isinstance(mac, str)) or not ts.isdecimal():
            raise errors.HandshakeRejectedError("malformed authentication block")
        expected = _mac(self._secret, "req", mtype, nonce, ts, payload)
        if not hmac.compare_digest(expected, mac):
            raise errors.HandshakeRejectedError("wrong shared secret")
        now = time.time() * 1000
        if abs(now - int(ts)) > WINDOW_MS:
            raise errors.HandshakeRejectedError("stale request (check the clocks)")
        self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * WINDOW_MS}
        if nonce in self._seen:
            raise errors.HandshakeRejectedError("replayed request")
        self._seen[nonce] = now
        return nonce


def sign_reply(secret: bytes, mtype: int, nonce: str, payload: dict) -> dict:
    return {**payload, AUTH_KEY: {"mac": _mac(secret, "rep", mtype, nonce, "", payload)}}


def verify_reply(secret: bytes, mtype: int, nonce: str, payload: Mapping) -> dict:
    proof = payload.get(AUTH_KEY)
    mac = proof.get("mac") if isinstance(proof, dict) else None
    if not isinstance(mac, str) or not hmac.compare_digest(_mac(secret, "rep", mtype, nonce, "", payload), mac):
        raise errors.HandshakeRejectedError("the peer's reply is not signed with our shared secret")
    return {k: v for k, v in payload.items() if k != AUTH_KEY}


async def authed_request(secret: bytes | None, host: str, port: int, mtype: MessageType, payload: dict,
                         *, timeout: float, max_length: int = DEFAULT_MAX_LENGTH) -> dict:
    """``handshake.request`` with proofs both ways when a secret is set."""
    if secret is None or mtype in _UNAUTHENTICATED:
        return await request(host, port, mtype, payload, timeout=timeout, max_length=max_length)
    signed, nonce = sign_request(secret, mtype, payload)
    reply = await request(host, port, mtype, signed, timeout=timeout, max_length=max_length)
    return verify_reply(secret, mtype, nonce, reply)


def guard_handlers(handlers: Mapping[MessageType, Handler], secret: bytes | None) -> dict[MessageType, Handler]:
    """Wrap handshake handlers so that, with a secret, only proven requests reach them."""
    if secret is None:
        return dict(handlers)
    verifier = RequestVerifier(secret)

    def guard(mtype: MessageType, handler: Handler) -> Handler:
        if mtype in _UNAUTHENTICATED:
            return handler

        async def checked(message: Message) -> dict:
            nonce = verifier.verify(mtype, message.payload)
            clean = {k: v for k, v in message.payload.items() if k != AUTH_KEY}
            reply = await handler(Message(message.type, clean))
            return sign_reply(secret, mtype, nonce, reply)

        return checked

    return {mtype: guard(mtype, h) for mtype, h in handlers.items()}
