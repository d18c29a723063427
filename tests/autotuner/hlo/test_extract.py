"""Extraction of sharded einsums from real programs (autotuner/extract.py, `autotuner extract`).

On the example transformer (Megatron tensor + sequence parallelism, 4-device `model` mesh) the
extracted set is exactly its QKV, attention-output, MLP-up and MLP-down projections; the same
Problems come out of the model's own projection calls, and building each one with the baseline
strategy on the model's operands reproduces the model's einsum. Runs on the 8 in-process CPU
devices of tests/conftest.py.
"""

from __future__ import annotations

import collections
import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import typer
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from typer.testing import CliRunner

import autotuner
from autotuner import Problem, Strategy
from autotuner.examples import transformer as T
from autotuner.hlo import (
    MeshInfo,
    extract,
    extract_from_hlo,
    extract_report,
    parse_hlo,
    parse_replica_groups,
    parse_sharding,
    tiling_spec,
)
from autotuner.problem.problems_file import load_problems

ROOT = Path(__file__).resolve().parents[3]


def needs(n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")


def expected(cfg: T.Config, n: int = 4) -> list[tuple[dict, str]]:
    """The four projections of one layer: (Problem dict, pattern label)."""
    B, S, D, H, K, F, a = cfg.batch, cfg.seq, cfg.d_model, cfg.heads, cfg.d_head, cfg.d_ff, cfg.axis
    mesh = {a: n}

    def prob(eq: str, ls: list, lspec: list, rs: list, rspec: list, ospec: list) -> dict:
        return {"equation": eq, "lhs": {"shape": ls, "spec": lspec}, "rhs": {"shape": rs, "spec": rspec},
                "out_spec": ospec, "dtype": cfg.dtype, "mesh": mesh}

    return [
        (prob("bsd,dthk->bsthk", [B, S, D], [None, a, None], [D, 3, H, K], [None, None, a, None],
              [None, None, None, a, None]), "all_gather:lhs:free"),                        # QKV
        (prob("bshk,hkd->bsd", [B, S, H, K], [None, None, a, None], [H, K, D], [a, None, None],
              [None, a, None]), "reduce_scatter:free_lhs"),                               # attention out
        (prob("bsd,df->bsf", [B, S, D], [None, a, None], [D, F], [None, a], [None, None, a]),
         "all_gather:lhs:free"),                                                          # MLP up
        (prob("bsf,fd->bsd", [B, S, F], [None, None, a], [F, D], [a, None], [None, a, None]),
         "reduce_scatter:free_lhs"),                                                      # MLP down
    ]


@pytest.fixture(scope="module")
def mesh4() -> jax.sharding.Mesh:
    needs(4)
    return T.make_mesh(4)


@pytest.fixture(scope="module")
def two_layers(mesh4):
    fn, args = T.example(mesh=mesh4, layers=2)
    return fn, args, extract_report(fn, *args)


def test_transformer_block_gives_exactly_its_four_projections(two_layers):
    _fn, _args, report = two_layers
    want = expected(T.Config())
    assert [(p.to_dict(), p.pattern.label, c) for p, c in report.problems] == [(d, lab, 2) for d, lab in want]
    assert report.pairs == 8 and report.skipped == []
    qkv, attn_out, up, down = (p for p, _ in report.problems)
    assert (qkv.pattern.operand, qkv.pattern.letter, qkv.pattern.axis) == ("lhs", "s", "model")
    assert (attn_out.pattern.letter, attn_out.pattern.contract) == ("s", "h")
    assert (up.pattern.letter, down.pattern.letter, down.pattern.contract) == ("s", "s", "f")


def test_same_problems_as_the_models_own_calls_and_baseline_reproduces_them(two_layers, mesh4):
    """Run the model eagerly with a recording projection: every call's layout is a Problem;
    the extracted set is that set with the calls' multiplicities, and build(baseline) on the
    call's operands gives the call's result."""
    _fn, (params, x), report = two_layers
    cfg = T.Config(layers=2)
    calls: list[tuple[Problem, jax.Array, jax.Array, jax.Array]] = []

    def recording(eq, lhs, rhs, out_spec):
        y = T.plain_proj(eq, lhs, rhs, out_spec)
        calls.append((T.layout_problem(eq, lhs, rhs, out_spec, mesh4), lhs, rhs, y))
        return y

    T.forward(params, x, cfg, mesh4, proj=recording)
    assert len(calls) == 4 * cfg.layers
    by_key = collections.Counter(p.key for p, *_ in calls)
    assert {p.key: c for p, c in report.problems} == dict(by_key)
    baseline = Strategy()
    for p, _count in report.problems:
        _, lhs, rhs, y = next(c for c in calls if c[0].key == p.key)
        got = jax.jit(autotuner.build(p, baseline, mesh4))(lhs, rhs)
        assert got.shape == y.shape
        assert got.sharding.spec == NamedSharding(mesh4, y.sharding.spec).spec
        np.testing.assert_allclose(np.asarray(got), np.asarray(y), rtol=1e-5, atol=1e-5)
        ref = np.einsum(p.equation, np.asarray(lhs), np.asarray(rhs))
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)


