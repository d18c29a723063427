"""The compiler pass `autotuner.overlap` on the real models of the test extra (keras-hub's Llama and
Gemma, penzai's Llama, GPTs of Flax NNX's and Equinox's layers, tests/models), sequence parallel on the 2x2
(data, model) Auto mesh, and keras-hub's Gemma under keras-hub's own layout (every kernel sharded
over both axes).

For the forward pass and the whole training step (value_and_grad + optimizer update) of both
models, three forced choices per pair: the baseline (exactly plain jit), the first ring of each
pair's `space` and its last one (chunked, and for the all-gathers fused after the loop); the dots
of one all-gather (Q/K/V, gate/up) are one GroupedProblem, run as one ring. Under "auto", tuned
winners for every problem (grouped ones included) apply. Each
overlapped function equals plain `jax.jit` within the dtype's tolerance, every pair that extraction
maps to a Problem is decomposed, and extraction on the overlapped function finds no decomposable
pair left. On this mesh a ring has 2 members, so its partial sums add in the all-reduce's order
and the results often match bit for bit; a wrong rewrite (operand, dimension, layout) does not.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest

from autotuner import GroupedProblem, Problem, Strategy, space
from autotuner.hlo import extract, extract_report
from autotuner.overlap import overlap
from autotuner.testing import STEP_FACTOR, TOLERANCE, relative_error

from .meshes import LAYERS as L

os.environ.setdefault("KERAS_BACKEND", "jax")   # before keras is first imported

pytestmark = pytest.mark.slow

NEEDS = {"keras_hub_llama": ("keras_hub",), "keras_hub_gemma": ("keras_hub",), "penzai_llama": ("penzai", "optax"),
         "flax_gpt": ("flax", "optax"), "equinox_gpt": ("equinox", "optax")}
MODELS = list(NEEDS)
# per block: (decomposable dots, problems) of forward_sp and of train_step_sp, and the dots of the
# forward's grouped gathers (each model's test module counts them by hand): the Llamas' gated MLP
# shares one gather between gate and up, the GPT-2 MLP of Flax's and Equinox's layers one up projection
LLAMA = {"forward_sp": (7, 4), "train_step_sp": (14, 11), "grouped": 5}
GPT2 = {"forward_sp": (6, 4), "train_step_sp": (12, 10), "grouped": 3}
PER_BLOCK = {"keras_hub_llama": LLAMA, "keras_hub_gemma": LLAMA, "penzai_llama": LLAMA,
             "flax_gpt": GPT2, "equinox_gpt": GPT2}
# whether some ring fits the default memory bound on the tiny training step: Equinox's step
# compiles to 0.03 MiB of temp memory per device, so +5% is 1.5 KiB and every ring (0.03-0.38 MiB
# predicted) is shed
BOUND_KEEPS = {"equinox_gpt": False}


def factory(model: str, name: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    for pkg in NEEDS[model]:
        pytest.importorskip(pkg, reason="install requirements-models.lock (`make test` does)")
    if model.startswith("keras_hub") and os.environ["KERAS_BACKEND"] != "jax":
        pytest.skip("the keras-hub model needs KERAS_BACKEND=jax")
    if jax.device_count() < 4:
        pytest.skip(f"needs 4 devices, have {jax.device_count()}")
    mod = importlib.import_module(f"tests.models.{model}")
    return getattr(mod, name)()


def first_ring(p: Problem) -> Strategy:
    return space(p)[1]


def last_ring(p: Problem) -> Strategy:
    return [s for s in space(p) if s.method == "ring"][-1]


# the whole-step tolerance of autotuner.testing (Adam amplifies reordered-sum rounding)


def assert_close(got: Any, want: Any, dtype: str = "float32") -> None:
    leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(leaves[0]) == len(leaves[1])
    tol = TOLERANCE[dtype] * STEP_FACTOR
    for a, b in zip(*leaves, strict=True):
        err = relative_error(a, b)
        assert err <= tol, f"relative error {err:.3g} > {tol:g}"


def run_forced(fn: Callable[..., Any], args: tuple[Any, ...], want: Any, occurrences: int, grouped: int,
               chooser: Callable[[Problem], Strategy], *, check_extract: bool) -> Any:
    """overlap(fn, strategy=chooser) equals plain jit, decomposes every mapped pair (as many as
    extraction counts on the plain program: `occurrences` dots, `grouped` of them in grouped
    gathers), and leaves no decomposable pair."""
    ov = overlap(fn, strategy=chooser, memory=None)
    plan = ov.plan(*args)
    applied = [r for r in plan if r.applied]
    mapped = [r for r in plan if r.problem is not None and r.source != "unmapped"]
    assert applied == mapped, "\n" + str(plan)
    assert sum(r.count for r in applied) == occurrences, "\n" + str(plan)
    assert all(r.strategy == chooser(r.problem) and r.source == "callable" for r in applied)
    # the dots of one all-gather run as their GroupedProblem's one ring, as extraction groups them
    assert grouped and sum(r.count for r in applied if r.member is not None) == grouped, "\n" + str(plan)
    assert all(isinstance(r.problem, GroupedProblem) for r in applied if r.member is not None)
    assert_close(ov(*args), want)
    # every all-gather of activations is gone (what is left gathers the loss's int32 indices): the
    # rings move the data, and where the gathered value has other users (the weight gradients
    # reuse the forward input and the output gradient) the ring's kept copy serves them
    hlo = ov.compiled(*args).as_text()
    left = re.findall(r"= (?:f32|bf16|f16)\[[^\]]*\]\S* all-gather(?:-start)?\(.*", hlo)
    assert not left, [line[:300] for line in left]
    if check_extract:
        left = extract_report(ov, *args)
        assert left.problems == [], [p.describe() for p, _ in left.problems]
    return plan


def check_one_name(plan: Any, report: Any) -> None:
    """A pair has one name: the plan names each pair as extraction names its problem's dots (a
    problem's name joins its dots' names with '+'; '#k' tells repeats apart)."""
    names = {p.key: re.sub(r"#\d+$", "", n) for (p, _), n in zip(report.problems, report.names, strict=True)}
    mapped = [r for r in plan if r.key in names]
    assert mapped, "\n" + str(plan)
    for r in mapped:
        if not names[r.key].endswith(" more"):
            assert r.name.split(" #")[0] in names[r.key].split("+"), (r.name, names[r.key])


def check_model(model: str, name: str, *, extract_each: bool) -> None:
    fn, args = factory(model, name)
    want = fn(*args)
    # a grouped gather (Q/K/V, gate/up) is one problem of k dots; the plan has a row per dot
    report = extract_report(fn, *args)
    found = report.problems
    occurrences = sum(c * len(getattr(p, "members", (p,))) for p, c in found)
    grouped = sum(c * len(p.members) for p, c in found if isinstance(p, GroupedProblem))
    dots, problems = PER_BLOCK[model][name]
    assert occurrences == dots * L
    assert sum(c for _, c in found) == problems * L

    base = overlap(fn, strategy="baseline")
    plan = base.plan(*args)
    assert plan and not any(r.applied for r in plan)
    check_one_name(plan, report)
    assert {r.source for r in plan if r.problem is not None} <= {"forced", "unmapped"}
    for a, b in zip(jax.tree.leaves(base(*args)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    strategies: set[str] = set()
    for i, chooser in enumerate((first_ring, last_ring)):
        plan = run_forced(fn, args, want, occurrences, grouped, chooser, check_extract=extract_each or i == 0)
        strategies |= {r.strategy.key for r in plan if r.applied}
    # two distinct strategies per pattern: rolled/unchunked, and chunked
    assert any("-c1-" in k for k in strategies) and any("-c4-" in k or "-c2-" in k for k in strategies)
    if name == "train_step_sp":
        check_memory(fn, args, want, BOUND_KEEPS.get(model, True))


def check_memory(fn: Callable[..., Any], args: tuple[Any, ...], want: Any, keeps: bool) -> None:
    """Under the default memory bound the plan reports both programs' temp bytes, as compiled, and
    the overlapped step stays within +5% of plain jit's (shedding kept gathers or rings if not);
    `keeps`: some ring fits (else every one is shed, and says so)."""
    from autotuner.overlap.memory import DEFAULT_BOUND

    ov = overlap(fn, strategy=first_ring)
    plan = ov.plan(*args)
    real = ov.compiled(*args).memory_analysis().temp_size_in_bytes
    assert plan.memory.plain_bytes == fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert plan.memory.overlapped_bytes == real
    assert real <= plan.memory.plain_bytes * (1 + DEFAULT_BOUND), "\n" + str(plan)
    if keeps:
        assert any(r.applied for r in plan), "\n" + str(plan)
    else:
        assert not any(r.applied for r in plan) and real == plan.memory.plain_bytes, "\n" + str(plan)
        assert all(r.note.startswith("the memory bound") for r in plan if r.source == "callable"), "\n" + str(plan)
    assert_close(ov(*args), want)


@pytest.mark.parametrize("model", MODELS)
def test_forward_sp_forced_strategies(model: str) -> None:
    check_model(model, "forward_sp", extract_each=True)


@pytest.mark.parametrize("model", MODELS)
def test_train_step_sp_forced_strategies(model: str) -> None:
    """The backward pairs (input gradients) are decomposed too; the weight gradients' gathers are
    not Problems (they also contract the data-sharded batch) and stay."""
    check_model(model, "train_step_sp", extract_each=False)


@pytest.mark.parametrize("model", MODELS)
def test_auto_applies_tuned_winners_of_grouped_and_single_problems(model: str, tmp_path: Any) -> None:
    """A snapshot with a confident ring winner for every problem extraction finds on the forward
    pass (grouped Q/K/V and gate/up, single attention-out and MLP-down): every pair runs it."""
    import json

    from autotuner import Device
    from autotuner.runtime.client import Client
    from autotuner.runtime.collective import DECISIONS

    fn, args = factory(model, "forward_sp")
    device = Device.current()
    found = extract(fn, *args)
    assert any(isinstance(p, GroupedProblem) for p, _ in found)
    entries = [{"problem_key": p.key, "device_key": device.key, "strategy": first_ring(p).to_dict(),
                "speedup": 1.3, "confidence": [1.1, 1.5], "record_id": i, "measured_at": None, "trials": 10}
               for i, (p, _) in enumerate(found)]
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps({"format": "autotuner-snapshot", "version": 1, "entries": entries}))
    DECISIONS.clear()
    try:
        ov = overlap(fn, memory=None, client=Client(offline=str(path), device=device))
        plan = ov.plan(*args)
        assert all(r.applied and r.source == "tuned" and r.speedup == 1.3 for r in plan), "\n" + str(plan)
        assert sum(r.count for r in plan if r.member is not None) == PER_BLOCK[model]["grouped"] * L  # q, k, v (gate, up)
        assert_close(ov(*args), fn(*args))
        assert extract_report(ov, *args).problems == []
    finally:
        DECISIONS.clear()


@pytest.mark.parametrize("name", ["forward_keras_hub", "train_step_keras_hub"])
def test_gemma_under_keras_hubs_own_layout(name: str) -> None:
    """keras-hub's own Gemma layout shards every kernel over data and model; GSPMD then moves
    activations over data, reduce-scattered out of a dot or gathered into its contraction
    (tests/models/test_keras_hub.py counts them). Both forced rings decompose every mapped pair,
    equal plain jit, and leave no decomposable pair; the pairs that also need an all-reduce over
    model keep their gathers."""
    fn, args = factory("keras_hub_gemma", name)
    want = fn(*args)
    occurrences = sum(c for _, c in extract(fn, *args))
    for chooser in (first_ring, last_ring):
        ov = overlap(fn, strategy=chooser, memory=None)
        plan = ov.plan(*args)
        applied = [r for r in plan if r.applied]
        assert applied == [r for r in plan if r.problem is not None and r.source != "unmapped"], "\n" + str(plan)
        assert sum(r.count for r in applied) == occurrences and {r.source for r in applied} == {"callable"}
        assert_close(ov(*args), want)
        assert extract_report(ov, *args).problems == []


@pytest.mark.tpu
def test_on_xla_tpu_the_tied_lm_head_under_keras_hubs_own_layout_is_decomposed(tpu_devices, tmp_path) -> None:
    """XLA:TPU folds the LM head's `transpose` of the tied embedding table (keras-hub's
    `ReversibleEmbedding`: `x @ table.T`) into the dot before its partitioner, so the Problem read
    from its HLO reads the table [vocab, hidden] itself (`abc,dc->abd`), not the traced
    transpose: the pair was unmapped ("the compiled dot's operand shapes differ"). The pass now
    decomposes it through the transpose (`overlap.dotview`; the numerics on CPU:
    tests/autotuner/overlap/test_swapped_operands.py), and the step compiles for the slice. libtpu
    logs no error on the way (off a Cloud TPU VM it did, for every load: `aot.quiet_libtpu`)."""
    import subprocess
    import sys
    from pathlib import Path

    tpu_devices("v5e:4x2")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "AUTOTUNER_DB"))}
    r = subprocess.run([sys.executable, "-m", "autotuner.cli", "plan", "tests.models.keras_hub_gemma:train_step_keras_hub",
                        "--mesh", '{"data": 2, "model": 4}', "--target", "aot:tpu:v5e:4x2",
                        "--strategy", "ring-uni-c1-ufull-loop-send", "--memory", "none"],
                       cwd=tmp_path, env={**env, "PYTHONPATH": str(Path(__file__).parents[2])},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    head = next((line for line in r.stdout.splitlines() if line.startswith("token_embedding ")), "")
    assert "ring-uni-c1-ufull-loop-send" in head and "forced" in head, r.stdout[-3000:]
    assert "18 of 27 pair(s) decomposed" in r.stdout and "operand shapes differ" not in r.stdout, r.stdout[-3000:]
    assert "INVALID_ARGUMENT" not in r.stderr, r.stderr[-3000:]   # libtpu's worker-hostname error (`quiet_libtpu`)
