"""One answer type, `autotuner.answer.Answer`, from the service to the plan: the service's lookup
JSON as the client reads it, the decision the pass takes from it and the plan row it becomes
carry the same Answer; the snapshot's entries convert to and from it in one place; the old
names (the client's LookupResult, collective's Decision) are gone."""

from __future__ import annotations

import dataclasses
import importlib
from datetime import UTC, datetime
from typing import Any

import httpx
import jax
import pytest
from jax.sharding import AxisType

from autotuner import Device, Problem, Strategy, snapshot
from autotuner.answer import Answer
from autotuner.examples import transformer as T
from autotuner.overlap import overlap
from autotuner.overlap.plan import PlanRow
from autotuner.runtime.client import Client
from autotuner.runtime.collective import DecisionTable, decisions
from autotuner.tune import store
from db import Database
from service.testing import live_server, measurements, problem

RING = Strategy("ring", "bidi", 2, "full", "loop", False)
ANSWER = Answer(RING, "tuned", 1.3, (1.25, 1.35), 7, datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), "p" * 32, "d" * 32,
                origin="service", trials=2, traffic_speedup=1.04)


@pytest.mark.parametrize(("module", "name"), [("autotuner.runtime.client", "LookupResult"),
                                              ("autotuner.runtime.answers", "LookupResult"),
                                              ("autotuner.runtime.collective", "Decision")])
def test_the_old_answer_types_are_gone(module, name):
    with pytest.raises(ImportError):
        exec(f"from {module} import {name}", {})  # noqa: S102 - the import statement itself
    assert not hasattr(importlib.import_module(module), name)


def test_an_answers_json_round_trips_and_names_the_wire_fields():
    from service.lookups import lookup_of
    from service.schemas import Lookup

    assert Answer.from_json(ANSWER.to_json(), "service") == ANSWER
    wire = lookup_of(ANSWER)
    fields = {f.name for f in dataclasses.fields(Answer)}
    # the fields and the derived overlap_speedup (traffic x overlap = speedup), not the origin
    assert set(Lookup.model_fields) == (fields - {"origin"}) | {"strategy_key", "overlap_speedup"}
    assert wire.strategy_key == RING.key
    assert Answer.from_json(wire.model_dump(mode="json"), "service") == ANSWER


def test_a_snapshot_entry_is_an_answer_in_one_conversion():
    entry = snapshot.entry_json(ANSWER)
    assert list(entry) == [f.name for f in dataclasses.fields(snapshot.Entry)]   # the file's fields
    back = snapshot.entry_answer(entry, "tuned")
    assert back == dataclasses.replace(ANSWER, record_id=0, origin="snapshot")


def test_a_decision_without_a_client_is_an_answer(monkeypatch):
    """No client configured: the baseline, decided without a lookup, an Answer of no device."""
    from autotuner.runtime import client as client_module

    monkeypatch.setattr(client_module, "default_client", lambda: None)
    p = Problem.from_dict(problem())
    table = DecisionTable()
    got = table.decide(p, None)
    assert isinstance(got, Answer) and got.origin == "unconfigured" and got.device_key == ""
    assert got.problem_key == p.key and got.strategy.is_baseline and got.source == "default"
    assert table.snapshot() == {p.key: got}


def test_a_plan_row_without_an_answer_still_builds():
    row = PlanRow("n", "w", "all-gather", None, Strategy.baseline(), "forced", None, 1)
    assert row.answer is None


def _items(ratio: float, strategy: Strategy) -> list[dict[str, Any]]:
    return [{**m, "strategy": Strategy.from_dict(m["strategy"]).to_dict(),
             "strategy_key": Strategy.from_dict(m["strategy"]).key}
            for m in measurements(ratio, strategy.to_dict())]


def test_one_answer_from_the_service_through_the_client_and_the_pass_to_the_plan(tmp_path):
    """A winner stored for the transformer's MLP up: the service's lookup JSON (parsed as the
    client parses it), the client's decision for the pass, and the plan row are one Answer."""
    mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    cfg = T.Config(layers=1)

    def forward(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        for p in params:
            x = T.block(p, x, cfg=cfg, mesh=mesh)
        return x

    args = T.example_args(cfg, mesh)
    up = next(r for r in overlap(forward, strategy="baseline").plan(*args) if r.name == "bsd,df->bsf")
    assert up.answer is None and up.source == "forced"
    device = Device.current()
    database = Database(f"sqlite:///{tmp_path / 'autotuner.db'}")
    database.upgrade()
    try:
        items = _items(1.3, RING)   # the ring timed beside its serial control: 1.3 = 1.04 x 1.25
        ring = next(m for m in items if m["strategy_key"] == RING.key)
        ring.update(serial_s=ring["median_s"] * 1.3 / 1.04, traffic_speedup=1.04)
        store.save(database, device, up.problem, items)
        with live_server(database.url) as url:
            with httpx.Client(trust_env=False) as http:
                body = http.post(f"{url}/v1/lookup",
                                 json={"device": device.to_dict(), "problem": up.problem.to_dict()}).json()
            wire = Answer.from_json(body, "service")
            with Client(url, cache_dir=tmp_path / "cache", device=device) as client:
                row = next(r for r in overlap(forward, memory=None, client=client).plan(*args)
                           if r.name == "bsd,df->bsf")
                decision = decisions(client)[up.key]
                in_memory = client.lookup(up.problem, device)      # asked again: the same, from memory
    finally:
        database.dispose()
    assert wire.source == "tuned" and wire.strategy == RING and wire.problem_key == up.key
    assert isinstance(decision, Answer) and decision == wire       # the client's origin: "service"
    assert row.answer == decision and row.strategy == RING and row.source == "tuned"
    assert row.speedup == decision.speedup == 1.3
    assert body["traffic_speedup"] == 1.04 and body["overlap_speedup"] == pytest.approx(1.25)
    assert row.split == (1.04, pytest.approx(1.25))   # the plan row says which mechanism won
    assert dataclasses.replace(in_memory, origin="service") == wire and in_memory.origin == "memory"


def test_a_plan_row_shows_its_winners_split_only_while_it_runs_that_winner():
    """`plan` (table and --json) says for each pair whether its winner won by moving less or by
    overlap: the split of the answer it follows; none where it runs something else."""
    import io

    from autotuner.cli.plan_cmd import print_plan
    from autotuner.overlap.plan import Plan
    from autotuner.program.factory import plan_rows

    follows = PlanRow("up", "w", "all-gather", None, RING, "tuned", 1.3, 1, answer=ANSWER)
    shed = follows.unapplied("the memory bound")   # the answer's ring, not run
    rows = plan_rows(Plan([follows, shed]))
    assert (rows[0]["traffic_speedup"], rows[0]["overlap_speedup"]) == (1.04, pytest.approx(1.25))
    assert rows[1]["traffic_speedup"] is None and rows[1]["overlap_speedup"] is None
    out = io.StringIO()
    print_plan(rows, [], out)
    head, first, second = out.getvalue().splitlines()[:3]
    assert "traffic x overlap" in head and "1.04 x 1.25" in first and "1.04" not in second
    assert "1.04 x 1.25" in str(Plan([follows]))
