"""Domain errors -> HTTP status, in one table; the 422 handler that names the field.

Nothing outside :mod:`service` raises ``HTTPException``: the repository and the domain types
raise their own errors and this table decides the status. Messages of storage errors are
shown without statement parameters (``db.database.translate_error`` already drops them).

Any other exception is a bug: :class:`InternalErrorMiddleware` answers that request alone a
JSON 500 carrying a request id (the client's ``X-Request-Id`` if it sent a plain one, else a
new one; also in the response's ``X-Request-Id``) and logs one line with that id. The
traceback is logged the first time an error of that type is raised at that place in this
process, not once per request.
"""

from __future__ import annotations

import logging
import re
import traceback
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from autotuner import DeviceError, ProblemError, StrategyError
from db import DuplicateError, LeaseError, NotFoundError, SchemaError, StorageError
from service.field_types import field_path

log = logging.getLogger("service")

# Most specific first: the first matching class decides.
STATUS: tuple[tuple[type[Exception], int], ...] = (
    (NotFoundError, 404),
    (LeaseError, 409),
    (DuplicateError, 409),
    (SchemaError, 503),
    (StorageError, 503),
    (ProblemError, 422),
    (DeviceError, 422),
    (StrategyError, 422),
    (ValueError, 422),  # the repository's "invalid input" (names the field)
)

_CUSTOM = {"problem_invalid", "device_invalid", "strategy_invalid"}


def status_for(exc: Exception) -> int | None:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return None


def error_body(status: int, exc: Exception) -> dict[str, Any]:
    if status == 422:
        loc: list[Any] = ["body"]
        if isinstance(exc, ProblemError):
            loc += ["problem", *field_path(exc.field)] if exc.field != "problem" else ["problem"]
        elif isinstance(exc, DeviceError):
            loc += ["device", exc.field] if exc.field != "device" else ["device"]
        elif isinstance(exc, StrategyError):
            loc += ["strategy", exc.field]
        return {"detail": [{"type": "value_error", "loc": loc, "msg": str(exc)}]}
    if status == 503:   # the database's URL, user and host, or its driver's words, stay in the log
        return {"detail": public_storage_error(exc)}
    return {"detail": str(exc)}


def public_storage_error(exc: Exception) -> str:
    """What a client is told of a database problem: its kind and the fix, never the database's
    name, host or user, nor the driver's message (the service logs those)."""
    if isinstance(exc, SchemaError):
        return ("the results database is not at the schema this service reads: an operator runs "
                "`autotuner db upgrade` (or upgrades the service); details are in the service's log")
    return "the results database is unavailable; details are in the service's log"


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    status = status_for(exc)
    if status is None or isinstance(exc, ValidationError):
        # A pydantic error raised by our own code (not the request's) is a bug: let it be a 500.
        raise exc
    if status >= 500:
        log.warning("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return JSONResponse(error_body(status, exc), status_code=status)


def validation_errors(errors: Any) -> list[dict[str, Any]]:
    """pydantic errors with the domain code's field path appended to ``loc``."""
    out = []
    for err in errors:
        err = dict(err)
        ctx = err.get("ctx") or {}
        if err.get("type") in _CUSTOM and ctx.get("path"):
            err["loc"] = [*err.get("loc", ()), *field_path(str(ctx["path"]))]
        err.pop("url", None)
        out.append(err)
    return out


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse({"detail": jsonable_encoder(validation_errors(exc.errors()))},
                        status_code=422)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    for cls, _status in STATUS:
        app.add_exception_handler(cls, _domain_error)


def invalid(loc: list[Any], message: str, value: Any = None) -> RequestValidationError:
    """A 422 naming ``loc`` (for checks a route makes itself, e.g. the batch size)."""
    return RequestValidationError([{"type": "value_error", "loc": tuple(loc), "msg": message,
                                    "input": value}])


_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")
_SEEN_MAX = 256  # error sites whose traceback was logged (then only one line each)


class InternalErrorMiddleware:
    """Pure ASGI middleware: an unexpected exception below it is a JSON 500 for that request
    alone, logged once (module docs); nothing is re-raised to the server."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._seen: set[tuple[str, str, int]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:  # noqa: BLE001 - a bug: answered and logged here, once
            rid = request_id(scope)
            self._log(rid, scope, exc)
            if not started:
                await JSONResponse({"detail": f"internal error (request id {rid})", "request_id": rid},
                                   status_code=500, headers={"x-request-id": rid})(scope, receive, send)

    def _log(self, rid: str, scope: Scope, exc: Exception) -> None:
        where = traceback.extract_tb(exc.__traceback__)[-1:]
        site = (type(exc).__name__, *((where[0].filename, where[0].lineno or 0) if where else ("", 0)))
        first = site not in self._seen and len(self._seen) < _SEEN_MAX
        if first:
            self._seen.add(site)
        log.error("request %s: %s %s failed: %s: %s", rid, scope.get("method"), scope.get("path"),
                  type(exc).__name__, str(exc)[:500], exc_info=exc if first else None)


def request_id(scope: Scope) -> str:
    """The request's ``X-Request-Id`` if it is a plain token of at most 64 characters, else new."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id" and _REQUEST_ID.fullmatch(value):
            return value.decode("ascii")
    return uuid.uuid4().hex[:16]
