"""The grouped gathers the real models produce (Q/K/V, gate/up: one all-gather feeding 3 / 2 dots;
the GPTs of Flax's and Equinox's layers have Q/K/V only, Equinox's gathering each dot's right
operand) run every strategy of their space through the harness `tune` uses (inproc), each checked
against the baseline's k results."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")   # before keras is first imported

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("module", "library", "ks"), [
    ("penzai_llama", "penzai", [2, 3]), ("keras_hub_llama", "keras_hub", [2, 3]),
    ("flax_gpt", "flax", [3]), ("equinox_gpt", "equinox", [3])])
def test_every_grouped_problem_runs_every_strategy(module: str, library: str, ks: list[int]) -> None:
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed: install requirements-models.lock (`make test` does)")
    import jax

    from autotuner import GroupedProblem, space
    from autotuner.hlo import extract_report
    from autotuner.measure import LocalRunner, run_session

    factory = importlib.import_module(f"tests.models.{module}").forward_sp
    report = extract_report(*_call(factory))
    groups = [p for p, _ in report.problems if isinstance(p, GroupedProblem)]
    assert sorted(g.k for g in groups) == ks
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    for gp in groups:
        strategies = space(gp)
        assert len(strategies) > 1
        res = run_session(LocalRunner(mesh, warmup=1), gp, strategies, reps=2)
        bad = [(c.key, c.reason) for c in [res.baseline, *res.candidates] if c.status != "ok"]
        assert bad == [], gp.describe()
        assert res.comm_s is not None and res.comp_s is not None


def _call(factory):  # noqa: ANN001, ANN202 - (fn, *args) of a factory
    fn, args = factory()
    return (fn, *args)
