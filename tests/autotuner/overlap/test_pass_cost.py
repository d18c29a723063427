"""What preparing the pass compiles (bench/pass_cost.py has the seconds): one analysis compile at
the backend's cheapest options, one compile of the rewritten program; nothing analysed there with
Explicit layouts; and with JAX's persistent compilation cache, a restarted job compiles nothing
for its analysis."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from autotuner import space
from autotuner.hlo import compile as hc
from autotuner.overlap import overlap


def _program(kind: str) -> tuple[Any, tuple[Any, Any]]:
    """x (sequence over model) @ w (columns over model): one all-gather -> dot pair."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    explicit = kind == "explicit"
    mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4],
                         axis_types=(AxisType.Explicit if explicit else AxisType.Auto,))
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).normal(size=(2, 64, 32)), jnp.float32),
                       NamedSharding(mesh, P(None, "model", None)))
    w = jax.device_put(jnp.asarray(np.random.default_rng(1).normal(size=(32, 128)), jnp.float32),
                       NamedSharding(mesh, P(None, "model")))

    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        if explicit:
            x = jax.reshard(x, NamedSharding(mesh, P()))
            return jnp.einsum("bsd,df->bsf", x, w, out_sharding=NamedSharding(mesh, P(None, None, "model")))
        return jax.lax.with_sharding_constraint(jnp.einsum("bsd,df->bsf", x, w),
                                                NamedSharding(mesh, P(None, None, "model")))

    return f, (x, w)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The options of every compile the pass's HLO reader makes (cheap analysis ones included)."""
    seen: list[dict[str, Any]] = []
    real = hc._compile

    def counting(lowered: Any, opts: Any, *, stops: bool = False) -> Any:
        seen.append(entry := {**opts, "stopped": False})   # in call order (the analysis runs in a thread)
        got = real(lowered, opts, stops=stops)
        entry["stopped"] = stops and got is None
        return got

    monkeypatch.setattr(hc, "_compile", counting)
    return seen


def _cheap(opts: dict[str, Any]) -> bool:
    return all(opts.get(k) == v for k, v in hc.ANALYSIS_OPTIONS["cpu"].items())


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_one_cheap_analysis_then_the_program_that_runs(kind: str, compiles: list[dict[str, Any]]) -> None:
    f, args = _program(kind)
    ov = overlap(f, strategy=lambda p: space(p)[1])
    plan = ov.plan(*args)
    assert [r.applied for r in plan] == [True], str(plan)
    # round 1: the tagged program, dumped around the partitioner at the cheapest options, its
    # compile stopped before code generation (XLA:CPU)
    assert _cheap(compiles[0]) and "xla_dump_to" in compiles[0] and compiles[0]["stopped"]
    assert not any(o["stopped"] for o in compiles[1:])
    if kind == "explicit":   # the rewritten program is compiled by jax alone, not analysed
        assert len(compiles) == 1
    else:                    # Auto layouts: compiled (at full options) and analysed for new pairs
        assert len(compiles) == 2 and not _cheap(compiles[1]) and "xla_dump_to" in compiles[1]
    # what preparing took, by phase (the plan says it, with the memory)
    c = plan.cost
    assert min(c.trace, c.analysis, c.reading, c.rewrite, c.compile) > 0 and c.tuning == 0, c
    assert f"prepared in {c.total:.2f} s (trace {c.trace:.2f}, analysis {c.analysis:.2f}" in str(plan)
    # the prepared executable runs without a compile on the first call, and equals plain jit
    before = len(compiles)
    np.testing.assert_allclose(np.asarray(ov(*args)), np.asarray(jax.jit(f)(*args)), rtol=1e-5, atol=1e-5)
    assert len(compiles) == before


def test_the_stopped_analysis_reads_what_a_full_compile_says() -> None:
    """The analysis compile that stops before code generation gives the partitioned HLO and the
    temp bytes a full compile of the same program gives (its buffer assignment, read from the dump)."""
    f, args = _program("auto")
    full = jax.jit(f).lower(*args)

    def stopped(*a: Any) -> Any:
        return f(*a), hc.analysis_stop()

    got = hc.partitioned_texts(jax.jit(stopped).lower(*args), analysis=True, stops=True)
    assert isinstance(got.temp, Future)   # read once partitioned: the compile went on in its thread
    want = hc.partitioned_texts(full, analysis=True)
    assert got.parts == want.parts == 4 and "all-gather" in got.post
    strip = lambda t: [ln for ln in t.splitlines() if "all-gather" in ln or " dot(" in ln]  # noqa: E731
    assert [ln.split("metadata")[0] for ln in strip(got.post)] == [ln.split("metadata")[0] for ln in strip(want.post)]
    assert got.temp_bytes == full.compile().memory_analysis().temp_size_in_bytes
    assert got.compiled is None


def test_the_partitioned_dump_is_read_only_when_whole(tmp_path: Any) -> None:
    """XLA writes a dump as it goes: the texts are read once the partitioned module's file holds
    its ENTRY computation (printed last) and that computation's closing brace."""
    whole = "HloModule m, num_partitions=4\n\n%add {\n  ROOT %a = f32[] add(f32[] %x, f32[] %y)\n}\n\n" \
            "ENTRY %main {\n  %p = f32[4]{0} parameter(0), sharding={replicated}\n  ROOT %c = f32[4]{0} copy(%p)\n}\n\n"
    path = tmp_path / "module_0001.jit_f.0001.spmd-partitioner.after_spmd-partitioning.before_x.txt"
    assert not hc._dumped_whole(str(tmp_path))                       # not dumped yet
    for cut in (whole.index("ENTRY"), whole.index("ENTRY") - 1, whole.index("sharding={replicated}") + 21,
                len(whole) - 5):
        path.write_text(whole[:cut])
        assert not hc._dumped_whole(str(tmp_path)), whole[:cut][-30:]
    path.write_text(whole)
    assert hc._dumped_whole(str(tmp_path))