def test_identical_layers_merge_and_loops_count_their_trips(mesh4):
    cfg = T.Config(layers=3)
    params, x = T.example_args(cfg, mesh4)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *params)

    def scanned(stacked, x):
        return jax.lax.scan(lambda h, p: (T.block(p, h, cfg, mesh4), None), x, stacked)[0]

    got = extract(scanned, stacked, x)
    assert [(p.to_dict(), c) for p, c in got] == [(d, 3) for d, _ in expected(cfg)]


def test_two_axis_mesh_keeps_the_data_axis():
    needs(8)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    cfg = T.Config(layers=1, batch_axis="data")
    params, x = T.example_args(cfg, mesh)
    got = extract(jax.jit(functools.partial(T.forward, cfg=cfg, mesh=mesh)), params, x)
    assert [p.pattern.label for p, _ in got] == [lab for _, lab in expected(cfg)]
    for (p, c), (d, _) in zip(got, expected(cfg), strict=True):
        assert c == 1 and p.mesh_shape == {"data": 2, "model": 4}
        assert p.lhs.spec[0] == ("data",) and p.out_spec[0] == ("data",)
        assert p.lhs.shape == tuple(d["lhs"]["shape"]) and p.rhs.spec == Problem.from_dict(
            {**d, "mesh": {"data": 2, "model": 4}}).rhs.spec


def test_device_order_of_the_mesh_does_not_matter():
    needs(4)
    devs = np.array(jax.devices()[:4])[::-1]
    mesh = jax.sharding.Mesh(devs, ("model",), axis_types=(AxisType.Explicit,))
    fn, args = T.example(mesh=mesh, layers=1)
    assert [(p.to_dict(), c) for p, c in extract(fn, *args)] == [(d, 1) for d, _ in expected(T.Config())]


def test_bfloat16_model(mesh4):
    fn, args = T.example(mesh=mesh4, layers=1, dtype="bfloat16")
    got = extract(fn, *args)
    assert [(p.to_dict(), c) for p, c in got] == [(d, 1) for d, _ in expected(T.Config(dtype="bfloat16"))]


def test_programs_without_pairs_give_an_empty_list(mesh4):
    assert extract(lambda a, b: a @ b, jnp.ones((8, 8)), jnp.ones((8, 8))) == []
    assert autotuner.extract(lambda a, b: a @ b, jnp.ones((8, 8)), jnp.ones((8, 8))) == []  # the contract name
    a = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh4, P("model", None)))
    b = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh4, P()))
    assert extract(lambda a, b: jnp.tanh(a @ b), a, b) == []
    # a plain all-reduce (contracting dim sharded, result replicated) is not a pair: skipped, said why
    a2 = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh4, P(None, "model")))
    b2 = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh4, P("model", None)))
    rep = extract_report(lambda a, b: jnp.einsum("sf,fd->sd", a, b, out_sharding=NamedSharding(mesh4, P())),
                         a2, b2)
    assert rep.problems == [] and len(rep.skipped) == 1 and "all-reduce" in rep.skipped[0][1]


