"""measure.profile: a step's thunks split into collectives and compute, their overlap and the
idle time, from a trace's events (synthetic here, with known intervals; and one real trace of a
small collective program on in-process devices)."""

from __future__ import annotations

import pytest

from autotuner.measure.profile import summarize

MS = 1_000_000


def step(t0: int, events: list[tuple[str, float, float]]) -> list[tuple[str, str, int, int]]:
    """One step at t0 (ns) of 10 ms, launched on the client thread, its thunks on a pool thread
    (given in ms from its start)."""
    out = [("client", "[0] CommonPjRtLoadedExecutable::Execute (jit_step)", t0, t0 + MS // 100),
           ("client", "ThunkExecutor::Execute (wait for completion)", t0 + 10 * MS, t0 + 10 * MS)]
    out += [("pool", n, t0 + int(a * MS), t0 + int(b * MS)) for n, a, b in events]
    return out


def test_collectives_compute_overlap_and_idle_per_step():
    # 0-3 all-reduce; 2-6 fusion (1 ms beside the all-reduce); 5-7 dot; 8-9 a ring's ppermute;
    # a while loop wrapping 5-7 (not counted twice); runtime events and end markers ignored
    events = [("all-reduce.3", 0, 3), ("fusion.1", 2, 6), ("dot.7", 5, 7), ("ppermute.2", 8, 9),
              ("while.1", 5, 7), ("end: all-reduce.3", 3, 3), ("Rendezvous", 0, 3), ("Wait for x", 0, 1),
              ("ThunkExecutor::Execute", 5, 7)]   # an executor's own span: not a thunk
    evs = step(0, events) + step(20 * MS, events) + step(40 * MS, events)
    p = summarize(evs)
    assert p is not None and p.steps == 3
    assert p.step_ms == pytest.approx(10) and p.collective_ms == pytest.approx(4)
    assert p.compute_ms == pytest.approx(5) and p.overlap_ms == pytest.approx(1)
    assert p.idle_ms == pytest.approx(10 - (4 + 5 - 1))
    assert p.by_collective == pytest.approx({"all-reduce": 3, "ppermute": 1})   # a ring's transfers
    assert summarize([("pool", "fusion", 0, 1)]) is None


def test_a_real_trace_of_a_collective_program():
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from autotuner.measure.profile import COMPILE_OPTIONS, profile_steps

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    x = jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, P("x", None)))
    f = jax.jit(lambda a: jnp.sum(a @ a.T), out_shardings=NamedSharding(mesh, P()))
    compiled = f.lower(x).compile(COMPILE_OPTIONS)
    p = profile_steps(lambda: compiled(x), 3)
    assert p is not None and p.steps >= 3
    assert p.compute_ms > 0 and p.collective_ms > 0 and set(p.by_collective) <= {"all-gather", "all-reduce"}
    assert p.idle_ms >= 0 and p.step_ms >= p.compute_ms
