"""`overlap(fn, client=..., tune="missing")`: tuning inside the job, against a real service
(uvicorn on 127.0.0.1) and an offline snapshot, on 4 in-process CPU devices; and a 2-process
`jax.distributed` job (gloo, one CPU device each) where process 0 plans and uploads and both
measure in lockstep (`JaxSync`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import autotuner.measure.session as session_mod
from autotuner import Device
from autotuner.examples import transformer as T
from autotuner.overlap import OverlapError, injob, overlap
from autotuner.runtime.client import Client
from autotuner.runtime.collective import DECISIONS, decisions
from autotuner.testing import TOLERANCE, relative_error
from db import Database
from service.testing import WRITE_TOKEN, live_server
from tests.autotuner import two_processes


def forward_program(seq: int = 16) -> tuple[Any, tuple[Any, Any]]:
    """The example transformer's forward (one layer, 4 devices): 4 pairs, 4 distinct problems."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    cfg = T.Config(layers=1, seq=seq)
    block = functools.partial(T.block, cfg=cfg, mesh=mesh)

    def forward(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        for p in params:
            x = block(p, x)
        return x

    return forward, T.example_args(cfg, mesh)


def assert_close(got: Any, want: Any) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert relative_error(a, b) <= TOLERANCE["float32"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("in-job") / "autotuner.db"
    database = Database(f"sqlite:///{path}")
    database.upgrade()
    with live_server(database.url, env={"AUTOTUNER_WRITE_TOKENS": WRITE_TOKEN}) as url:
        yield url
    database.dispose()


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Small sessions; the problems every run_session call measured, in order."""
    monkeypatch.setattr(injob, "REPS", 3)
    monkeypatch.setattr(injob, "MAX_CANDIDATES", 2)
    calls: list[str] = []
    real = session_mod.run_session

    def counting(runner: Any, problem: Any, strategies: Any, **kw: Any) -> Any:
        calls.append(problem.key)
        return real(runner, problem, strategies, **kw)

    monkeypatch.setattr(session_mod, "run_session", counting)
    DECISIONS.clear()
    yield calls
    DECISIONS.clear()


def test_first_job_measures_and_stores_the_next_job_measures_nothing(server, quick):
    forward, args = forward_program()
    want = jax.jit(forward)(*args)
    with Client(server, token=WRITE_TOKEN) as client:
        ov = overlap(forward, memory=None, client=client, tune="missing", tune_budget_s=600)
        plan = ov.plan(*args)
        keys = list(dict.fromkeys(r.key for r in plan))
        assert len(keys) == 4 and sorted(quick) == sorted(keys)   # each problem measured once
        assert all(r.source == "in-job" for r in plan), str(plan)
        assert all("measured in this job: 2 strategies and the baseline in" in r.note
                   and f"stored in the service {server}" in r.note for r in plan), str(plan)
        assert any("in-job tuning (tune='missing'): 4 problem(s) measured in" in n for n in plan.notes)
        for r in plan:   # applied exactly where the measured interval lies above 1
            d = decisions(client)[r.key]
            assert d.source == "tuned" and d.origin == "in-job"
            assert r.applied == (not d.strategy.is_baseline and d.confidence is not None and d.confidence[0] > 1.0)
        assert_close(ov(*args), want)
        device = client.device

    # the service holds a winner for every problem now
    for k in keys:
        r = httpx.post(f"{server}/v1/lookup", json={"device": device.to_dict(),
                                                    "problem": next(x.problem for x in plan if x.key == k).to_dict()},
                       trust_env=False)
        assert r.status_code == 200 and r.json()["source"] == "tuned", r.text
        stored = httpx.get(f"{server}/v1/problems/{k}", trust_env=False).json()["measurements"]
        assert stored and {m["source"] for m in stored} == {"in-job"}   # provenance: the job measured them

    # the next job: a fresh process state, a fresh client; nothing measured, the service's answers
    DECISIONS.clear()
    quick.clear()
    with Client(server) as fresh:
        ov2 = overlap(forward, memory=None, client=fresh, tune="missing", tune_budget_s=600)
        plan2 = ov2.plan(*args)
        assert quick == []
        assert all(r.source == "tuned" for r in plan2), str(plan2)
        for r in plan2:
            a = fresh.lookup(r.problem)
            ok = not a.strategy.is_baseline and a.confidence is not None and a.confidence[0] > 1.0
            assert r.strategy == (a.strategy if ok else r.strategy.baseline())
        assert any("0 problem(s) measured" in n for n in plan2.notes)
        assert_close(ov2(*args), want)


def test_budget_spent_after_the_first_problem_offline_snapshot(tmp_path, quick):
    forward, args = forward_program()
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps({"format": "autotuner-snapshot", "version": 1, "entries": []}))
    client = Client(offline=path, device=Device.current())
    ov = overlap(forward, memory=None, client=client, tune="missing", tune_budget_s=1e-3)
    plan = ov.plan(*args)
    assert len(quick) == 1
    first = [r for r in plan if r.key == quick[0]]
    rest = [r for r in plan if r.key != quick[0]]
    assert first and all(r.source == "in-job" and f"stored in the snapshot {path}" in r.note for r in first)
    assert len(rest) == 3 and all(r.source == "default" and r.strategy.is_baseline for r in rest)
    assert all("not tuned in this job: the in-job tuning budget (0.001 s) was spent" in r.note for r in rest)
    assert any("1 problem(s) measured" in n and "3 left untuned (budget spent)" in n for n in plan.notes)
    entries = json.loads(path.read_text())["entries"]
    assert [e["problem_key"] for e in entries] == [quick[0]]
    # a new offline client reads the measured winner back from the file: nothing to measure for it
    DECISIONS.clear()
    assert Client(offline=path, device=Device.current()).lookup(first[0].problem).source == "tuned"
    assert_close(ov(*args), jax.jit(forward)(*args))


def test_without_a_token_measured_and_applied_here_stored_nowhere(server, tmp_path, quick):
    """A client that may read but not write: the results hold in this process only."""
    forward, args = forward_program(seq=8)   # shapes the service has not seen
    with Client(server) as client:
        plan = overlap(forward, memory=None, client=client, tune="missing", tune_budget_s=600).plan(*args)
        assert len(quick) == 4 and all(r.source == "in-job" for r in plan)
        assert all("stored in nowhere (the client has no write token)" in r.note for r in plan), str(plan)
        # the client answers the measured winners from now on, in this process only
        assert all(client.lookup(r.problem).source == "tuned" for r in plan)
    with Client(server) as other:
        assert all(other.lookup(r.problem).source != "tuned" for r in plan)


@pytest.mark.parametrize("kw, match", [({"tune": "sometimes"}, "tune must be None or 'missing'"),
                                       ({"tune": "missing", "tune_budget_s": 0}, "tune_budget_s"),
                                       ({"tune": "missing", "tune_budget_s": float("nan")}, "tune_budget_s"),
                                       ({"tune": "missing", "strategy": "baseline"}, "strategy='auto'")])
def test_bad_tune_arguments(kw, match):
    with pytest.raises(OverlapError, match=match):
        overlap(lambda x: x, **kw)


def test_default_measures_nothing(tmp_path, quick):
    forward, args = forward_program()
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps({"format": "autotuner-snapshot", "version": 1, "entries": []}))
    plan = overlap(forward, memory=None, client=Client(offline=path, device=Device.current())).plan(*args)
    assert quick == [] and all(r.source == "default" for r in plan)
    assert not any("in-job" in n for n in plan.notes)
    assert np.asarray(json.loads(path.read_text())["entries"]).size == 0


def test_a_confident_measured_winner_is_applied(tmp_path, quick, monkeypatch):
    """The timing made to say the first candidate is 1.5x [1.3, 1.7] faster: it is applied (the
    never-slower rule passes it), and the program still equals plain jit."""
    forward, args = forward_program()
    real = session_mod.run_session

    def faster(*a: Any, **kw: Any) -> Any:
        s = real(*a, **kw)
        c = s.candidates[0]
        c.status, c.ratio, c.ratio_lo, c.ratio_hi = "ok", 1.5, 1.3, 1.7
        return s

    monkeypatch.setattr(session_mod, "run_session", faster)
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps({"format": "autotuner-snapshot", "version": 1, "entries": []}))
    ov = overlap(forward, memory=None, client=Client(offline=path, device=Device.current()), tune="missing",
                 tune_budget_s=600)
    plan = ov.plan(*args)
    assert all(r.source == "in-job" and r.applied and r.speedup == 1.5 for r in plan), str(plan)
    assert all("x1.500 [1.300, 1.700]" in r.note for r in plan)
    assert_close(ov(*args), jax.jit(forward)(*args))


WORKER = """
    url, out = sys.argv[3], sys.argv[4]
    from autotuner import Device
    from autotuner.overlap import injob, overlap
    from autotuner.runtime.client import Client
    injob.REPS, injob.MAX_CANDIDATES = 3, 2

    def f(x, y):
        x = jax.reshard(x, NamedSharding(mesh, P(None, None)))
        return jnp.einsum("ij,jk->ik", x, y, out_sharding=NamedSharding(mesh, P(None, None)))

    client = Client(url, token=sys.argv[5]) if url != "-" else None   # only process 0 has the service
    ov = overlap(f, memory=None, client=client, tune="missing", tune_budget_s=600)
    plan = ov.plan(a, b)
    result = np.asarray(ov(a, b).addressable_shards[0].data)
    with open(out, "w") as fh:
        json.dump({"rows": [[r.key, r.source, r.strategy.to_dict(), r.note] for r in plan], "notes": plan.notes,
                   "problem": plan[0].problem.to_dict(), "device": Device.current().to_dict(),
                   "error": float(np.abs(result - A @ B).max())}, fh)
    jax.distributed.shutdown()
"""



@pytest.mark.slow
def test_two_processes_measure_in_lockstep_and_agree(server, tmp_path):
    """A 2-process job (one device each, gloo): process 0 plans, both measure the same strategies
    in lockstep, only process 0 reaches the service and uploads; both apply the same answer."""
    two_processes.run(tmp_path, WORKER, lambda pid: [server if pid == 0 else "-", str(tmp_path / f"out{pid}.json"),
                                                     WRITE_TOKEN], timeout=300)
    r0, r1 = (json.loads((tmp_path / f"out{pid}.json").read_text()) for pid in (0, 1))
    assert len(r0["rows"]) == 1 and r0["rows"][0][1] == "in-job", r0
    assert [r[:3] for r in r0["rows"]] == [r[:3] for r in r1["rows"]]
    assert f"stored in the service {server}" in r0["rows"][0][3] and f"stored in the service {server}" in r1["rows"][0][3]
    assert r0["error"] < 1e-5 and r1["error"] < 1e-5
    assert any("1 problem(s) measured" in n for n in r1["notes"])
    # the service holds the winner now, for the job's device
    r = httpx.post(f"{server}/v1/lookup", json={"device": r0["device"], "problem": r0["problem"]}, trust_env=False)
    assert r.status_code == 200 and r.json()["source"] == "tuned", r.text