def test_auto_sharding_program_and_rhs_gather(mesh4):
    """GSPMD-propagated (Auto) layouts, and a gathered weight (FSDP-like: rhs contracting dim)."""
    amesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    put = lambda shape, spec: jax.device_put(jnp.ones(shape), NamedSharding(amesh, P(*spec)))  # noqa: E731

    def mlp(x, w1, w2):
        h = jax.lax.with_sharding_constraint(x @ w1, NamedSharding(amesh, P(None, "model")))
        return jax.lax.with_sharding_constraint(h @ w2, NamedSharding(amesh, P("model", None)))

    got = extract(mlp, put((64, 32), ("model", None)), put((32, 64), (None, "model")),
                  put((64, 32), ("model", None)))
    assert [(p.pattern.label, p.lhs.shape, p.rhs.shape, c) for p, c in got] == [
        ("all_gather:lhs:free", (64, 32), (32, 64), 1), ("reduce_scatter:free_lhs", (64, 64), (64, 32), 1)]

    def fsdp(x, w):
        return jnp.einsum("sd,df->sf", x, jax.reshard(w, NamedSharding(mesh4, P())))

    xs = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh4, P("model", None)))
    ws = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh4, P("model", None)))
    (p, c), = extract(fsdp, xs, ws)
    assert (p.equation, p.pattern.label, c) == ("sd,df->sf", "all_gather:rhs:contracting", 1)
    assert p.rhs.spec == (("model",), ())


def test_shard_map_dots_are_skipped_not_crashed(mesh4):
    p = Problem.from_dict(expected(T.Config())[2][0])
    rep = extract_report(autotuner.build(p, Strategy(), mesh4), jnp.ones(p.lhs.shape), jnp.ones(p.rhs.shape),
                         mesh=mesh4)
    assert rep.problems == [] and rep.skipped and "shard_map" in rep.skipped[0][1]


# -- the HLO readers, on hand-written text ------------------------------------------------------------

PRE = """HloModule m, num_partitions=4

ENTRY %main (a: f32[64,128], b: f32[128,32]) -> f32[64,32] {
  %a = f32[64,128]{1,0} parameter(0), sharding={devices=[1,4]<=[4]}
  %b = f32[128,32]{1,0} parameter(1), sharding={devices=[4,1]<=[4]}
  ROOT %dot.1 = f32[64,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, sharding={devices=[4,1]<=[4]}, metadata={op_name="jit(f)/sf,fd->sd/dot_general"}
}
"""

POST = """HloModule m, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main_spmd (a: f32[64,32], b: f32[32,32]) -> f32[16,32] {
  %a = f32[64,32]{1,0} parameter(0), sharding={devices=[1,4]<=[4]}
  %b = f32[32,32]{1,0} parameter(1), sharding={devices=[4,1]<=[4]}
  %dot = f32[64,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/sf,fd->sd/dot_general"}
  ROOT %rs = f32[16,32]{1,0} reduce-scatter(%dot), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, to_apply=%add
}
"""


def test_native_reduce_scatter_form():
    """The form GPU/TPU emit (XLA:CPU emits all-reduce + dynamic-slice instead)."""
    rep = extract_from_hlo(PRE, POST, {"x": 4})
    (p, c), = rep.problems
    assert c == 1 and p.to_dict() == {
        "equation": "sf,fd->sd", "lhs": {"shape": [64, 128], "spec": [None, "x"]},
        "rhs": {"shape": [128, 32], "spec": ["x", None]}, "out_spec": ["x", None],
        "dtype": "float32", "mesh": {"x": 4}}
    assert extract_from_hlo(PRE, POST, MeshInfo(("x",), (4,))).problems == rep.problems
    # the same dot feeding an all-reduce whose result is used whole is an all-reduce, not a pair
    ar = POST.replace("f32[16,32]{1,0} reduce-scatter(%dot)", "f32[64,32]{1,0} all-reduce(%dot)")
    ar = ar.replace("-> f32[16,32]", "-> f32[64,32]").replace(", dimensions={0}", "")
    skipped = extract_from_hlo(PRE, ar, {"x": 4})
    assert skipped.problems == [] and "used whole" in skipped.skipped[0][1]


def _collective(groups: str, n: int) -> np.ndarray | None:
    text = (f"HloModule m, num_partitions={n}\n\nENTRY %e (p: f32[8]) -> f32[64] {{\n"
            f"  %p = f32[8]{{0}} parameter(0)\n"
            f"  ROOT %g = f32[64]{{0}} all-gather(%p), channel_id=1, replica_groups={groups}, "
            f"dimensions={{0}}, use_global_device_ids=true\n}}\n")
    mod = parse_hlo(text)
    return parse_replica_groups(mod.instrs["g"], n)


