"""Provenance and trust (issue 38 item 3): every measurement records who wrote it (source, the
stored token that uploaded it, the host) and its strength (repetitions, interval); a weaker source
never replaces a stronger winner without an interval that says it is better; an `in-job` token
uploads in-job measurements only and writes nothing else; the dashboard shows both."""

from __future__ import annotations

import re
from typing import Any

import pytest

from db import Database
from db import repository as repo
from service.testing import DEVICE, RING, WRITE_HEADERS, problem

IN_JOB_TOKEN = "in-job-token-of-a-training-job"
IN_JOB = {"Authorization": f"Bearer {IN_JOB_TOKEN}"}
RING_B = {**RING, "direction": "bidi"}


def items(ratio: float, lo: float, hi: float, n: int, strategy: dict[str, Any], **extra: Any) -> list[dict[str, Any]]:
    """A baseline and `strategy` at `ratio` [lo, hi] over `n` repetitions, as uploaded."""
    base = 1e-3
    return [{"strategy": {"method": "baseline"}, "status": "ok", "samples": [base] * n, "median_s": base, "n": n,
             "host": "trainer-7", **extra},
            {"strategy": strategy, "status": "ok", "samples": [base / ratio] * n, "median_s": base / ratio, "n": n,
             "ratio": ratio, "ratio_lo": lo, "ratio_hi": hi, "host": "trainer-7", **extra}]


@pytest.fixture
def in_job_token(db_url: str) -> int:
    with Database(db_url) as database, database.session() as s:
        return repo.add_token(s, "job-42", IN_JOB_TOKEN, "in-job").id


def upload(client: Any, headers: dict[str, str], body_items: list[dict[str, Any]]) -> Any:
    return client.post("/v1/results", headers=headers, json={"device": DEVICE, "problem": problem(),
                                                               "measurements": body_items})


def test_a_3_repetition_in_job_result_does_not_replace_a_tuned_winner(client: Any, db_url: str,
                                                                      in_job_token: int) -> None:
    r = upload(client, WRITE_HEADERS, items(1.3, 1.25, 1.35, 15, RING))        # a tuning run, 15 reps
    assert r.status_code == 201, r.text
    assert r.json()["winner"]["strategy"] == RING
    # the training job's 3 repetitions look faster (1.6x) on the point, not by their interval
    r = upload(client, IN_JOB, items(1.6, 1.1, 2.1, 3, RING_B))
    assert r.status_code == 201, r.text
    assert r.json()["winner"]["strategy"] == RING and r.json()["winner"]["speedup"] == pytest.approx(1.3)
    looked = client.post("/v1/lookup", json={"device": DEVICE, "problem": problem()}).json()
    assert looked["strategy"] == RING and looked["source"] == "tuned"

    # what each measurement records: source, token, host, strength
    with Database(db_url) as database, database.session(read_only=True) as s:
        prob = repo.get_problem_by_key(s, r.json()["problem_key"])
        ms = repo.list_measurements(s, prob.id)
    assert [(m.source, m.token_id, m.host, m.n) for m in ms] == [
        ("tuned", None, "trainer-7", 15), ("tuned", None, "trainer-7", 15),          # a settings token
        ("in-job", in_job_token, "trainer-7", 3), ("in-job", in_job_token, "trainer-7", 3)]

    # the dashboard shows both, each with its provenance, and the winner's
    page = client.get(f"/problems/{prob.id}").text
    rows = re.findall(r'<td class="source">(.*?)</td>', page, re.S)
    assert len(rows) == 4
    assert all(">tuned<" in row and "by token" not in row for row in rows[:2])
    assert all(">in-job<" in row and "by token job-42" in row and "on trainer-7" in row for row in rows[2:])
    assert re.search(r"Measured by <span[^>]*>tuned</span> on trainer-7, 15 repetitions", page)


def test_weaker_evidence_wins_where_its_interval_says_it_is_better(client: Any, in_job_token: int) -> None:
    assert upload(client, WRITE_HEADERS, items(1.3, 1.25, 1.35, 15, RING)).status_code == 201
    r = upload(client, IN_JOB, items(1.6, 1.4, 1.8, 3, RING_B))   # lower end above the tuned one's upper
    assert r.status_code == 201 and r.json()["winner"]["strategy"] == RING_B


def test_an_in_job_run_neither_replaces_nor_fails_what_a_tuning_run_measured(client: Any, in_job_token: int) -> None:
    assert upload(client, WRITE_HEADERS, items(1.3, 1.25, 1.35, 15, RING)).status_code == 201
    failed = [items(1.0, 1.0, 1.0, 3, RING)[0],
              {"strategy": RING, "status": "failed", "reason": "out of memory in the job"}]
    r = upload(client, IN_JOB, failed)
    assert r.status_code == 201 and r.json()["winner"]["strategy"] == RING   # the tuned RING still counts


def test_an_in_job_token_uploads_in_job_measurements_only_and_writes_nothing_else(client: Any,
                                                                                  in_job_token: int) -> None:
    r = upload(client, IN_JOB, items(1.3, 1.25, 1.35, 3, RING, source="tuned"))
    assert r.status_code == 403 and "in-job measurements only" in r.json()["detail"]
    r = client.post("/v1/jobs", headers=IN_JOB, json={"device": DEVICE, "problem": problem()})
    assert r.status_code == 403 and "write token" in r.json()["detail"]
    assert client.post("/v1/lookup", headers=IN_JOB, json={"device": DEVICE, "problem": problem()}).status_code == 200
    # a write token may say either; an unknown source is refused before anything is stored
    assert upload(client, WRITE_HEADERS, items(1.3, 1.25, 1.35, 3, RING, source="in-job")).status_code == 201
    r = upload(client, WRITE_HEADERS, items(1.3, 1.25, 1.35, 3, RING, source="guess"))
    assert r.status_code == 422 and "source must be one of tuned, in-job" in r.text


def test_an_operator_makes_a_jobs_token_with_the_cli_and_its_uploads_record_it(make_client: Any, db_url: str) -> None:
    from typer.testing import CliRunner

    from autotuner.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["db", "token", "add", "job-7", "--db", db_url])
    assert r.exit_code == 0, r.output
    token = r.stdout.strip().splitlines()[0]
    client = make_client()
    got = upload(client, {"Authorization": f"Bearer {token}"}, items(1.2, 1.1, 1.3, 3, RING))
    assert got.status_code == 201, got.text
    listed = runner.invoke(app, ["db", "token", "list", "--db", db_url]).stdout
    (tid,) = [line.split("\t")[0] for line in listed.splitlines() if "\tjob-7\tin-job\tactive" in line]
    measured = client.get(f"/v1/problems/{got.json()['problem_key']}").json()["measurements"]
    assert {(m["source"], m["token_id"]) for m in measured} == {("in-job", int(tid))}
    assert runner.invoke(app, ["db", "token", "revoke", tid, "--db", db_url]).exit_code == 0
    assert upload(client, {"Authorization": f"Bearer {token}"}, items(1.2, 1.1, 1.3, 3, RING)).status_code == 401
    bad = runner.invoke(app, ["db", "token", "add", "x", "--scope", "admin", "--db", db_url])
    assert bad.exit_code == 2 and "scope must be one of" in bad.output
