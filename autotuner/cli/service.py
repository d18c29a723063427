"""The service's commands of the `autotuner` CLI: `serve`, `lookup` and `snapshot`."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from autotuner.cli.common import DB_HELP, SERVICE_TOKEN_ENV, TOKEN_FILE_HELP, app, fail, token_of


def _json_or_file(text: str, what: str) -> Any:
    """Parse ``text`` as JSON if it looks like JSON, else read the file it names."""
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            return json.loads(stripped)
        except ValueError as e:
            fail(f"--{what}: invalid JSON: {e}")
    path = Path(text)
    if not path.is_file():
        fail(f"--{what}: {text!r} is neither JSON nor an existing file")
    return None


def _problems(text: str) -> list[Any]:
    from autotuner.problem import ProblemError, problem_from_dict
    from autotuner.problem.problems_file import ProblemsFileError, load_problems

    doc = _json_or_file(text, "problem")
    try:
        if doc is None:
            return list(load_problems(text))
        items = doc if isinstance(doc, list) else [doc]
        return [problem_from_dict(d) for d in items]
    except (ProblemError, ProblemsFileError) as e:
        fail(f"--problem: {e}")
        raise AssertionError from e


def _device(text: str | None, topology: str | None) -> Any:
    from autotuner.device import Device, DeviceError

    if text is None:
        return Device.current(topology)
    doc = _json_or_file(text, "device")
    if doc is None:
        try:
            doc = json.loads(Path(text).read_text())
        except ValueError as e:
            fail(f"--device: {text}: invalid JSON: {e}")
    try:
        return Device.from_dict(doc)
    except DeviceError as e:
        fail(f"--device: {e}")


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    db: Annotated[str | None, typer.Option("--db", help=DB_HELP)] = None,
    workers: Annotated[int, typer.Option(min=1, max=64, help="uvicorn worker processes")] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    access_log: Annotated[bool, typer.Option(help="log every request")] = False,
) -> None:
    """Run the REST service (uvicorn on service.app:app)."""
    import uvicorn

    from autotuner.cli.common import open_database
    from autotuner.settings import get_settings, normalize_db_url

    url = normalize_db_url(db) if db else get_settings().db_url
    open_database(url).dispose()  # a new SQLite file is created; anything else must be migrated
    os.environ["AUTOTUNER_DB_URL"] = url  # the workers build the app from the environment
    get_settings.cache_clear()
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="autotuner-metrics-")
    uvicorn.run("service.app:app", host=host, port=port, workers=workers, log_level=log_level,
                access_log=access_log)

@app.command()
def lookup(
    ctx: typer.Context,
    problem: Annotated[str, typer.Option("--problems", "--problem", help="a Problem as JSON (object or list), or "
                                         "a JSON/JSONL/YAML file of Problems (as tune --problems)")],
    service: Annotated[str | None, typer.Option(help="service URL (default AUTOTUNER_SERVICE_URL)")] = None,
    device: Annotated[str | None, typer.Option(help="device fingerprint as JSON or a file (default: "
                                               "this host's devices)")] = None,
    topology: Annotated[str | None, typer.Option(help="topology label of this host's devices")] = None,
    token: Annotated[str | None, typer.Option(envvar=SERVICE_TOKEN_ENV,
                                              help="bearer token, if the service closes reads")] = None,
    token_file: Annotated[Path | None, typer.Option(help=TOKEN_FILE_HELP)] = None,
    snapshot: Annotated[str | None, typer.Option(help="answer offline from this snapshot file")] = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="seconds per request")] = 5.0,
) -> None:
    """Ask which strategy to use; one JSON object per problem on stdout."""
    from autotuner.runtime.client import Client
    from autotuner.settings import get_settings

    settings = get_settings()
    url = service or settings.service_url
    if url is None and snapshot is None:
        fail("give --service URL (or set AUTOTUNER_SERVICE_URL), or --snapshot FILE")
    problems = _problems(problem)
    if snapshot is not None:   # the client, made for a training job, warns and answers defaults
        from autotuner.snapshot import SnapshotError, load

        try:
            load(snapshot)
        except SnapshotError as e:
            fail(f"--snapshot {snapshot}: {e}")
    dev = _device(device, topology)
    secret = token_of(ctx, token, token_file) or settings.service_token
    client = Client(url, token=secret, timeout=timeout, offline=snapshot, retry_after=0.0)
    with client:
        results = client.lookup_batch(problems, dev)
    for p, r in zip(problems, results, strict=True):
        row = {"problem": p.to_dict(), **r.to_json(), "strategy_key": r.strategy.key, "origin": r.origin}
        sys.stdout.write(json.dumps(row) + "\n")
    if any(r.origin == "fallback" for r in results) and snapshot is None:
        fail("the service could not answer (see the warning above); printed the baseline", 1)

@app.command()
def snapshot(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", help="file to write")],
    service: Annotated[str | None, typer.Option(help="service URL (default AUTOTUNER_SERVICE_URL)")] = None,
    device: Annotated[str | None, typer.Option(help="device fingerprint as JSON or a file (default: "
                                               "this host's devices)")] = None,
    topology: Annotated[str | None, typer.Option(help="topology label of this host's devices")] = None,
    all_devices: Annotated[bool, typer.Option("--all", help="every device, not one")] = False,
    token: Annotated[str | None, typer.Option(envvar=SERVICE_TOKEN_ENV,
                                              help="bearer token, if the service closes reads")] = None,
    token_file: Annotated[Path | None, typer.Option(help=TOKEN_FILE_HELP)] = None,
) -> None:
    """Export the service's winners to a file for `Client(offline=FILE)`."""
    from autotuner.runtime.client import Client, ClientError
    from autotuner.settings import get_settings

    settings = get_settings()
    url = service or settings.service_url
    if url is None:
        fail("give --service URL (or set AUTOTUNER_SERVICE_URL)")
    secret = token_of(ctx, token, token_file) or settings.service_token
    dev = None if all_devices else _device(device, topology)
    with Client(url, token=secret) as client:
        try:
            n = client.export_snapshot(out, dev, all_devices=all_devices)
        except ClientError as e:
            fail(str(e))
    sys.stderr.write(f"wrote {n} winners to {out}\n")