def test_replica_group_formats():
    mesh = MeshInfo(("data", "model"), (2, 4))
    by_model = [[0, 1, 2, 3], [4, 5, 6, 7]]
    by_data = [[0, 4], [1, 5], [2, 6], [3, 7]]
    cases = {
        "{{0,1,2,3},{4,5,6,7}}": by_model,
        "[2,4]<=[8]": by_model,
        "[4,2]<=[2,4]T(1,0)": by_data,
        "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}": by_model,
        "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}": by_data,
        "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}": by_model,
        "mesh['a'=8] {'a':(2)4}": by_model,
        "{}": [list(range(8))],
    }
    for text, want in cases.items():
        groups = _collective(text, 8)
        assert groups is not None and groups.tolist() == want, text
    assert mesh.group_axes(np.array(by_model)) == ("model",)
    assert mesh.group_axes(np.array(by_data)) == ("data",)
    assert mesh.group_axes(np.array([list(range(8))])) == ("data", "model")
    assert mesh.group_axes(np.array([[0, 1, 4, 5], [2, 3, 6, 7]])) is None  # not whole axes


def test_sharding_formats():
    mesh = MeshInfo(("data", "model"), (2, 4))
    cases = {
        "{devices=[1,4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}": ((), ("model",), ()),
        "{devices=[2,1,1,4]<=[8] last_tile_dim_replicate}": (("data",), (), ()),
        "{devices=[8,1,1]<=[2,4]T(1,0)}": (("model", "data"), (), ()),
        "{devices=[2,4,1]<=[8]}": (("data",), ("model",), ()),
        "{replicated}": ((), (), ()),
        "{devices=[2,4,1]0,1,2,3,4,5,6,7 metadata={op_name=\"x\"}}": (("data",), ("model",), ()),
    }
    for text, want in cases.items():
        t = parse_sharding(text, 3, 8)
        assert t is not None and tiling_spec(t, mesh) == want, text
    assert parse_sharding("{devices=[1,4,2]<=[8] last_tile_dim_replicate}", 3, 8) is None  # rank 2, not 3
    manual = parse_sharding("{devices=[2,1,1,4]<=[8] last_tile_dims={manual}}", 3, 8)
    assert manual is not None and manual.manual and tiling_spec(manual, mesh) is None


# -- the command --------------------------------------------------------------------------------------

def _app() -> typer.Typer:
    import autotuner.cli.extract  # noqa: F401 - registers `extract` on the app
    from autotuner.cli.common import app

    return app


def test_cli_factory_writes_a_problems_file(tmp_path, mesh4):
    out = tmp_path / "problems.json"
    res = CliRunner().invoke(_app(), ["extract", "autotuner.examples.transformer:example", "--out", str(out),
                                      "--mesh", '{"model": 4}', "--kwargs", '{"layers": 1}', "--json",
                                      "--explicit"])   # the example shards in types
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    want = expected(T.Config())
    assert [(r["problem"], r["pattern"], r["count"]) for r in rows] == [(d, lab, 1) for d, lab in want]
    loaded = load_problems(out)
    assert [p.to_dict() for p in loaded] == [d for d, _ in want]
    doc = json.loads(out.read_text())
    assert doc["counts"] == [1, 1, 1, 1] and len(doc["names"]) == 4 and all(doc["names"])
    assert [r["name"] for r in rows] == doc["names"]


def test_cli_auto_is_the_default_and_says_how_to_get_explicit(tmp_path, mesh4, monkeypatch):
    """A program written for sharding in types (it reads its operand's layout from its type, as
    `jnp.einsum(..., out_sharding=...)` code does) on the default (Auto) mesh: one line naming
    --explicit. (The example transformer runs on both since it constrains on an Auto mesh.)"""
    (tmp_path / "typed.py").write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P

        def program(mesh):
            x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("model", None)))
            def f(x):
                (row, _) = tuple(jax.typeof(x).sharding.spec) + (None, None)
                if row != "model":
                    raise ValueError("the layout is not in the type")
                return x * 2
            return f, (x,)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    res = CliRunner().invoke(_app(), ["extract", "typed:program", "--out", str(tmp_path / "p.json"),
                                      "--mesh", '{"model": 4}'])
    assert res.exit_code == 2 and "Auto axis types" in res.output and "--explicit" in res.output, res.output
    assert "Traceback" not in res.output


