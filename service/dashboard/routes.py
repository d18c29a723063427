"""The dashboard's routes: ``/`` (overview), ``/problems`` (table), ``/problems/{id}`` (one
problem), ``/models`` and ``/models/{id}`` (stored bench-model runs) and ``/static/{name}``
(plotly.js and our CSS/JS). Thin: each page reads through
:mod:`db.repository`, turns records into values (:mod:`.views`, :mod:`.figures`) and renders a
Jinja2 template (autoescaped).

Bad query parameters give a 400 page naming them, an unknown problem a 404 page; never a 500.
Pages need a read token only where the API's reads do (``AUTOTUNER_READ_TOKENS`` set).
Every HTML response carries a Content-Security-Policy that allows scripts, styles and requests
to this server only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from db import repository as repo
from service.dashboard import benches, figures, views
from service.dashboard.assets import CACHE_CONTROL
from service.dashboard.query import (
    PER_PAGE,
    BadParams,
    OverviewParams,
    TableParams,
    parse,
    parse_problem_ref,
)
from service.deps import ReadAuth, ReadSessionDep, StateDep

__all__ = ["router"]

router = APIRouter(tags=["dashboard"], include_in_schema=False)

CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}
SHAPE_POINTS = 2000
FAILURES = 50  # the newest failed problems the overview lists
BENCHES = 200  # the newest bench-model runs the models page lists
TABLE_SORTS = ("pattern", "speedup", "trials", "updated", "flops", "comm_bytes")  # the sortable
# columns of the table, each named as its sort key of repo.list_problems

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).resolve().parent / "templates"),
    autoescape=True,  # every template, whatever its name
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters.update(when=views.fmt_when, seconds=views.fmt_time, speedup=views.fmt_speedup,
                    nbytes=views.fmt_bytes, shapes=views.fmt_shapes, mesh=views.fmt_mesh,
                    device=views.device_label)
_env.filters.update(ms=benches.fmt_ms)
_env.globals.update(fmt_ci=views.fmt_ci, fmt_split=views.fmt_split, estimated_label=views.ESTIMATED_LABEL, fmt_ms_ci=benches.fmt_ms_ci, program_label=benches.program_label)


def _render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    base = request.scope.get("root_path", "").rstrip("/")
    version = request.app.state.autotuner.assets.version  # in the static files' URLs
    body = _env.get_template(template).render(base=base, path=request.url.path,
                                              asset_version=version, **context)
    return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)


def _error(request: Request, status: int, title: str,
           errors: list[tuple[str, str]] | None = None, message: str = "") -> HTMLResponse:
    return _render(request, "error.html", status=status, title=title, errors=errors or [],
                   message=message)


def _bad(request: Request, e: BadParams | ValueError) -> HTMLResponse:
    errors = e.errors if isinstance(e, BadParams) else [("query", str(e))]
    return _error(request, 400, "Bad request", errors)


@router.get("/", response_class=HTMLResponse)
def overview(request: Request, _: ReadAuth, state: StateDep, s: ReadSessionDep) -> HTMLResponse:
    """How many problems are tuned per device and pattern, the problems that failed to tune (with
    their errors), the speedups, the shape map, the lookups by source, open demand and the job
    queue."""
    try:
        params = parse(OverviewParams, request.query_params)
    except BadParams as e:
        return _bad(request, e)
    devices = repo.list_devices(s)
    tuned = views.tuned_by_device(repo.tuned_counts(s))
    bins = repo.speedup_histogram(s, device_key=params.device)
    sample = repo.shape_sample(s, limit=SHAPE_POINTS, device_key=params.device)
    demand = repo.list_demand(s, 20, untuned_only=True)
    jobs = {status: repo.list_jobs(s, status=status, limit=20).items
            for status in ("running", "queued")}
    job_counts = repo.job_counts(s)
    failures = repo.list_failures(s, device_key=params.device, limit=FAILURES)
    shares = views.lookup_shares(state.metrics.registry)
    return _render(
        request, "overview.html", params=params, devices=devices, tuned=tuned,
        total_tuned=sum(t.problems for t in tuned), total_decomposed=sum(t.decomposed for t in tuned),
        hist=figures.embed(figures.speedup_histogram(bins)) if bins else None,
        shape=figures.embed(figures.shape_map(sample)) if sample.points else None, sample=sample,
        shares=shares, lookups_total=sum(shares.values()),
        lookups=figures.embed(figures.lookup_figure(shares)) if sum(shares.values()) else None,
        demand=views.demand_summary(demand), jobs={k: views.job_summary(v) for k, v in jobs.items()},
        job_counts=job_counts, failures=failures, device_by_key={d.key: d for d in devices},
    )


@router.get("/problems", response_class=HTMLResponse)
def problems(request: Request, _: ReadAuth, s: ReadSessionDep) -> HTMLResponse:
    """The tuned problems, filtered, sorted and paginated in the database (plain links and a
    GET form: works without JavaScript)."""
    try:
        params = parse(TableParams, request.query_params)
        page = repo.list_problems(
            s, device_key=params.device, pattern=params.pattern, dtype=params.dtype,
            method=params.method, search=params.q, tuned_only=True, sort=params.sort,
            desc=params.order == "desc", offset=params.offset, limit=params.per_page)
    except (BadParams, ValueError) as e:
        return _bad(request, e)
    last = params.last_page(page.total)
    sort_links = {}
    for key in TABLE_SORTS:
        order = "asc" if params.sort == key and params.order == "desc" else "desc"
        sort_links[key] = params.query(sort=key, order=order, page=1)
    window = range(max(1, params.page - 3), min(last, params.page + 3) + 1)
    return _render(
        request, "problems.html", params=params, page=page, last_page=last,
        devices=repo.list_devices(s), facets=repo.problem_facets(s), per_page_choices=PER_PAGE,
        sort_links=sort_links, sort_keys=repo.SORT_KEYS,
        page_links=[(n, params.query(page=n)) for n in window],
        first_url=params.query(page=1), last_url=params.query(page=last),
        prev_url=params.query(page=params.page - 1) if params.page > 1 else None,
        next_url=params.query(page=params.page + 1) if params.page < last else None,
    )


@router.get("/problems/{ref}", response_class=HTMLResponse)
def problem(request: Request, ref: str, _: ReadAuth, s: ReadSessionDep) -> HTMLResponse:
    """One problem: every measured strategy per device (median and IQR, baseline and winner
    marked), the trial history, failures with their reasons, and the Problem JSON."""
    parsed = parse_problem_ref(ref)
    record = None
    if parsed is not None and parsed.id is not None:
        record = repo.get_problem(s, parsed.id)
    elif parsed is not None and parsed.key is not None:
        record = repo.get_problem_by_key(s, parsed.key)
    if record is None:
        return _error(request, 404, "No such problem",
                      message=f"There is no problem {ref!r} in this database.")
    devices = {d.id: d for d in repo.list_devices(s)}
    groups = views.measurement_groups(repo.list_measurements(s, record.id),
                                      repo.problem_winners(s, record.id), devices)
    plots = []
    for g in groups:
        winner_key = g.winner.strategy_key if g.winner else None
        plots.append({
            "group": g,
            "strategies": figures.embed(figures.strategy_figure(g.measurements, winner_key,
                                                                g.bound_s))
            if any(m.status == "ok" for m in g.measurements) else None,
            "history": figures.embed(figures.trial_history(g.measurements))
            if g.measurements else None,
        })
    failures = [f for f in repo.list_failures(s, limit=1000) if f.problem_key == record.key]
    writers = {t.id: t.name for t in repo.list_tokens(s)}   # who uploaded a measurement (provenance)
    return _render(request, "problem.html", problem=record, plots=plots, failures=failures, writers=writers,
                   device_by_key={d.key: d for d in devices.values()}, problem_json=views.problem_json(record))


@router.get("/models", response_class=HTMLResponse)
def models(request: Request, _: ReadAuth, s: ReadSessionDep) -> HTMLResponse:
    """Stored ``autotuner bench-model --db`` runs, newest first: program, target, device, plain
    and overlapped step times, the speedup with its interval, and a flag on any run whose
    overlapped step is slower than plain beyond the interval."""
    runs = repo.list_model_benches(s, limit=BENCHES)
    return _render(request, "models.html", runs=runs,
                   device_by_key={d.key: d for d in repo.list_devices(s)})


@router.get("/models/{ref}", response_class=HTMLResponse)
def model(request: Request, ref: str, _: ReadAuth, s: ReadSessionDep) -> HTMLResponse:
    """One bench-model run: its figures (plain vs overlapped per step with 95% whiskers; each
    pair alone), the per-pair breakdown, the collectives' share and the savings."""
    run = repo.get_model_bench(s, int(ref)) if ref.isdigit() and len(ref) < 12 else None
    if run is None:
        return _error(request, 404, "No such benchmark run",
                      message=f"There is no bench-model run {ref!r} in this database.")
    device = repo.get_device_by_key(s, run.device_key)
    pairs = benches.pair_figure(run)
    return _render(request, "model.html", run=run, device=device, pairs=benches.pair_rows(run),
                   attribution=benches.attribution_rows(run), attribution_sums=benches.attribution_sums(run),
                   step_fig=figures.embed(benches.bench_figure(run)),
                   pair_fig=figures.embed(pairs) if pairs is not None else None,
                   kwargs_json=json.dumps(run.kwargs, sort_keys=True),
                   mesh_json=json.dumps(run.mesh))


@router.get("/static/{name}")
def static(request: Request, name: str, state: StateDep) -> Response:
    """plotly.min.js (from the installed plotly package), dashboard.js, dashboard.css."""
    found = state.assets.get(name)
    if found is None:
        return Response("not found\n", status_code=404, media_type="text/plain")
    headers = {"ETag": found.etag, "Cache-Control": CACHE_CONTROL, "Vary": "Accept-Encoding",
               "X-Content-Type-Options": "nosniff"}
    if found.etag in {t.strip() for t in request.headers.get("if-none-match", "").split(",")}:
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(found.gzipped, media_type=found.media_type,
                        headers={**headers, "Content-Encoding": "gzip"})
    return Response(found.body, media_type=found.media_type, headers=headers)
