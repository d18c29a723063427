"""Domain errors -> HTTP status, in one table; the 422 handler that names the field.

Nothing outside :mod:`service` raises ``HTTPException``: the repository and the domain types
raise their own errors and this table decides the status. Messages of storage errors are
shown without statement parameters (``db.session.translate_error`` already drops them).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from autotuner import DeviceError, ProblemError, StrategyError
from db import DuplicateError, LeaseError, NotFoundError, SchemaError, StorageError
from service.fields import field_path

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
    return {"detail": str(exc)}


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