def test_cli_path_form_with_relative_imports(tmp_path, monkeypatch, mesh4):
    pkg = tmp_path / "mymodels"
    pkg.mkdir()
    (pkg / "shapes.py").write_text("SHAPE = [2, 64, 32]\n")
    (pkg / "mlp.py").write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from .shapes import SHAPE

        def factory(mesh):
            x = jax.device_put(jnp.ones(SHAPE), NamedSharding(mesh, P(None, "model", None)))
            w = jax.device_put(jnp.ones((32, 128)), NamedSharding(mesh, P(None, "model")))
            return jax.jit(lambda x, w: jnp.einsum("bsd,df->bsf", x, w)), (x, w)
    """))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "p.json"
    res = CliRunner().invoke(_app(), ["extract", "mymodels/mlp.py:factory", "--mesh", '{"model": 4}', "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert len(load_problems(out)) == 1
    monkeypatch.chdir(pkg)   # the package is not importable from inside it: a one-line error
    res = CliRunner().invoke(_app(), ["extract", str(pkg / "mlp.py") + ":factory", "--mesh", '{"model": 4}',
                                      "--out", str(out)])
    assert res.exit_code == 2 and "relative imports" in res.output and "Traceback" not in res.output


def test_cli_args_spec_writes_jsonl(tmp_path, mesh4):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent("""
        import jax.numpy as jnp

        def mlp(x, w1, w2):
            return jnp.einsum("bsf,fd->bsd", jnp.einsum("bsd,df->bsf", x, w1), w2)
    """))
    spec = [{"shape": [2, 64, 32], "spec": [None, "model", None]},
            {"shape": [32, 128], "dtype": "float32", "spec": [None, "model"]},
            {"shape": [128, 32], "spec": ["model", None]}]
    out = tmp_path / "p.jsonl"
    res = CliRunner().invoke(_app(), ["extract", f"{prog}:mlp", "--args", json.dumps(spec), "--mesh",
                                      '{"model": 4}', "--out", str(out)])
    assert res.exit_code == 0, res.output
    loaded = load_problems(out)
    assert len(loaded) == 2 and all(p.pattern.kind == "all_gather" for p in loaded)
    assert len([ln for ln in res.stdout.splitlines() if "x  " in ln]) == 2
    bad = CliRunner().invoke(_app(), ["extract", f"{prog}:mlp", "--args", "[{}]", "--mesh", '{"model": 4}',
                                      "--out", str(out)])
    assert bad.exit_code == 2 and "--args[0]" in bad.output


def test_cli_fresh_process_sets_up_its_devices(tmp_path):
    """In a fresh process the command asks for the mesh's in-process devices before JAX starts."""
    out = tmp_path / "p.yaml"
    code = "import sys\nfrom autotuner.cli import main\nsys.argv = ['autotuner'] + sys.argv[1:]\nmain()\n"
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    res = subprocess.run([sys.executable, "-c", code, "extract", "autotuner.examples.transformer:example",
                          "--out", str(out), "--mesh", '{"model": 4}', "--kwargs", '{"layers": 1}', "--explicit"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "on 4 in-process CPU devices" in res.stderr
    assert len(load_problems(out)) == 4


def test_cli_lists_skipped_pairs_with_reasons_by_default(tmp_path, mesh4):
    """Issue 14 item 5: a program with only an all-reduce (contracting dim sharded, result used
    whole) has no problem; `extract` says which pair was skipped and why without -v, and -q keeps
    only the number."""
    prog = tmp_path / "ar.py"
    prog.write_text(textwrap.dedent("""
        import jax.numpy as jnp

        def down(x, w):
            return jnp.tanh(jnp.einsum("sf,fd->sd", x, w))
    """))
    spec = [{"shape": [16, 32], "spec": [None, "model"]}, {"shape": [32, 8], "spec": ["model", None]}]
    base = ["extract", f"{prog}:down", "--args", json.dumps(spec), "--mesh", '{"model": 4}',
            "--out", str(tmp_path / "p.json")]
    res = CliRunner().invoke(_app(), base)
    assert res.exit_code == 0, res.output
    assert "1 pair(s) skipped:" in res.output and "all-reduce" in res.output, res.output
    quiet = CliRunner().invoke(_app(), [*base, "-q"])
    assert quiet.exit_code == 0, quiet.output
    assert "1 pair(s) skipped" in quiet.output and "all-reduce" not in quiet.output, quiet.output


# XLA:TPU's module around its partitioner keeps a shard_map's body as a called computation
# (Shardy's export names it), laid out manual before the partitioner and `_spmd` after it; its
# dots are inside shard_map as much as those of an inlined body next to SPMDFullToShardShape.
_CALLED_BODY = """HloModule m, num_partitions=2

%xla.sdy.inlinable_manual_computation_body.3 (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body_spmd_inner (c: f32[4,2]) -> f32[4,2] {
  ROOT %c = f32[4,2]{1,0} parameter(0)
}

%xla.sdy.inlinable_manual_computation_body.3_spmd (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  %dot.2 = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %inner = f32[4,2]{1,0} call(%dot.2), to_apply=%body_spmd_inner
}

%manual_by_layout (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  ROOT %dot.3 = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%plain_callee (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  ROOT %dot.4 = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[4,8], w: f32[8,2]) -> f32[4,2] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,2]{1,0} parameter(1)
  %s1 = f32[4,2]{1,0} call(%x, %w), to_apply=%xla.sdy.inlinable_manual_computation_body.3
  %s2 = f32[4,2]{1,0} call(%x, %w), to_apply=%xla.sdy.inlinable_manual_computation_body.3_spmd
  %s3 = f32[4,2]{1,0} call(%x, %w), to_apply=%manual_by_layout, sharding={manual}
  %s4 = f32[4,2]{1,0} call(%x, %w), to_apply=%plain_callee
  ROOT %t = (f32[4,2], f32[4,2], f32[4,2], f32[4,2]) tuple(%s1, %s2, %s3, %s4)
}
"""


def test_shard_map_bodies_xla_calls_rather_than_inlines_are_manual() -> None:
    from autotuner.hlo.evaluate import manual_computations
    from autotuner.hlo.text import parse_hlo

    got = manual_computations(parse_hlo(_CALLED_BODY))
    assert got == {"xla.sdy.inlinable_manual_computation_body.3", "xla.sdy.inlinable_manual_computation_body.3_spmd",
                   "body_spmd_inner", "manual_by_layout"}


# (x's layout, w's, the dot's result's, what the reason names): both operands gathered right before
# the dot (the activation over model, the weight's contraction over data), or the activation
# gathered and the weight resharded from rows to columns over model (an all-to-all). keras-hub's own
# Llama layout does both in its backward attention.
TWO_COLLECTIVES = {
    "both gathered": (P("model", None), [P("data", None)], P(), "(lhs), all-gather"),
    "gathered and resharded": (P("model", None), [P("model", None), P(None, "model")], P(None, "model"),
                               "its rhs arrives through all-to-all"),
}


@pytest.mark.parametrize("case", list(TWO_COLLECTIVES))
def test_a_dot_with_two_collectives_is_skipped_for_that_reason_by_extraction_and_the_pass(case: str):
    """No Problem has two collectives, and extraction and the pass say so for the dot's pairs, with
    the same words (`hlo.problems.several`; the pass said "the propagated shardings do not give the
    partitioned dot's per-device shapes" before, and so did extraction for the resharded weight)."""
    from autotuner.overlap import overlap

    xs, ws, outs, names = TWO_COLLECTIVES[case]
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    layout = lambda v, spec: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))  # noqa: E731

    def fn(x, w):
        for spec in ws:
            w = layout(w, spec)
        return layout(layout(x, xs) @ w, outs)

    fn = jax.jit(fn)
    x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, xs))
    w = jax.device_put(jnp.ones((32, 48)), NamedSharding(mesh, ws[0]))
    report = extract_report(fn, x, w)
    why = [reason for _, reason in report.skipped]
    assert report.problems == [] and why and len(set(why)) == 1, why
    assert why[0].startswith("the dot has 2 collectives of its own") and names in why[0], why
    plan = overlap(fn, strategy="plain", memory=None).plan(x, w)
    assert [(r.source, r.note) for r in plan] == [("unmapped", why[0])] * len(why), "\n" + str(plan)
