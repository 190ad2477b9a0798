"""Admission: the session tokens the front hands out and the shards check, so a peer that
skipped the handshake changes nothing (PROTOCOL.md, Admission).

Admission is not authentication: keep the server on a private network, or turn on CURVE.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from asyncsgd.wire.protocol import ATTACH, BYE, HEARTBEAT, PULL, PUSH, Key, Message

TOKEN_BYTES = 16  # 128 bits: cannot be guessed, and keeps each header small
# What a shard serves only to members (an attach maps memory: members only, too).
ADMITTED_TYPES = frozenset({PUSH, PULL, HEARTBEAT, BYE, ATTACH})


VERIFIED = 1024  # (worker, incarnation, token) checks remembered: no HMAC a message


class Sessions:
    """Tokens for (worker id, incarnation) under one server start's key.

    A token is the HMAC of the worker's (id, incarnation) under a key only this server's
    processes know, so a shard checks it without asking anyone (the supervisor hands the
    key to every shard start). A server started again has a new key: old tokens are
    refused and the workers say hello again."""

    def __init__(self, key: bytes):
        self.key = key
        self._verified: set = set()  # tokens checked good, so a worker's next message is cheap

    @classmethod
    def new(cls) -> "Sessions":
        return cls(secrets.token_bytes(32))

    def token(self, worker: str, incarnation: int) -> str:
        mac = hmac.new(self.key, f"{incarnation}:{worker}".encode(), hashlib.sha256)
        return mac.hexdigest()[:2 * TOKEN_BYTES]

    def admits(self, msg: Message) -> bool:
        """Whether a shard may serve ``msg``: its token is the one its (id, incarnation) was
        welcomed with. Stats, and pulls of observers (which read and join nothing), are
        open to anyone; everything a worker does as a member needs the token."""
        observer = msg.type == PULL and msg.meta.get(Key.OBSERVER) is True
        if msg.type not in ADMITTED_TYPES or observer:
            return True
        claim = (msg.worker, msg.incarnation, msg.token)
        if claim in self._verified:
            return True
        if not (msg.worker and hmac.compare_digest(
                msg.token, self.token(msg.worker, msg.incarnation))):
            return False
        if len(self._verified) >= VERIFIED:  # bounded: forget all, re-check as they come
            self._verified.clear()
        self._verified.add(claim)
        return True
