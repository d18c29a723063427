"""`overlap(f)` as a user wraps it (issue 37): it keeps the step's name and docs, says once when
another transformation around it (jax.jit, jax.grad, shard_map) makes it plain jit, and never
changes nothing silently: with no client it warns, and a later `overlap(g, client=...)` in the
same process asks its own service (the decisions of no client never answer for it)."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from autotuner.overlap import overlap
from autotuner.runtime.client import Client
from db import Database
from service.testing import live_server


def _program() -> tuple[Any, tuple[Any, Any], Any]:
    """x (sequence over model) @ w (columns over model), summed: one all-gather -> dot pair."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).normal(size=(2, 64, 32)), jnp.float32),
                       NamedSharding(mesh, P(None, "model", None)))
    w = jax.device_put(jnp.asarray(np.random.default_rng(1).normal(size=(32, 128)), jnp.float32),
                       NamedSharding(mesh, P(None, "model")))

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        """The sum of x @ w."""
        y = jax.lax.with_sharding_constraint(jnp.einsum("bsd,df->bsf", x, w), NamedSharding(mesh, P(None, None, "model")))
        return jnp.sum(y)

    return loss, (x, w), mesh


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_the_wrapper_keeps_the_steps_name_and_docs() -> None:
    loss, _args, _mesh = _program()
    ov = overlap(loss)
    assert ov.__name__ == "loss" and ov.__doc__ == loss.__doc__ and ov.__wrapped__ is loss   # type: ignore[attr-defined]


def test_inside_jit_grad_and_shard_map_it_is_plain_jit_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    loss, args, mesh = _program()
    want, want_grad = loss(*args), jax.grad(loss, argnums=1)(*args)
    ov = overlap(loss, strategy="baseline")
    with caplog.at_level(logging.WARNING, logger="autotuner.overlap"):
        np.testing.assert_allclose(jax.jit(ov)(*args), want, rtol=1e-5)
        np.testing.assert_allclose(jax.grad(ov, argnums=1)(*args), want_grad, rtol=1e-5)
        np.testing.assert_allclose(jax.jit(ov)(*args), want, rtol=1e-5)
        said = _warnings(caplog, "inside another transformation")
        assert len(said) == 1 and "call it on arrays" in said[0], said   # once per wrapper, with what to do
        local = overlap(lambda x, w: jnp.einsum("bsd,df->bsf", x, w), strategy="baseline")
        inner = jax.shard_map(lambda x, w: local(x, w), mesh=mesh, in_specs=(P(None, "model"), P()),
                              out_specs=P(None, "model"))
        np.testing.assert_allclose(inner(*args), jnp.einsum("bsd,df->bsf", *args), rtol=1e-5)
    assert len(_warnings(caplog, "inside another transformation")) == 2


