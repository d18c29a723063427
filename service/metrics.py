"""Prometheus metrics: requests and latencies by route, lookups by source, misses, anonymous
lookups refused (:mod:`service.ratelimit`).

Each app has its own registry (several apps can live in one test process). Under several
uvicorn workers set ``PROMETHEUS_MULTIPROC_DIR`` (``autotuner serve --workers N`` does) so that
``/metrics`` aggregates every worker (prometheus-client's multiprocess mode).
"""

from __future__ import annotations

import os
import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from autotuner.rule import EXACT_SOURCES

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # others: "other"
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("autotuner_http_requests_total", "HTTP requests by route and status",
                                ("method", "route", "status"), registry=self.registry)
        self.latency = Histogram("autotuner_http_request_duration_seconds",
                                 "HTTP request latency by route", ("method", "route"),
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.lookups = Counter("autotuner_lookups_total", "Lookups answered, by source",
                               ("source",), registry=self.registry)
        self.misses = Counter("autotuner_lookup_misses_total",
                              "Lookups without a tuned record (counted as demand)",
                              registry=self.registry)
        self.limited = Counter("autotuner_lookups_limited_total",
                               "Lookups without a token refused with 429, by limit (rate, concurrency)",
                               ("limit",), registry=self.registry)
        self.batch_size = Histogram("autotuner_lookup_batch_size", "Problems per batch lookup",
                                    buckets=(1, 10, 50, 100, 250, 500, 1000), registry=self.registry)
        # label children, resolved once per (method, route[, status])
        self._children: dict[tuple[str, ...], Any] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, str(status))
        pair = self._children.get(key)
        if pair is None:
            pair = (self.requests.labels(*key), self.latency.labels(method, route))
            self._children[key] = pair
        pair[0].inc()
        pair[1].observe(seconds)

    def count_lookups(self, sources: dict[str, int]) -> None:
        for source, n in sources.items():
            self.lookups.labels(source).inc(n)
            if source not in EXACT_SOURCES:
                self.misses.inc(n)

    def render(self) -> tuple[bytes, str]:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI middleware (no per-request task or body buffering): counts and times every
    HTTP request under its route template (``/v1/jobs/{job_id}``), ``unmatched`` otherwise."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in METHODS else "other"  # bounded labels
            self.metrics.observe(method, path, status, time.perf_counter() - start)
