"""Bearer-token authentication.

Tokens come from ``AUTOTUNER_WRITE_TOKENS`` / ``AUTOTUNER_READ_TOKENS`` (settings) and from the
tokens table (only SHA-256 digests are stored; ``db.repository.check_token``). Settings
tokens are compared with :func:`hmac.compare_digest` against every configured token (no early
exit). Writes need a write token: none or an unknown one is 401, a read-only one 403. Reads are
open unless read tokens are configured; then any valid token (read or write) is needed.
Tokens are never logged nor echoed in a response.
"""

from __future__ import annotations

import hmac
from typing import Literal

from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool

from autotuner.settings import Settings
from db import Database
from db import repository as repo

Scope = Literal["read", "write"]

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
_INVALID = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


def _matches(token: bytes, configured: list[str]) -> bool:
    found = False
    for candidate in configured:
        found |= hmac.compare_digest(token, candidate.encode("utf-8"))
    return found


def settings_scope(token: str, settings: Settings) -> Scope | None:
    """The scope a settings token grants (compared in constant time), else None."""
    raw = token.encode("utf-8", "surrogateescape")
    if _matches(raw, settings.write_tokens):
        return "write"
    if _matches(raw, settings.read_tokens):
        return "read"
    return None


def stored_scope(token: str, database: Database) -> Scope | None:
    """The scope of an unrevoked token in the tokens table, else None."""
    try:
        token.encode("utf-8")
    except UnicodeEncodeError:
        return None
    with database.session(read_only=True) as s:
        scope = repo.check_token(s, token)
    return scope if scope in ("read", "write") else None  # type: ignore[return-value]


async def require(scope: Scope, token: str | None, settings: Settings, database: Database) -> None:
    """Raise 401/403 unless ``token`` grants ``scope``. Settings tokens are checked in the event
    loop; only a token that is not one of them is looked up in the database (in a thread)."""
    if scope == "read" and not settings.read_tokens:
        return
    if not token:
        raise HTTPException(401, f"a bearer token is required ({scope}): "
                                 "send 'Authorization: Bearer TOKEN'", headers=_CHALLENGE)
    granted = settings_scope(token, settings)
    if granted is None:
        granted = await run_in_threadpool(stored_scope, token, database)
    if granted is None:
        raise HTTPException(401, "invalid or revoked token", headers=_INVALID)
    if scope == "write" and granted != "write":
        raise HTTPException(403, "this token may only read; writes need a write token")
