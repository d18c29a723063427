"""The `aot:tpu:TOPOLOGY` target with the real XLA:TPU compiler (libtpu, no TPU): every candidate
compiles or says why, the schedule estimate's parts check out against the compiler's own numbers,
plain jit is XLA's own windowed einsum where XLA decides so, and `tune` stores estimates as
estimates, served as such."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autotuner import Problem, Strategy
from autotuner.decompose.space import space
from autotuner.hlo.chips import CHIPS, chip_for
from autotuner.hlo.schedule import estimate, placement_of
from autotuner.measure.aot import AotRunner, mesh_on
from autotuner.measure.targets import Target, TargetError, TargetSession

pytestmark = pytest.mark.tpu

# MLP up-projection, sequence-parallel (README's problem): XLA:TPU windows it itself in plain jit
MLP_UP = {"equation": "bsd,df->bsf", "lhs": {"shape": [8, 2048, 4096], "spec": [None, "x", None]},
          "rhs": {"shape": [4096, 16384], "spec": [None, "x"]}, "out_spec": [None, None, "x"],
          "dtype": "bfloat16", "mesh": {"x": 8}}
# the attention output, heads sharded, reduce-scattered on the sequence: plain jit keeps one reduce-scatter
ATTN_OUT = {"equation": "bshk,hkd->bsd", "lhs": {"shape": [8, 2048, 32, 128], "spec": [None, None, "x", None]},
            "rhs": {"shape": [32, 128, 4096], "spec": ["x", None, None]}, "out_spec": [None, "x", None],
            "dtype": "bfloat16", "mesh": {"x": 8}}
SMALL = {"equation": "bsd,df->bsf", "lhs": {"shape": [2, 256, 512], "spec": [None, "x", None]},
         "rhs": {"shape": [512, 1024], "spec": [None, "x"]}, "out_spec": [None, None, "x"],
         "dtype": "bfloat16", "mesh": {"x": 4}}


def test_the_target_names_its_device_and_refuses_what_libtpu_does_not_know(tpu_devices):
    tpu_devices("v5e:2x4")
    assert Target.parse("aot:tpu:v5e:2x4").estimates
    with TargetSession(Target.parse("aot:tpu:v5e:2x4")) as ts:
        d = ts.device
        assert (d.platform, d.device_kind, d.num_devices, d.topology) == ("tpu", "TPU v5 lite", 8, "aot:tpu:v5e:2x4")
        assert d.estimated and ts.estimates
        assert "plain" in [s.key for s in space(Problem.from_dict(MLP_UP), d)]
    with pytest.raises(TargetError, match="expected aot:tpu:TOPOLOGY"):
        Target.parse("aot:gpu:h100")
    with pytest.raises(TargetError, match="does not know this topology"):
        TargetSession(Target.parse("aot:tpu:v9:1x1"))


def test_every_candidate_compiles_or_says_why_and_the_gather_costs_its_bytes(tpu_devices):
    devs = tpu_devices("v5e:2x2")
    p = Problem.from_dict(SMALL)
    runner = AotRunner(mesh_on(devs, (4,), ("x",)))
    strategies = space(p, _device(devs))
    assert {"plain", "xla_windowed", "baseline"} <= {s.key for s in strategies}
    statuses = runner.prepare(p, strategies, parts=False)
    for s, st in zip(strategies, statuses, strict=True):
        assert st["ok"] or st["reason"], s.key
        if st["ok"]:
            assert st["memory"]["temp_size_in_bytes"] >= 0 and st["schedule"]["estimated"]
            assert runner.time(strategies.index(s)) == st["schedule"]["estimated_s"] > 0
    assert sum(st["ok"] for st in statuses) == len(strategies)   # this small problem: every one compiles
    # the baseline's all-gather, timed from the bytes the compiled program moves: a bidirectional
    # ring of 3 steps, each a quarter of the gathered lhs over both directions of one v5e link
    base = statuses[strategies.index(Strategy.baseline())]["schedule"]
    chip = CHIPS["v5e"]
    gathered = 2 * 256 * 512 * 2
    assert base["collective_s"] == pytest.approx(3 * (chip.hop_latency_s + gathered / 4 / (2 * chip.link_bytes_per_s)))
    rings = [st["schedule"] for s, st in zip(strategies, statuses, strict=True) if s.method == "ring"]
    assert all(r["async_collectives"] > 0 for r in rings)
    assert any(r["overlapped_collectives"] > 0 for r in rings)   # some schedule hides a transfer behind a dot


def _device(devs):
    from autotuner.measure.aot import AotSpec, device_of

    return device_of(AotSpec.parse("aot:tpu:v5e:2x2"), devs)


def test_plain_jit_is_xla_tpus_own_windowed_einsum_where_xla_decides_so(tpu_devices):
    devs = tpu_devices("v5e:2x4")
    runner = AotRunner(mesh_on(devs, (8,), ("x",)))
    up = runner.prepare(Problem.from_dict(MLP_UP), [Strategy.plain(), Strategy.baseline()], parts=False)
    plain, base = (st["schedule"] for st in up)
    assert plain["async_collectives"] >= 2 and plain["overlapped_collectives"] >= 1   # a loop of permutes
    assert (base["async_collectives"], base["collectives"]) == (0, 1)                # one all-gather
    assert up[0]["memory"]["temp_size_in_bytes"] < up[1]["memory"]["temp_size_in_bytes"]
    attn = runner.prepare(Problem.from_dict(ATTN_OUT), [Strategy.plain(), Strategy("xla_windowed")], parts=False)
    assert [st["schedule"]["collectives"] for st in attn] == [1, 1]   # XLA windows neither: one reduce-scatter
    assert attn[0]["schedule"]["async_collectives"] == 0


def test_the_clocks_hold_against_xla_tpus_own_cycle_model_and_roofline(tpu_devices):
    """Each generation's clock turns XLA:TPU's cycle estimate of an 8192^3 bf16 matmul into 85-95%
    of the published peak, and the compute estimate is within 20% of the compiler's other figure
    for it (`cost_analysis()["optimal_seconds"]`, defined for loop-free programs)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = 8192
    for topo in ("v4:2x2x1", "v5e:2x4", "v5p:2x2x1", "v6e:2x2"):
        devs = tpu_devices(topo)
        chip = chip_for(devs[0].device_kind)
        mesh = mesh_on(devs, (1,), ("x",))
        a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
        compiled = jax.jit(lambda x, y: x @ y).lower(a, a).compile()
        e = estimate(compiled.as_text(), chip, placement_of(list(mesh.devices.flat)))
        per_device = chip.peak_flops / (chip.cores if devs[0].device_kind == "TPU v4" else 1)  # v4: a core each
        utilization = 2 * n ** 3 / e.compute_s / per_device
        assert 0.85 <= utilization <= 0.95, (topo, utilization)
        cost = compiled.cost_analysis()
        cost = cost if isinstance(cost, dict) else cost[0]
        assert 0.8 <= e.compute_s / cost["optimal_seconds"] <= 1.2, (topo, e.compute_s / cost["optimal_seconds"])


