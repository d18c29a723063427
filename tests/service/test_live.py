"""The service as deployed: a real uvicorn process on 127.0.0.1 (SQLite and PostgreSQL), and the
`autotuner serve` / `lookup` / `snapshot` commands."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import typer
from typer.testing import CliRunner

import autotuner.cli.service  # noqa: F401 - registers lookup, snapshot and serve on the app
from autotuner.cli.common import app as cli_app
from service.testing import (
    DEVICE,
    RING,
    WRITE_HEADERS,
    WRITE_TOKEN,
    free_port,
    live_server,
    measurements,
    problem,
    stop_server,
)


@pytest.mark.slow
def test_uvicorn_process(db_url):
    with live_server(db_url, env={"AUTOTUNER_WRITE_TOKENS": WRITE_TOKEN}) as url:
        with httpx.Client(base_url=url, trust_env=False, timeout=10) as h:
            assert h.get("/healthz").json()["status"] == "ok"
            body = {"device": DEVICE, "problem": problem()}
            assert h.post("/v1/lookup", json=body).json()["source"] == "default"
            results = {**body, "measurements": measurements()}
            assert h.post("/v1/results", json=results).status_code == 401
            assert h.post("/v1/results", json=results, headers=WRITE_HEADERS).status_code == 201
            tuned = h.post("/v1/lookup", json=body).json()
            assert tuned["source"] == "tuned" and tuned["strategy"] == RING
            batch = h.post("/v1/lookup/batch", json={"device": DEVICE, "problems": [problem(), problem(64, 64, 64)]})
            assert [r["source"] for r in batch.json()["results"]] == ["tuned", "default"]
            deadline = time.monotonic() + 10   # a read writes nothing: the misses arrive within 0.5 s
            while [d["count"] for d in h.get("/v1/demand").json()["items"]] != [1, 1] and time.monotonic() < deadline:
                time.sleep(0.1)
            demand = h.get("/v1/demand").json()["items"]  # the first lookup and the far one
            assert [d["count"] for d in demand] == [1, 1]
            job = h.post("/v1/jobs", json=body, headers=WRITE_HEADERS).json()
            claimed = h.post("/v1/jobs/claim", json={"worker": "w"}, headers=WRITE_HEADERS).json()["job"]
            assert claimed["id"] == job["id"]
            assert h.get("/v1/problems").json()["total"] == 1
            metrics = h.get("/metrics").text
            assert 'autotuner_lookups_total{source="tuned"} 2.0' in metrics
            assert h.post("/v1/lookup", content=b"x" * 2_000_000,
                          headers={"content-type": "application/json"}).status_code == 413


def _cli() -> typer.Typer:
    return cli_app


def test_lookup_and_snapshot_commands(sqlite_url, tmp_path):
    with live_server(sqlite_url, env={"AUTOTUNER_WRITE_TOKENS": WRITE_TOKEN}) as url:
        httpx.post(f"{url}/v1/results", headers=WRITE_HEADERS, trust_env=False,
                   json={"device": DEVICE, "problem": problem(), "measurements": measurements()})
        runner = CliRunner()
        problems = tmp_path / "problems.jsonl"
        problems.write_text(json.dumps(problem()) + "\n" + json.dumps(problem(64, 64, 64)) + "\n")
        res = runner.invoke(_cli(), ["lookup", "--service", url, "--problems", str(problems),
                                     "--device", json.dumps(DEVICE)])
        assert res.exit_code == 0, res.output
        rows = [json.loads(line) for line in res.stdout.splitlines()]
        assert [(r["source"], r["strategy_key"]) for r in rows] == [
            ("tuned", "ring-uni-c1-ufull-loop-send"), ("default", "baseline")]
        res = runner.invoke(_cli(), ["lookup", "--service", url, "--problems", json.dumps(problem()),
                                     "--device", json.dumps(DEVICE)])
        assert res.exit_code == 0 and json.loads(res.stdout)["origin"] == "service"

        snap = tmp_path / "snapshot.json"
        device_file = tmp_path / "device.json"
        device_file.write_text(json.dumps(DEVICE))
        res = runner.invoke(_cli(), ["snapshot", "--service", url, "--device", str(device_file),
                                     "--out", str(snap)])
        assert res.exit_code == 0, res.output
        assert len(json.loads(snap.read_text())["entries"]) == 1
    res = runner.invoke(_cli(), ["lookup", "--snapshot", str(snap), "--problems", json.dumps(problem()),
                                 "--device", json.dumps(DEVICE)])
    assert res.exit_code == 0 and json.loads(res.stdout)["origin"] == "snapshot"
    # a snapshot that cannot be read is the command's error, not a default answer per problem
    # (the client, made for a training job, only warns)
    for bad in (tmp_path / "missing.json", problems):
        res = runner.invoke(_cli(), ["lookup", "--snapshot", str(bad), "--problems", json.dumps(problem()),
                                     "--device", json.dumps(DEVICE)])
        assert res.exit_code == 2 and "--snapshot" in res.output and '"problem"' not in res.output, res.output
    res = runner.invoke(_cli(), ["lookup", "--problem", "{bad", "--service", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "invalid JSON" in res.output
    res = runner.invoke(_cli(), ["lookup", "--problem", json.dumps(problem()), "--device", json.dumps(DEVICE),
                                 "--service", f"http://127.0.0.1:{free_port()}", "--timeout", "0.5"])
    assert res.exit_code == 1 and json.loads(res.stdout.splitlines()[0])["origin"] == "fallback"


@pytest.mark.slow
def test_serve_command(tmp_path):
    port = free_port()
    db = tmp_path / "served.db"  # a new SQLite file is created (migrated) by serve
    code = "from autotuner.cli import main; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port", str(port), "--db", str(db),
                             "--workers", "2", "--log-level", "warning"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "autotuner serve exited"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1, trust_env=False)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "autotuner serve did not come up"
            time.sleep(0.2)
        assert r.json()["dialect"] == "sqlite" and db.exists()
        for _ in range(4):
            httpx.post(f"http://127.0.0.1:{port}/v1/lookup", json={"device": DEVICE, "problem": problem()},
                       trust_env=False)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
        # both workers' counts, aggregated (prometheus multiprocess mode)
        assert 'autotuner_lookups_total{source="default"} 4.0' in metrics
    finally:
        stop_server(proc)  # type: ignore[arg-type]
