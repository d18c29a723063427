"""GET /healthz (readiness: the database answers at the schema this code expects), GET /livez
(liveness: the process serves, whatever the database does) and GET /metrics (Prometheus)."""

from __future__ import annotations

import logging
from importlib import metadata

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from db import StorageError
from service.deps import StateDep
from service.errors import public_storage_error
from service.schemas import Health

router = APIRouter(tags=["health"])
log = logging.getLogger("service")

try:
    VERSION = metadata.version("overlap-autotuner")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    VERSION = "0.0.0"


@router.get("/healthz", response_model=Health,
            responses={503: {"model": Health, "description": "The database is unavailable"}})
def healthz(state: StateDep) -> Health | JSONResponse:
    """200 when the database answers and is at the schema revision this code expects."""
    db = state.database
    try:
        db.check_schema()
    except StorageError as e:  # SchemaError included; the URL and the driver's words go to the log only
        log.warning("GET /healthz: %s: %s", type(e).__name__, e)
        body = Health(status="unavailable", database=public_storage_error(e), dialect=db.dialect, version=VERSION)
        return JSONResponse(body.model_dump(mode="json"), status_code=503)
    return Health(status="ok", database="ok", dialect=db.dialect, version=VERSION)


@router.get("/livez")
def livez() -> dict[str, str]:
    """200 while this process serves requests. It asks nothing of the database: a database outage
    or a migration makes replicas unready (/healthz), and restarting them would not help."""
    return {"status": "ok", "version": VERSION}


@router.get("/metrics", response_model=None, response_class=Response,
            responses={200: {"content": {"text/plain": {}},
                             "description": "Prometheus text exposition format"}})
def metrics(state: StateDep) -> Response:
    """Request counts and latencies by route, lookups by source, misses."""
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)
