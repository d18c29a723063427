"""API tokens: only SHA-256 digests are stored (private; see db.repository)."""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from db._common import now_utc, text_field
from db._convert import token_record
from db.errors import DuplicateError, NotFoundError
from db.records import TokenRecord
from db.tables import TOKEN_SCOPES, Token


def token_hash(token: str) -> str:
    """The stored form of a token: its SHA-256 hex digest."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def add_token(s: Session, name: str, token: str, scope: str) -> TokenRecord:
    """Store a token (its hash only) under ``name`` with ``scope`` ``"read"``, ``"write"`` or
    ``"in-job"`` (reads, and uploads of in-job measurements only: a training job's token).

    Raises :class:`DuplicateError` if the same token is stored already.
    """
    text_field(name, "name", max_len=128)
    if scope not in TOKEN_SCOPES:
        raise ValueError(f"scope must be one of {TOKEN_SCOPES}, not {scope!r}")
    if not isinstance(token, str) or not token.strip():
        raise ValueError("token must be a non-empty string")
    digest = token_hash(token)
    if s.execute(select(Token.id).where(Token.token_hash == digest)).first() is not None:
        raise DuplicateError("this token is already stored (under some name)")
    row = Token(name=name, token_hash=digest, scope=scope)
    s.add(row)
    s.flush()
    return token_record(row)


def check_token(s: Session, token: str) -> str | None:
    """The scope of an unrevoked stored token, else ``None`` (digests compared in constant
    time)."""
    grant = token_grant(s, token)
    return grant[1] if grant is not None else None


def token_grant(s: Session, token: str) -> tuple[int, str] | None:
    """(id, scope) of an unrevoked stored token, else ``None``: the id is what a measurement it
    uploads records as its writer (digests compared in constant time)."""
    if not isinstance(token, str) or not token:
        return None
    digest = token_hash(token)
    row = s.execute(
        select(Token.id, Token.token_hash, Token.scope).where(
            Token.token_hash == digest, Token.revoked_at.is_(None)
        )
    ).first()
    if row is None or not hmac.compare_digest(row.token_hash, digest):
        return None
    return int(row.id), str(row.scope)


def revoke_token(s: Session, token_id: int, now: datetime | None = None) -> TokenRecord:
    """Revoke a token by id (idempotent: the first revocation time is kept)."""
    row = s.get(Token, token_id, populate_existing=True)
    if row is None:
        raise NotFoundError(f"token {token_id} does not exist")
    if row.revoked_at is None:
        row.revoked_at = now_utc(now)
        s.flush()
    return token_record(row)


def list_tokens(s: Session) -> list[TokenRecord]:
    return [token_record(r) for r in s.scalars(select(Token).order_by(Token.id))]