def test_with_no_client_it_warns_then_a_client_in_the_same_process_is_asked(
        tmp_path: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNER_SERVICE_URL", raising=False)
    loss, args, _mesh = _program()
    with caplog.at_level(logging.WARNING, logger="autotuner.overlap"):
        plan = overlap(loss).plan(*args)
    assert plan and not any(r.applied for r in plan)
    assert _warnings(caplog, "no tuning client is configured"), caplog.text
    database = Database(f"sqlite:///{tmp_path / 'a.db'}")
    database.upgrade()
    with live_server(database.url) as url, Client(url) as client:
        caplog.clear()
        plan = overlap(loss, client=client).plan(*args)   # same problem, same process: asked anew
        assert [r.source for r in plan] == ["default"] and not _warnings(caplog, "no tuning client")
        deadline = time.monotonic() + 10   # the service writes its misses every 0.5 s (a read writes nothing)
        while not (demand := httpx.get(f"{url}/v1/demand").json()["items"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {d["problem_key"] for d in demand} == {plan[0].key}, demand   # the service counted the miss
    database.dispose()


def test_a_step_that_changes_its_arguments_in_place_is_refused_not_run_without_its_updates() -> None:
    """jax.jit traces a function with copies of its arguments, so a step that writes its update into
    them (a dict it was given; Flax NNX's nnx.jit steps: tests/models/test_flax.py) loses the update
    on every call, silently. overlap raises instead, naming what changed; a step that returns its
    update runs."""
    from autotuner.overlap import OverlapError

    loss, (x, w), _mesh = _program()

    def step(state: dict[str, jax.Array], x: jax.Array, *, lr: dict[str, float]) -> jax.Array:
        value, grad = jax.value_and_grad(loss, argnums=1)(x, state["w"])
        state["w"] = state["w"] - lr["lr"] * grad   # the caller never sees this under a jit
        return value

    with pytest.raises(OverlapError, match=r"changed its arguments in place \(args\[0\]\['w'\]\)"):
        overlap(step, strategy="baseline")({"w": w}, x, lr={"lr": 0.1})
    state = {"w": w}
    jax.jit(step)(state, x, lr={"lr": 0.1})
    assert state["w"] is w   # what plain jit does: the update is gone

    def bumps(x: jax.Array, *, opts: dict[str, Any]) -> jax.Array:
        opts["calls"] = opts["calls"] + 1
        return loss(x, w)

    with pytest.raises(OverlapError, match=r"in place \(opts\['calls'\]\)"):
        overlap(bumps, strategy="baseline")(x, opts={"calls": jnp.zeros(())})

    def pure(state: dict[str, jax.Array], x: jax.Array) -> tuple[dict[str, jax.Array], jax.Array]:
        value, grad = jax.value_and_grad(loss, argnums=1)(x, state["w"])
        return {"w": state["w"] - 0.1 * grad}, value

    new, _ = overlap(pure, strategy="baseline")({"w": w}, x)
    np.testing.assert_allclose(new["w"], jax.jit(pure)({"w": w}, x)[0]["w"], rtol=1e-6)


def test_an_nnx_step_that_returns_its_objects_gives_the_callers_own_back() -> None:
    """As nnx.jit does: where a step written for it returns the model it was given (or a module
    inside it), the caller gets its own object, updated, not a copy; a module the step creates is
    a new object."""
    nnx = pytest.importorskip("flax.nnx", reason="install requirements-models.lock (`make test` does)")

    class Model(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.up = nnx.Linear(4, 4, rngs=rngs)
            self.count = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x: jax.Array) -> jax.Array:
            self.count[...] += 1
            return self.up(x)

    def step(model: Model, x: jax.Array) -> tuple[Model, Any, Any, jax.Array]:
        return model, model.up, nnx.Linear(4, 2, rngs=nnx.Rngs(1)), model(x).sum()

    x = jnp.ones((2, 4))
    for jit in (nnx.jit, lambda f: overlap(f, strategy="baseline")):
        model = Model(nnx.Rngs(0))
        got, up, new, _ = jit(step)(model, x)
        assert got is model and up is model.up and float(model.count[...]) == 1.0
        assert isinstance(new, nnx.Linear) and new.kernel[...].shape == (4, 2)
    # with NNX objects among the arguments, the executable of the program of their state (as `lower`)
    exe = overlap(step, strategy="baseline").compiled(Model(nnx.Rngs(0)), x)
    assert isinstance(exe, jax.stages.Compiled) and "dot(" in exe.as_text()


def test_the_same_layout_spelled_without_its_trailing_dimensions_is_not_prepared_again() -> None:
    """A compiled step's outputs can come back spelled without their trailing unsharded dimensions
    (P('model',) for P('model', None, None): Flax NNX's kernels after an optimizer update,
    tests/models/test_flax.py); a training loop that feeds them back must not prepare (analyse and
    compile) the step a second time for the same layout."""
    loss, (x, w), mesh = _program()
    ov = overlap(loss, strategy="baseline")
    want = ov(x, w)
    respelled = jax.device_put(x, NamedSharding(mesh, P(None, "model")))
    assert x.sharding.spec == P(None, "model", None) and respelled.sharding.spec == P(None, "model")
    np.testing.assert_allclose(ov(respelled, w), want, rtol=1e-6)
    assert len(ov._cache) == 1
    other = jax.device_put(x, NamedSharding(mesh, P(None, None, "model")))   # another layout: prepared anew
    np.testing.assert_allclose(ov(other, w), want, rtol=1e-5)
    assert len(ov._cache) == 2
