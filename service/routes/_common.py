"""Shared bits of the routers: documented error responses and bounded query parameters."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query
from pydantic import BaseModel

from service.field_types import TEXT_PATTERN

MAX_ID = 2**31 - 1  # ids are 32-bit on PostgreSQL; larger ones cannot exist


class ErrorOut(BaseModel):
    detail: str


_DESCRIPTIONS = {
    401: "No bearer token, or an unknown or revoked one",
    403: "The token may not do this (a read-only token on a write)",
    404: "No such record",
    409: "Conflict (e.g. the worker does not hold the job's lease)",
    413: "The request body is larger than AUTOTUNER_MAX_BODY_BYTES",
    503: "The database is unavailable or not at the expected schema revision",
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorOut, "description": _DESCRIPTIONS[c]} for c in codes}


READ = (401, 503)
WRITE = (401, 403, 413, 503)

Offset = Annotated[int, Query(ge=0, le=MAX_ID, description="rows to skip")]
Limit = Annotated[int, Query(ge=1, le=1000, description="rows per page (at most 1000)")]


def text_query(description: str, max_length: int = 256) -> Any:
    return Query(min_length=1, max_length=max_length, pattern=TEXT_PATTERN,
                 description=description)


def next_offset(offset: int, returned: int, total: int | None, limit: int) -> int | None:
    nxt = offset + returned
    if total is not None:
        return nxt if nxt < total else None
    return nxt if returned == limit else None