def test_an_analysis_that_fails_before_the_partitioner_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    f, args = _program("auto")

    def failing(lowered: Any, opts: Any, *, stops: bool = False) -> Any:
        raise hc.ExtractError("could not compile the function: broken on purpose")

    monkeypatch.setattr(hc, "_compile", failing)
    with pytest.raises(hc.ExtractError, match="broken on purpose"):
        hc.partitioned_texts(jax.jit(f).lower(*args), analysis=True, stops=True)
    plan = overlap(f, strategy=lambda p: space(p)[1]).plan(*args)   # the pass: plain jit, and why
    assert list(plan) == [] and "could not be analysed" in plan.notes[-1] and "broken on purpose" in plan.notes[-1]


def test_nothing_to_rewrite_is_plain_jit(compiles: list[dict[str, Any]]) -> None:
    f, args = _program("explicit")
    ov = overlap(f, strategy="baseline")
    assert [r.applied for r in ov.plan(*args)] == [False]
    assert len(compiles) == 1 and _cheap(compiles[0])   # the analysis only: the cheap executable never runs
    assert "__overlap" not in ov.lower(*args).as_text()  # the program itself, untagged


def test_a_restarted_job_reads_its_analysis_from_the_persistent_cache(
        tmp_path: Any, compiles: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted job compiles nothing for its analysis and reads no HLO: the partitioned texts
    and the pairs found in them are kept beside JAX's persistent cache (a kept result that does
    not parse is read again from the texts)."""
    import autotuner.overlap.find as find

    parsed: list[int] = []
    real = find.parse_hlo
    monkeypatch.setattr(find, "parse_hlo", lambda text: parsed.append(1) or real(text))
    f, args = _program("auto")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    rows = lambda plan: [(r.name, r.key, r.strategy, r.source, r.count, r.note, r.member) for r in plan]  # noqa: E731
    try:
        first = overlap(f, strategy=lambda p: space(p)[1]).plan(*args)
        n_first = len(compiles)
        assert n_first >= 2 and all(_cheap(o) for o in compiles if "xla_dump_to" in o)
        kept = tmp_path / "autotuner-partitioned"
        assert list(kept.glob("*.json.gz")) and list(kept.glob("*.found-*.json")) and parsed
        jax.clear_caches()            # as a new process: JAX's in-memory caches are gone
        parsed.clear()
        second = overlap(f, strategy=lambda p: space(p)[1]).plan(*args)
        dumps = [o for o in compiles[n_first:] if "xla_dump_to" in o]
        assert dumps == [], "the restarted job compiled again for its analysis"
        assert parsed == [], "the restarted job read the HLO again"
        assert any(r.applied for r in second) and rows(second) == rows(first)
        for path in kept.glob("*.found-*.json"):
            path.write_text("{not json")
        jax.clear_caches()
        third = overlap(f, strategy=lambda p: space(p)[1]).plan(*args)
        assert parsed and rows(third) == rows(first)
    finally:
        from jax._src import compilation_cache

        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()   # JAX remembers the cache per process: back to none


def test_a_ring_that_recurs_is_built_once_and_full_collections_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers with the same problem: the ring is built (and traced) once and called at both
    dots (the rounds share it too); while the pass prepares, Python's full garbage collections
    wait (each walks every live object), and the thresholds are restored after."""
    import gc

    import autotuner.decompose as decompose

    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    xs = [jax.device_put(jnp.asarray(rng.normal(size=(2, 64, 32)), jnp.float32),
                         NamedSharding(mesh, P(None, "model", None))) for _ in range(2)]
    ws = [jax.device_put(jnp.asarray(rng.normal(size=(32, 128)), jnp.float32),
                         NamedSharding(mesh, P(None, "model"))) for _ in range(2)]
    out = NamedSharding(mesh, P(None, None, "model"))

    def f(x1: jax.Array, x2: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        a = jax.lax.with_sharding_constraint(jnp.einsum("bsd,df->bsf", x1, w1), out)
        return a + jax.lax.with_sharding_constraint(jnp.einsum("bsd,df->bsf", x2, w2), out)

    built, during = [], []
    real = decompose.build
    monkeypatch.setattr(decompose, "build", lambda *a, **k: built.append(a[:2]) or real(*a, **k))
    thresholds = gc.get_threshold()

    def choose(p: Any) -> Any:   # called while the pass prepares
        during.append(gc.get_threshold())
        return space(p)[1]

    ov = overlap(f, strategy=choose, memory=None)   # (two rings on a toy program grow its temp)
    plan = ov.plan(*xs, *ws)
    assert [r.applied for r in plan] == [True, True], str(plan)
    assert len({r.key for r in plan}) == 1 and len(built) == 1, built
    assert during and all(t[:2] == thresholds[:2] and t[2] >= 2**30 for t in during), during  # young ones only
    assert gc.get_threshold() == thresholds
    np.testing.assert_allclose(np.asarray(ov(*xs, *ws)), np.asarray(jax.jit(f)(*xs, *ws)), rtol=1e-5, atol=1e-5)
