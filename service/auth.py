"""Bearer-token authentication.

Tokens come from ``AUTOTUNER_WRITE_TOKENS`` / ``AUTOTUNER_READ_TOKENS`` (settings) and from the
tokens table (only SHA-256 digests are stored; ``db.repository.check_token``). Settings
tokens are compared with :func:`hmac.compare_digest` against every configured token (no early
exit). Writes need a write token: none or an unknown one is 401, a read-only one 403. An
``in-job`` token (stored only: the token a training job holds for in-job tuning) reads, and uploads
results whose every measurement is ``in-job`` (``POST /v1/results`` checks it), nothing else. Reads
are open unless read tokens are configured; then any valid token is needed. ``require`` returns the
:class:`Grant`: the scope and the stored token's id, which a measurement records as its writer.
Tokens are never logged nor echoed in a response.
"""

from __future__ import annotations

import hmac
from typing import Literal, NamedTuple

from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool

from autotuner.settings import Settings
from db import Database
from db import repository as repo
from db.tables import TOKEN_SCOPES

Scope = Literal["read", "write", "in-job"]
Need = Literal["read", "write", "results"]   # what a route needs: results takes write or in-job


class Grant(NamedTuple):
    """What a request's token grants: its scope (None: an anonymous read) and, for a stored
    token, its id (None: a settings token or none)."""

    scope: Scope | None
    token_id: int | None


ANONYMOUS = Grant(None, None)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
_INVALID = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


def _matches(token: bytes, configured: list[str]) -> bool:
    found = False
    for candidate in configured:
        found |= hmac.compare_digest(token, candidate.encode("utf-8"))
    return found


def bearer_token(header: bytes | None) -> str | None:
    """The token of a raw ``Authorization: Bearer TOKEN`` header value, None without one (for the
    ASGI layers in front of FastAPI's own ``HTTPBearer``)."""
    if header is None or header[:7].lower() != b"bearer ":
        return None
    return header[7:].decode("latin-1").strip() or None


def settings_scope(token: str, settings: Settings) -> Scope | None:
    """The scope a settings token grants (compared in constant time), else None."""
    raw = token.encode("utf-8", "surrogateescape")
    if _matches(raw, settings.write_tokens):
        return "write"
    if _matches(raw, settings.read_tokens):
        return "read"
    return None


def stored_grant(token: str, database: Database) -> Grant | None:
    """The grant of an unrevoked token in the tokens table, else None."""
    try:
        token.encode("utf-8")
    except UnicodeEncodeError:
        return None
    with database.session(read_only=True) as s:
        found = repo.token_grant(s, token)
    if found is None or found[1] not in TOKEN_SCOPES:
        return None
    return Grant(found[1], found[0])  # type: ignore[arg-type]


async def grant_of(token: str, settings: Settings, database: Database) -> Grant | None:
    """What ``token`` grants (a settings token, checked in the event loop, else a stored one,
    looked up in a thread), None where it is not valid."""
    scope = settings_scope(token, settings)
    return Grant(scope, None) if scope is not None else await run_in_threadpool(stored_grant, token, database)


async def require(need: Need, token: str | None, settings: Settings, database: Database) -> Grant:
    """The grant of ``token``; 401/403 unless it allows ``need``. Settings tokens are checked in the
    event loop; only a token that is not one of them is looked up in the database (in a thread)."""
    if need == "read" and not settings.read_tokens:
        return ANONYMOUS   # open reads: no token is looked up
    if not token:
        raise HTTPException(401, f"a bearer token is required ({'write' if need == 'results' else need}): "
                                 "send 'Authorization: Bearer TOKEN'", headers=_CHALLENGE)
    grant = await grant_of(token, settings, database)
    if grant is None:
        raise HTTPException(401, "invalid or revoked token", headers=_INVALID)
    if need == "write" and grant.scope != "write":
        raise HTTPException(403, f"this token may only {_may(grant.scope)}; this needs a write token")
    if need == "results" and grant.scope not in ("write", "in-job"):
        raise HTTPException(403, f"this token may only {_may(grant.scope)}; uploads need a write or in-job token")
    return grant


def _may(scope: Scope | None) -> str:
    return "read and upload in-job results" if scope == "in-job" else "read"