def test_tune_stores_estimates_as_estimates_and_the_service_says_so(tpu_devices, tmp_path: Path):
    tpu_devices("v5e:2x2")
    f = tmp_path / "p.json"
    f.write_text(json.dumps([SMALL]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_DB"))}
    r = subprocess.run([sys.executable, "-m", "autotuner.cli", "tune", "--problems", str(f), "--target",
                        "aot:tpu:v5e:2x2", "--trials", "2", "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout)
    assert row["estimated"] is True and row["reference"] == "plain"
    assert "estimated (XLA:TPU compile, no TPU)" in r.stderr
    cands = {c["key"]: c for c in row["candidates"]}
    assert {"plain", "xla_windowed", "baseline"} <= set(cands) and len(cands) >= 5   # 2 rings too
    for c in cands.values():
        assert set(c) >= {"strategy", "compiled", "temp_bytes", "overlapped_collectives", "estimated_s"}
        assert c["compiled"] and c["estimated_s"] > 0 and c["median_s"] is None   # no measurement claimed
    best = min(cands.values(), key=lambda c: c["estimated_s"])
    assert row["winner"] == best["strategy"] or row["winner"] == {"method": "plain"} and best["key"] == "plain"
    assert math.isclose(row["speedup"], cands["plain"]["estimated_s"] / best["estimated_s"])
    # stored under a device whose topology says aot:, and served as "estimated", never "tuned"
    from db import Database
    from db import repository as repo

    database = Database(f"sqlite:///{tmp_path / 'autotuner.db'}")
    with database.session(read_only=True) as s:
        (dev,) = repo.list_devices(s)
        assert dev.topology == "aot:tpu:v5e:2x2"
    database.dispose()
    from autotuner.settings import Settings
    from service import create_app

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    with TestClient(create_app(Settings(db_url=f"sqlite:///{tmp_path / 'autotuner.db'}"))) as client:
        got = client.post("/v1/lookup", json={"device": row["device"], "problem": SMALL})
        assert got.status_code == 200 and got.json()["source"] == "estimated"
        page = client.get(f"/problems/{row['key']}")
        assert page.status_code == 200 and "estimated (XLA:TPU compile, no TPU)" in page.text
    assert re.search(r"x plain", r.stderr)   # the candidates table, over the reference


def test_the_pass_plans_abstract_arguments_on_a_tpu_mesh_and_says_what_xla_windows_itself(tpu_devices):
    """overlap(fn).plan takes abstract arguments laid out on the target's devices; per pair the plan
    says whether plain jit's XLA:TPU decomposes it itself, and its memory is the target's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from autotuner import overlap

    devs = tpu_devices("v5e:2x4")
    mesh = mesh_on(devs, (8,), ("x",))

    def arg(d: dict, side: str) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(d[side]["shape"]), jnp.bfloat16, sharding=NamedSharding(mesh, P(*d[side]["spec"])))

    def step(x, w, a, v):   # an MLP up-projection (XLA windows it) and an attention output (it does not)
        up = jnp.einsum("sd,df->sf", x, w, out_sharding=NamedSharding(mesh, P(None, "x")))
        out = jnp.einsum("bshk,hkd->bsd", a, v, out_sharding=NamedSharding(mesh, P(None, "x", None)))
        return up.sum() + out.sum()

    up = {"lhs": {"shape": [2048, 1024], "spec": ["x", None]}, "rhs": {"shape": [1024, 6144], "spec": [None, "x"]}}
    attn = {"lhs": {"shape": [2, 512, 16, 64], "spec": [None, None, "x", None]},
            "rhs": {"shape": [16, 64, 1024], "spec": ["x", None, None]}}
    args = (arg(up, "lhs"), arg(up, "rhs"), arg(attn, "lhs"), arg(attn, "rhs"))
    plan = overlap(step, strategy="plain").plan(*args)
    by_eq = {r.name: r for r in plan}
    assert by_eq["sd,df->sf"].xla == "windowed" and by_eq["bshk,hkd->bsd"].xla == ""
    assert not any(r.applied for r in plan) and {r.strategy.key for r in plan} == {"plain"}
    assert plan.memory.plain_bytes is not None and plan.memory.plain_bytes > 0   # plain jit's own temp bytes on the target
    # on TPU the hand-written baseline is a choice of its own, applied (XLA then does not window the pair)
    base = overlap(step, strategy="baseline", memory=None).plan(*args)
    assert all(r.applied and r.strategy.is_baseline for r in base)
    assert base.memory.plain_bytes == plan.memory.plain_bytes and base.memory.overlapped_bytes is not None
    assert {r.name: r.xla for r in base} == {r.name: r.xla for r in plan}   # what plain jit would do, still said


def test_plan_and_extract_take_an_aot_target(tpu_devices, tmp_path: Path):
    tpu_devices("v5e:2x4")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_DB"))}
    factory = ["autotuner.examples.transformer:train_step", "--mesh", '{"model": 8}', "--explicit"]
    r = subprocess.run([sys.executable, "-m", "autotuner.cli", "plan", *factory, "--target", "aot:tpu:v5e:2x4",
                        "--strategy", "ring-uni-c1-u1-loop-send", "--memory", "none"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "aot:tpu:v5e:2x4, estimated (XLA:TPU compile, no TPU)" in r.stderr
    assert re.search(r"(\d+) of 24 pair\(s\) decomposed", r.stdout) and "of 24 pair(s) decomposed" in r.stdout
    assert int(re.search(r"(\d+) of 24 pair", r.stdout).group(1)) >= 16
    assert re.search(r"temp memory per device: plain [\d.]+ MiB, overlapped [\d.]+ MiB", r.stdout)
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "autotuner.cli", "extract", *factory, "--target", "aot:tpu:v5e:2x4",
                        "-q", "-o", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "XLA:TPU's partitioner" in r.stderr and len(json.loads(out.read_text())["problems"]) == 12
    bad = subprocess.run([sys.executable, "-m", "autotuner.cli", "plan", *factory, "--target", "aot:gpu:x"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected aot:tpu:TOPOLOGY" in bad.stderr and "Traceback" not in bad.stderr


RS_SMALL = {"equation": "bsf,fd->bsd", "lhs": {"shape": [2, 256, 1024], "spec": [None, None, "x"]},
            "rhs": {"shape": [1024, 512], "spec": ["x", None]}, "out_spec": [None, "x", None],
            "dtype": "bfloat16", "mesh": {"x": 4}}


@pytest.mark.parametrize("spec", [SMALL, RS_SMALL], ids=["all-gather", "reduce-scatter"])
def test_a_rings_serial_control_overlaps_nothing_in_xla_tpus_schedule(tpu_devices, spec):
    """The control (`Strategy.serial`) is the ring with every transfer and einsum in turn: in the
    schedule XLA:TPU compiles for it, no async collective has a dot inside its span, where the
    ring's own schedule hides its transfers behind dots. (XLA may slice through a concatenate or
    remove an optimization barrier: only a dependency on every element holds.)"""
    from autotuner.decompose import build, check_valid

    devs = tpu_devices("v5e:2x2")
    runner = AotRunner(mesh_on(devs, (4,), ("x",)))
    p = Problem.from_dict(spec)
    args = runner._args(p)
    rings = [Strategy("ring", d, c, u, "loop", sf) for d in ("uni", "bidi") for c in (1, 2)
             for u in ("full", 1) for sf in (True, False)]
    checked = overlapping = 0
    for ring in rings:
        try:
            check_valid(p, ring)
        except ValueError:
            continue
        got = {}
        for s in (ring, ring.serial()):
            st = runner.compile(build(p, s, runner.mesh), args)
            assert st["ok"], (s.key, st["reason"])
            got[s.method] = st["schedule"]
        overlapping += got["ring"]["overlapped_collectives"] > 0
        assert got["serial"]["overlapped_collectives"] == 0, (ring.key, got["serial"])
        assert got["serial"]["async_collectives"] == got["ring"]["async_collectives"], ring.key   # the same transfers
        assert got["serial"]["estimated_s"] > got["ring"]["estimated_s"], ring.key
        checked += 1
    assert checked >= 6 and overlapping >= checked // 2


def test_the_searchs_ring_winner_is_split_into_traffic_and_overlap_from_one_session(tpu_devices, tmp_path: Path):
    """After the search, a ring winner is timed once more beside the reference and its serial
    control: the row's speedup is traffic x overlap from that session. On XLA:TPU the README's
    MLP-up ring wins by overlap: decomposed without it, it would be slower than plain jit."""
    from autotuner.cli.tune import winner_split
    from autotuner.measure.session import controls_of, split
    from autotuner.tune.search import tune_problem
    from db import Database

    tpu_devices("v5e:4x2")
    p = Problem.from_dict({**MLP_UP, "lhs": {**MLP_UP["lhs"], "shape": [2, 2048, 4096]}})   # 2 sequences: faster compiles
    ring = Strategy("ring", "bidi", 1, "full", "loop", True)
    database = Database(f"sqlite:///{tmp_path / 'autotuner.db'}")
    database.upgrade()
    with TargetSession(Target.parse("aot:tpu:v5e:4x2")) as ts:
        got = tune_problem(ts, database, p, trials=1, order=lambda cands: [ring], use_model=False)
    assert got.winner is not None and got.winner.strategy_key == ring.key, got.winner
    keys = [c.key for c in got.candidates]
    assert keys.count(ring.key) == 2 and keys[-1] == ring.serial().key   # the search's, then the split's
    row = winner_split(got.winner)   # the stored winner's, from its own measurement
    assert row == split(got.candidates[-2], controls_of(got.candidates)[id(got.candidates[-2])])
    assert row["serial_s"] > 0 and row["traffic_speedup"] < 1 < row["overlap_speedup"]
    assert math.isclose(row["traffic_speedup"] * row["overlap_speedup"], got.winner.speedup, rel_tol=1e-9)
    with database.session(read_only=True) as s:   # the control is stored, never the winner
        from db import repository as repo

        assert repo.get_winner(s, got.winner.device_key, p.key).strategy_key == ring.key


def test_an_xla_windowed_winner_on_tpu_runs_plain_jit_whose_xla_windows_what_forcing_would(tpu_devices, tmp_path: Path):
    """Where XLA's own decomposition is a pair's winner on TPU, the plan leaves the pair to plain
    jit and says so, with the flags that would force it, and why they are not asked for: compiled
    with them (`compiler_options`), XLA:TPU windows exactly the pairs its
    default windows (here an MLP up-projection whose operand is past its cutoff, and not one just
    below it nor an attention output), so the forced program is plain jit's (issue 37)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from autotuner import Client, overlap
    from autotuner.decompose.xla import compiler_options
    from autotuner.measure.aot import AotSpec, device_of
    from autotuner.overlap.find import WINDOWED

    devs = tpu_devices("v5e:2x4")
    device = device_of(AotSpec.parse("aot:tpu:v5e:2x4"), devs)
    mesh = mesh_on(devs, (8,), ("x",))

    def sds(shape: tuple[int, ...], *spec: str | None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(*spec)))

    def up(x, w):
        return jnp.einsum("sd,df->sf", x, w, out_sharding=NamedSharding(mesh, P(None, "x")))

    def attn_out(a, v):
        return jnp.einsum("bshk,hkd->bsd", a, v, out_sharding=NamedSharding(mesh, P(None, "x", None)))

    windowed = Strategy("xla_windowed")
    forced = compiler_options(windowed, "tpu")
    for fn, args, xla in ((up, (sds((512, 1024), "x", None), sds((1024, 6144), None, "x")), True),
                          (up, (sds((512, 1024), "x", None), sds((1024, 4096), None, "x")), False),
                          (attn_out, (sds((2, 512, 16, 64), None, None, "x", None), sds((16, 64, 1024), "x", None, None)), False)):
        lowered = jax.jit(fn).lower(*args)
        assert (WINDOWED in lowered.compile().as_text()) == xla
        assert (WINDOWED in lowered.compile(compiler_options=forced).as_text()) == xla   # nothing more
    args = (sds((512, 1024), "x", None), sds((1024, 4096), None, "x"))
    base = overlap(up, strategy="plain").plan(*args)
    assert len(base) == 1 and base[0].xla == "", str(base)
    snap = tmp_path / "snapshot.json"
    snap.write_text(json.dumps({"format": "autotuner-snapshot", "version": 1, "entries": [
        {"device_key": device.key, "problem_key": base[0].key, "strategy": windowed.to_dict(),
         "strategy_key": windowed.key, "speedup": 1.2, "confidence": [1.1, 1.3], "record_id": 1,
         "measured_at": "2026-12-06T00:00:00+00:00", "trials": 9}]}))
    row = overlap(up, client=Client(offline=str(snap), device=device), memory=None).plan(*args)[0]
    assert not row.applied and row.strategy.key == "plain", row
    assert "plain jit runs it" in row.note and "LIBTPU_INIT_ARGS='--xla_tpu_enable_windowed_einsum_for_all_gather=true" in row.note
