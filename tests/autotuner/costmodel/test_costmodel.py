"""The cost model: its structure, the calibration fit, the database round trip, the tuner's
order, and the XLA-native candidates (left out on CPU, where XLA ignores their options)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import autotuner
from autotuner import Device, Problem, Strategy, costmodel, space
from autotuner.costmodel import Params, geometry, predict, predict_all, ranker, simulate
from autotuner.costmodel.calibrate import _ag_problem, _rs_problem
from autotuner.decompose import build, compiler_options
from autotuner.decompose._common import pspec
from autotuner.measure.session import COMM, COMP
from autotuner.problem.suite import suite
from autotuner.testing import netns_reason

GBIT = 1e9 / 8  # bytes/s of 1 Gbit/s


def make_params(**kw: Any) -> Params:
    """A made-up device: 20 GFLOP/s, a 2 Gbit/s link each way (a ring: both directions at once)."""
    rate = 20e9
    base = dict(mm=tuple((f, f / rate) for f in (1e6, 1e9, 1e11)), mem_bw=1e10,
                ag=(1e-4, 1 / (2 * GBIT)), rs=(1e-4, 1 / (2 * GBIT)), alpha=1e-4,
                beta_uni=1 / (2 * GBIT), beta_bidi=1 / (2 * GBIT), kappa=0.0, kappa_x=0.0,
                loop_s=1e-4, copy_bw=1e10, num_devices=4)
    base.update(kw)
    return Params(**base)


def ag(n: int, rows: int = 1024, k: int = 512, cols: int = 256, dtype: str = "float32") -> Problem:
    return _ag_problem(n, rows, k, cols, dtype)


def rs(n: int, rows: int = 1024, f: int = 256, d: int = 512) -> Problem:
    return _rs_problem(n, rows, f, d)


RING = lambda *a: Strategy("ring", *a)  # noqa: E731


# ------------------------------------------------------------------------------ the model's structure


def test_baseline_is_the_collective_plus_the_einsum() -> None:
    q = make_params()
    for p in (ag(4), rs(4)):
        g = geometry(p)
        coll = q.ag if p.pattern.kind == "all_gather" else q.rs
        want = coll[0] + coll[1] * p.comm_bytes() + q.t_mm(g.flops, g.in_bytes + g.out_bytes)
        assert simulate(p, Strategy.baseline(), q) == pytest.approx(want)
    g = geometry(ag(4))
    assert g.shard_bytes == 1024 * 512 * 4 and g.comm_bytes == 3 * g.shard_bytes
    assert g.flops == 2 * 4096 * 512 * 256


@pytest.mark.parametrize("make", [ag, rs])
def test_monotone_in_bytes_and_flops(make) -> None:
    q = make_params(kappa=0.3, kappa_x=0.1)
    for n in (2, 4):
        small, more_rows, more_cols = make(n, 512, 512, 256), make(n, 1024, 512, 256), make(n, 512, 512, 1024)
        for s in space(small):
            t = simulate(small, s, q)
            assert simulate(more_rows, s, q) >= t - 1e-12, s.key   # more bytes and flops
            assert simulate(more_cols, s, q) >= t - 1e-12, s.key   # more flops, bytes of the result
            # a slower link or a slower cpu never makes anything faster
            slow_link = dataclasses.replace(q, beta_uni=2 * q.beta_uni, beta_bidi=2 * q.beta_bidi,
                                            ag=(q.ag[0], 2 * q.ag[1]), rs=(q.rs[0], 2 * q.rs[1]))
            slow_cpu = dataclasses.replace(q, mm=tuple((f, 2 * x) for f, x in q.mm))
            assert simulate(small, s, slow_link) >= t - 1e-12, s.key
            assert simulate(small, s, slow_cpu) >= t - 1e-12, s.key


def test_comm_bound_ring_is_the_transfers_and_overlaps_the_einsum() -> None:
    q = make_params(alpha=0.0, loop_s=0.0, mm=((1e6, 1e-9), (1e12, 1e-3)), mem_bw=1e15, copy_bw=1e15)
    p = ag(4)
    tx = geometry(p).shard_bytes * q.beta_uni
    assert simulate(p, RING("uni", 1, "full", "loop", True), q) == pytest.approx(3 * tx, rel=1e-3)


def test_bidirectional_halves_the_bytes_per_direction_on_a_ring_not_on_a_shared_link() -> None:
    ring = make_params(alpha=0.0, loop_s=0.0, mm=((1e6, 1e-9), (1e12, 1e-3)), mem_bw=1e15, copy_bw=1e15)
    shared = dataclasses.replace(ring, beta_bidi=2 * ring.beta_uni)  # both directions, one bucket
    for make in (ag, rs):
        p = make(4)
        tx = geometry(p).shard_bytes * ring.beta_uni
        uni = simulate(p, RING("uni", 1, "full", "loop", True), ring)
        bidi = simulate(p, RING("bidi", 1, "full", "loop", True), ring)
        # uni: 3 shards one way; bidi on 4: one shard each way, then the antipodal half each way
        assert uni == pytest.approx(3 * tx, rel=1e-3)
        assert bidi == pytest.approx(1.5 * tx, rel=1e-3)
        assert simulate(p, RING("bidi", 1, "full", "loop", True), shared) == pytest.approx(3 * tx, rel=1e-3)
    p5 = ag(5)
    tx5 = geometry(p5).shard_bytes * ring.beta_uni
    assert simulate(p5, RING("bidi", 1, "full", "loop", True), ring) == pytest.approx(2 * tx5, rel=1e-3)


def test_chunking_shortens_the_fill_and_costs_latency() -> None:
    q = make_params(alpha=0.0, loop_s=0.0, mem_bw=1e15, copy_bw=1e15)
    p = ag(2, 1024, 512, 64)  # comm-bound: a transfer takes 2.5 blocks' einsum
    g = geometry(p)
    tx, tc = g.shard_bytes * q.beta_uni, q.t_mm(g.flops / 2)
    t = {c: simulate(p, RING("uni", c, "full", "loop", True), q) for c in (1, 2, 4)}
    assert t[4] < t[2] < t[1]
    # one chunk: the received block waits for the whole transfer; c chunks: for 1/c of it
    assert t[1] == pytest.approx(max(tx, tc) + tc, rel=1e-3)
    assert t[4] == pytest.approx(max(tx + tc / 4, tc + tc), rel=1e-2)
    lat = dataclasses.replace(q, alpha=5e-3)
    assert simulate(p, RING("uni", 4, "full", "loop", True), lat) > simulate(p, RING("uni", 1, "full", "loop", True), lat)


def test_rolled_loops_and_fuse_after_cost_more() -> None:
    q = make_params(loop_s=2e-3, copy_bw=1e9)
    p = ag(4)
    full = simulate(p, RING("uni", 2, "full", "loop", True), q)
    assert simulate(p, RING("uni", 2, 1, "loop", True), q) > full
    assert simulate(p, RING("uni", 2, "full", "after", True), q) > full


def test_contention_slows_the_overlap() -> None:
    p = ag(2, 1024, 512, 512)
    s = RING("uni", 1, "full", "loop", True)
    assert simulate(p, s, make_params(kappa=0.5)) > simulate(p, s, make_params(kappa=0.0))


def test_order_is_a_permutation_fastest_first_and_predict_agrees() -> None:
    q = make_params(kappa=0.2)
    device = dataclasses.replace(Device.current(), num_devices=4)
    for p in (ag(4), rs(4), ag(4, 1024, 512, 2048)):
        cands = [s for s in space(p, device) if not s.is_baseline]
        got = ranker(q, p)(list(cands))
        assert sorted(s.key for s in got) == sorted(s.key for s in cands) and len(got) == len(cands)
        pred = predict_all(p, got, q)
        assert [pred[s.key] for s in got] == sorted(pred[s.key] for s in got)
        best, speedup = predict(p, device, q)
        assert best in space(p, device)
        allp = predict_all(p, space(p, device), q)
        assert allp[best.key] == min(allp.values())
        assert speedup == pytest.approx(allp["baseline"] / allp[best.key])


def test_params_json_round_trip_and_version() -> None:
    q = make_params(info={"overlap_rmse_log": 0.1})
    assert Params.from_dict(q.to_dict()) == q
    with pytest.raises(costmodel.CostModelError, match="version"):
        Params.from_dict({**q.to_dict(), "version": 999})
    with pytest.raises(costmodel.CostModelError, match="invalid calibration"):
        Params.from_dict({"version": costmodel.VERSION, "mm": [[1, 2]]})


# ------------------------------------------------------------------------------ calibration fit


class SimRunner:
    """A Runner whose 'measurements' come from the model with known parameters."""

    def __init__(self, truth: Params):
        self.truth = truth

    def prepare(self, problem: Problem, strategies: list[Strategy], parts: bool = True) -> list[dict[str, Any]]:
        self.p, self.s = problem, list(strategies)
        return [{"ok": True, "reason": None, "compile_s": 0.0, "memory": None, "rel_error": 0.0} for _ in strategies]

    def time(self, program: int | str) -> float:
        q, p = self.truth, self.p
        g = geometry(p)
        if program == COMM:
            a, b = q.ag if p.pattern.kind == "all_gather" else q.rs
            return a + b * g.comm_bytes
        if program == COMP:
            return q.t_mm(g.flops, g.in_bytes + g.out_bytes)
        return simulate(p, self.s[int(program)], q)


class SimTarget:
    def __init__(self, truth: Params, n: int):
        self.device = dataclasses.replace(Device.current(), num_devices=n, topology="sim")
        self.truth = truth

    def runner(self, problem: Problem) -> SimRunner:
        return SimRunner(self.truth)


@pytest.mark.parametrize("topology", ["ring", "shared"])
def test_fit_recovers_the_parameters_it_was_measured_with(topology: str) -> None:
    truth = make_params(kappa=0.4, kappa_x=0.05, loop_s=3e-4, copy_bw=3e9, mem_bw=8e9,
                        alpha=2e-4, rs=(3e-4, 1.5 / (2 * GBIT)))
    if topology == "shared":
        truth = dataclasses.replace(truth, beta_bidi=2 * truth.beta_uni)
    ts = SimTarget(truth, 4)
    params, raw = costmodel.calibrate(ts, reps=3)
    assert Params.from_dict(json.loads(json.dumps(params.to_dict()))) == params  # plain JSON
    json.dumps(raw)
    assert {s["kind"] for s in raw["sessions"]} == {"mm", "x_ag", "x_rs", "overlap"}
    assert params.num_devices == 4
    assert params.beta_uni == pytest.approx(truth.beta_uni, rel=0.05)
    assert params.beta_bidi == pytest.approx(truth.beta_bidi, rel=0.1)
    assert params.alpha == pytest.approx(truth.alpha, rel=0.25, abs=5e-5)
    assert params.ag[1] == pytest.approx(truth.ag[1], rel=0.02)
    assert params.rs[1] == pytest.approx(truth.rs[1], rel=0.02)
    assert params.kappa == pytest.approx(truth.kappa, abs=0.15)
    # and it predicts the suite as the truth does
    for _name, _regime, p in suite(4):
        cands = space(p)
        t, f = predict_all(p, cands, truth), predict_all(p, cands, params)
        for k in t:
            assert f[k] == pytest.approx(t[k], rel=0.15), (p.describe(), k)


# ------------------------------------------------------------------------------ the database


@pytest.fixture
def database(tmp_path):
    from db import Database

    d = Database(f"sqlite:///{tmp_path / 'cm.db'}")
    d.upgrade()
    yield d
    d.dispose()


def test_calibration_round_trip_through_the_database(database) -> None:
    from db import repository as repo

    device = dataclasses.replace(Device.current(), num_devices=4, topology="lab-ring-1gbit")
    other = dataclasses.replace(device, topology="lab-shared-2gbit")
    with pytest.raises(costmodel.CostModelError, match="no calibration"):
        costmodel.load_params(database, device)
    old = make_params(kappa=0.9)
    new = make_params(kappa=0.1, info={"overlap_rmse_log": 0.05})
    costmodel.save_params(database, device, old)
    rec = costmodel.save_params(database, device, new, raw={"n": 4, "sessions": []})
    assert rec.device_key == device.key and rec.model == f"costmodel-v{costmodel.VERSION}"
    got = costmodel.load_params(database, device)
    assert got == new  # the newest calibration is the one in use
    with database.session(read_only=True) as s:
        hist = repo.list_calibrations(s, device.key)
        assert [h.params["kappa"] for h in hist] == [0.1, 0.9]
        assert hist[0].raw == {"n": 4, "sessions": []}
        assert repo.get_calibration(s, other.key) is None
        assert repo.get_calibration(s, device.key, model="another-model") is None

    p = ag(4)
    best, speedup = predict(p, device, got)
    assert best in space(p, device) and speedup > 0
    answer = costmodel.model_answer(database)
    assert answer(p, other) is None                      # not calibrated: no model answer
    a = answer(p, device)
    assert a is None or (a[0] == best and a[1] == pytest.approx(speedup))
    assert costmodel.order_for(database, other, p) is None
    order = costmodel.order_for(database, device, p)
    cands = [s for s in space(p, device) if not s.is_baseline]
    assert order is not None and sorted(s.key for s in order(cands)) == sorted(s.key for s in cands)


# ------------------------------------------------------------------------------ XLA-native candidates


def test_xla_windowed_is_left_out_on_cpu_and_offered_on_gpu_and_tpu() -> None:
    p = ag(4)
    cpu = Device.current()
    assert cpu.platform == "cpu"
    assert not [s for s in space(p, cpu) if s.method == "xla_windowed"]
    assert not [s for s in space(p) if s.method == "xla_windowed"]  # unknown device: left out
    gpu = [s.key for s in space(p, dataclasses.replace(cpu, platform="gpu")) if s.method == "xla_windowed"]
    tpu = [s.key for s in space(p, dataclasses.replace(cpu, platform="tpu")) if s.method == "xla_windowed"]
    assert gpu == ["xla_windowed", "xla_windowed-ms"] and tpu == ["xla_windowed"]
    s = Strategy("xla_windowed", multi_stream=True)
    assert compiler_options(s, "gpu") == {"xla_gpu_threshold_for_windowed_einsum_mib": 0,
                                          "xla_gpu_multi_streamed_windowed_einsum": True}
    assert compiler_options(Strategy("xla_windowed"), "tpu")["xla_tpu_enable_windowed_einsum_for_all_gather"]
    assert compiler_options(RING("uni"), "gpu") == {} and compiler_options(Strategy(), "gpu") == {}
    assert Strategy.from_dict(s.to_dict()) == s and s.key == "xla_windowed-ms"
    with pytest.raises(autotuner.StrategyError, match="chunks"):
        Strategy.from_dict({"method": "xla_windowed", "chunks": 2})
    with pytest.raises(autotuner.StrategyError, match="multi_stream"):
        Strategy("ring", multi_stream=True)


@pytest.mark.parametrize("explicit", [True, False])
def test_xla_options_are_accepted_and_ignored_on_cpu(explicit: bool) -> None:
    from jax.sharding import AxisType

    p = ag(4, 64, 32, 16)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((4,), ("x",), axis_types=(kind,), devices=jax.devices()[:4])
    s = Strategy("xla_windowed", multi_stream=True)
    fn = build(p, s, mesh)
    a = jax.device_put(jnp.ones(p.lhs.shape), NamedSharding(mesh, pspec(p.lhs.spec)))
    b = jax.device_put(jnp.ones(p.rhs.shape), NamedSharding(mesh, pspec(p.rhs.spec)))
    lowered = jax.jit(fn).lower(a, b)
    plain = lowered.compile().as_text()
    windowed = lowered.compile(compiler_options=compiler_options(s, "gpu")).as_text()
    assert plain == windowed
    assert plain.count("all-gather(") == 1 and plain.count(" dot(") == 1
    assert "collective-permute" not in plain and "while" not in plain
    out = jax.jit(fn)(a, b)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, pspec(p.out_spec)), 2)
    assert float(jnp.max(jnp.abs(out - 32.0))) == 0.0


def test_the_harness_compiles_xla_windowed_with_its_options() -> None:
    from autotuner.measure import LocalRunner, run_session

    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    for p in (ag(4, 64, 32, 16), rs(4, 64, 16, 32)):
        res = run_session(LocalRunner(mesh), p, [Strategy(), Strategy("xla_windowed"),
                                                Strategy("xla_windowed", multi_stream=True)], reps=3)
        assert [c.status for c in res.candidates] == ["ok", "ok"], [c.reason for c in res.candidates]
        assert all(c.error is not None and c.error <= 1e-5 for c in res.candidates)


# ------------------------------------------------------------------------------ on the lab




@pytest.mark.lab
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_calibrate_command_on_the_lab_stores_a_usable_calibration(tmp_path) -> None:
    """`autotuner calibrate` on a 2-process lab: stored, loadable, predicts the suite."""
    from typer.testing import CliRunner

    import autotuner.cli.costmodel  # noqa: F401 - registers `calibrate` on the app
    from autotuner.cli.common import app
    from db import Database

    target = "lab:none:2" if netns_reason() else "lab:shared:2:2gbit"

    url = f"sqlite:///{tmp_path / 'cal.db'}"
    res = CliRunner().invoke(app, ["calibrate", "--target", target, "--db", url, "--reps", "3", "--json"])
    assert res.exit_code == 0, res.output
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1]
    got = json.loads(line)
    device = Device.from_dict(got["device"])
    with Database(url) as database:
        params = costmodel.load_params(database, device)
    assert params.num_devices == 2 and params.beta_uni > 0 and params.alpha >= 0
    assert all(t > 0 for _f, t in params.mm)
    for _name, _regime, p in suite(2):
        pred = predict_all(p, space(p, device), params)
        assert all(math.isfinite(v) and v > 0 for v in pred.values())
