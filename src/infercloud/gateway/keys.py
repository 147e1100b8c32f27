"""API keys: `ic-<key_id>-<secret>`; the key id finds the record, the secret proves it.

The secret is 32 random bytes (url-safe base64), so a plain SHA-256 of it is a safe thing to
store (no dictionary to guess from), and `verify` compares digests in constant time. The key id
is public: it names the key in listings, usage records and revocations.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX = "ic-"
PRIORITIES = ("interactive", "standard", "batch")
"""Priority classes, highest first."""


def new_key() -> tuple[str, str, str]:
    """A fresh key: (key, key_id, secret_sha256). The key itself is shown once, never stored."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return f"{PREFIX}{key_id}-{secret}", key_id, digest(secret)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse(key: str) -> tuple[str, str] | None:
    """(key_id, secret) of a well-formed key, else None."""
    if not key.startswith(PREFIX):
        return None
    key_id, sep, secret = key[len(PREFIX) :].partition("-")
    if not sep or not key_id or not secret:
        return None
    return key_id, secret


def verify(secret: str, secret_sha256: str) -> bool:
    return hmac.compare_digest(digest(secret), secret_sha256)
