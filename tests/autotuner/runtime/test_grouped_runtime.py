"""`collective_einsums` (one gathered operand feeding k einsums) inside `jax.jit`: the winner of the
group, stored and served by a real service, is what runs; every forced strategy of the group's
space gives the k plain einsums; the service answers a grouped lookup (and a nearest one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from autotuner import Device, GroupedProblem, Strategy, space
from autotuner.runtime.client import Client
from autotuner.tune import store
from db import Database
from service.testing import live_server, measurements

DEVICE = Device(platform="cpu", device_kind="cpu", num_devices=8, num_processes=1, topology="grouped-test",
                jax_version="0.10.2", jaxlib_version="0.10.2")
EQS = ["sd,df->sf", "sd,dhk->shk", "sd,de->se"]
BIDI = {"method": "ring", "direction": "bidi", "chunks": 2, "unroll": 1, "fuse": "after", "send_first": False}


def _inputs() -> tuple[Any, Any, list[Any], list[Any], list[np.ndarray]]:
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((32, 16)).astype(np.float32)
    w_np = [rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (16, 4, 6), (16, 12))]
    x = jax.device_put(x_np, NamedSharding(mesh, P("x", None)))
    specs = [P(None, "x"), P(None, "x", None), P(None, None)]
    ws = [jax.device_put(w, NamedSharding(mesh, s)) for w, s in zip(w_np, specs, strict=True)]
    outs = [P(None, "x"), P(None, "x", None), P(None, None)]
    want = [np.einsum(eq, x_np, w) for eq, w in zip(EQS, w_np, strict=True)]
    return mesh, x, ws, outs, want


def _group(mesh: Any, x: Any, ws: list[Any], outs: list[Any]) -> GroupedProblem:
    from autotuner.runtime.grouped_collective import grouped_problem_for

    return grouped_problem_for(EQS, x, ws, mesh=mesh, out_specs=outs)


@pytest.fixture
def fresh_decisions() -> Iterator[None]:
    from autotuner.runtime import collective

    collective.DECISIONS.clear()
    yield
    collective.DECISIONS.clear()


def test_every_forced_strategy_gives_the_plain_einsums(fresh_decisions) -> None:
    import jax

    from autotuner.runtime.grouped_collective import collective_einsums

    mesh, x, ws, outs, want = _inputs()
    gp = _group(mesh, x, ws, outs)
    strategies = space(gp)
    assert {s.direction for s in strategies[1:]} == {"uni", "bidi"}
    f = jax.jit(lambda x, *ws: [collective_einsums(EQS, x, ws, mesh=mesh, out_specs=outs, strategy=s)
                                for s in strategies])
    for s, got in zip(strategies, f(x, *ws), strict=True):
        assert len(got) == 3
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=s.key)


def test_the_served_winner_runs_and_a_grouped_lookup_is_answered(tmp_path, fresh_decisions) -> None:
    import jax

    from autotuner.runtime.collective import decisions
    from autotuner.runtime.grouped_collective import collective_einsums

    mesh, x, ws, outs, want = _inputs()
    gp = _group(mesh, x, ws, outs)
    database = Database(f"sqlite:///{tmp_path / 'g.db'}")
    database.upgrade()
    items = []
    for m in measurements(1.3, BIDI):
        s = Strategy.from_dict(m["strategy"])
        items.append({**m, "strategy": s.to_dict(), "strategy_key": s.key})
    store.save(database, DEVICE, gp, items)
    with live_server(database.url) as url, Client(url, device=DEVICE) as client:
        got = jax.jit(lambda x, *ws: collective_einsums(EQS, x, ws, mesh=mesh, out_specs=outs,
                                                        client=client))(x, *ws)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)
        (d,) = decisions(client).values()
        assert d.problem_key == gp.key and d.source == "tuned" and d.strategy == Strategy.from_dict(BIDI)
        # the same group, its einsums in another order: the same key, the same answer
        swapped = {"einsums": list(reversed(gp.to_dict()["einsums"]))}
        r = httpx.post(f"{url}/v1/lookup", json={"device": DEVICE.to_dict(), "problem": swapped})
        assert r.status_code == 200 and r.json()["source"] == "tuned" and r.json()["problem_key"] == gp.key
        # a grouped problem's invalid member is a 422 naming the field
        bad = {"einsums": [swapped["einsums"][0], {**swapped["einsums"][1], "dtype": "bfloat16"}]}
        r = httpx.post(f"{url}/v1/lookup", json={"device": DEVICE.to_dict(), "problem": bad})
        assert r.status_code == 422 and "einsums[1].dtype" in r.text
    database.dispose()
