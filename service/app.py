"""The FastAPI app: ``create_app(settings)``, and ``app`` for ``uvicorn service.app:app``.

``app`` is built on first access from the environment (``AUTOTUNER_*``, see
``autotuner.settings.Settings``), so importing this module has no side effects. On startup the app
checks that the database is at the expected schema revision (``autotuner db upgrade`` fixes
it), warms up what lookups import, and starts the demand writer and the watcher of changed
winners (:mod:`service.coherence`); on shutdown it stops the watcher, writes the remaining
misses and closes the engine.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from autotuner.settings import Settings, get_settings
from db import Database, StorageError
from service import errors
from service.coherence import ChangeWatcher
from service.costmodel_hook import ModelFn
from service.deps import ServiceState
from service.fastpath import LookupFastPath
from service.field_types import ParseMemo, ParseMemoMiddleware
from service.limits import BodyLimitMiddleware
from service.lookups import DemandRecorder, LookupEngine
from service.metrics import Metrics, MetricsMiddleware
from service.ratelimit import AnonymousLookupLimit
from service.routes import ROUTERS
from service.routes.health import VERSION

log = logging.getLogger("service")

DESCRIPTION = """\
Serves, per sharded einsum and per device, the fastest way to overlap its collective with the
einsum (measured by the overlap autotuner), to compilers and training jobs.

Writes need `Authorization: Bearer TOKEN` (a write token); reads are open unless read tokens
are configured.
"""


def _warm_up() -> None:
    # Nearest-shape answers check the neighbour's strategy with autotuner.decompose, which
    # imports JAX: do it once at startup, not in the first request that needs it.
    import autotuner.decompose  # noqa: F401


class ServiceApp(FastAPI):
    """The FastAPI app, whose lookups go through :class:`service.ratelimit.AnonymousLookupLimit`
    and then :class:`service.fastpath.LookupFastPath` first (in front of every middleware; what
    the fast path does not answer, FastAPI does)."""

    fast_path: LookupFastPath | None = None
    anonymous_limit: AnonymousLookupLimit | None = None  # in front of the fast path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        front = self.anonymous_limit or self.fast_path
        if front is not None:
            await front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None, *, database: Database | None = None,
               model: ModelFn | None = None, check_schema: bool = True, serving: bool = False) -> FastAPI:
    """The service for ``settings`` (default: from the environment).

    ``database`` defaults to ``Database(settings.db_url)`` (closed on shutdown only if created
    here). ``model`` is the cost-model hook (see :mod:`service.costmodel_hook`); by default the
    calibrated cost model of :mod:`autotuner.costmodel`, which answers for devices that have a
    calibration in the database (``autotuner calibrate``) and stays silent for the others. ``check_schema``:
    refuse to start on a database that is not at the head revision. ``serving``: this app is the
    process's (``service.app:app``), which freezes the heap startup built (see the lifespan).
    """
    settings = settings or get_settings()
    own_db = database is None
    db = database if database is not None else Database(settings.db_url)
    metrics = Metrics()
    parse_memo = ParseMemo(settings.parse_memo_entries, settings.parse_memo_bytes)
    if model is None:
        from autotuner.costmodel import model_answer  # pure Python: no JAX at import

        model = model_answer(db)
    demand = DemandRecorder(db, max_rows=settings.demand_max_rows,
                            max_pending=settings.demand_max_pending)
    lookups = LookupEngine(db, metrics, cache_seconds=settings.lookup_cache_seconds,
                           nearest_max_distance=settings.nearest_max_distance, model=model,
                           model_budget_seconds=settings.model_budget_seconds, demand=demand,
                           parse_memo=parse_memo, cache_entries=settings.lookup_cache_entries,
                           cache_bytes=settings.lookup_cache_bytes,
                           nearest_max_groups=settings.nearest_max_groups,
                           nearest_max_bytes=settings.nearest_max_bytes)
    watcher = ChangeWatcher(db, lookups.invalidate, interval=settings.lookup_poll_seconds)
    from service import dashboard  # the HTML pages at / (not in the OpenAPI schema)

    state = ServiceState(settings=settings, database=db, lookups=lookups, metrics=metrics,
                         parse_memo=parse_memo, assets=dashboard.Assets(), watcher=watcher)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if check_schema:
            try:
                await run_in_threadpool(db.check_schema)
            except BaseException:
                if own_db:   # a refused start keeps no connection open
                    db.dispose()
                raise
        await run_in_threadpool(_warm_up)
        lookups.demand.start()
        await run_in_threadpool(watcher.start)
        try:
            await run_in_threadpool(lookups.nearest.preload)  # read in the background
        except StorageError as e:  # e.g. not migrated (check_schema=False): read when asked
            log.warning("nearest-shape index not preloaded: %s", e)
        if serving:
            # What startup built (JAX's modules, the app, the index) lives as long as the
            # process: out of the garbage collector's full collections, which otherwise
            # traverse it every time, 100-400 ms pauses that are the lookups' p99
            # (bench/load.py). Only the process uvicorn serves: a test process builds many apps.
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            await run_in_threadpool(watcher.close)
            await run_in_threadpool(lookups.nearest.close)
            await run_in_threadpool(lookups.demand.close)
            if own_db:
                db.dispose()

    app = ServiceApp(title="overlap-autotuner", version=VERSION, description=DESCRIPTION,
                  lifespan=lifespan)
    app.state.autotuner = state
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(dashboard.router)
    app.add_middleware(errors.InternalErrorMiddleware)  # innermost: a bug is that request's 500
    app.add_middleware(ParseMemoMiddleware, memo=parse_memo)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts the 413s too
    app.fast_path = LookupFastPath(super(ServiceApp, app).__call__, state)
    app.anonymous_limit = AnonymousLookupLimit(app.fast_path, state)
    return app


_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    if name == "app":  # built lazily, once: `uvicorn service.app:app`
        global _app
        if _app is None:
            _app = create_app(serving=True)
        return _app
    raise AttributeError(f"module 'service.app' has no attribute {name!r}")
