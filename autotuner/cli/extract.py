"""`autotuner extract`: find the sharded einsums of a JAX program and write a problems file.

Registers on the `autotuner` app (`autotuner.cli.common`). Progress and skipped pairs go to stderr; one line
(or, with --json, one JSON object) per problem goes to stdout.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from autotuner.cli.common import app, err, fail

HELP = """Extract the sharded einsums of a JAX program into a problems file for `autotuner tune`.

TARGET is MODULE:FUNCTION, MODULE a dotted module name or a path to a .py file (a file under the current directory is imported by its dotted name, so its relative imports work).

Without --args, FUNCTION is a factory returning (fn, args) or (fn, args, kwargs); it is called with --kwargs, plus mesh=(the --mesh as a jax Mesh) when --mesh is given and it takes a `mesh` parameter. Example: autotuner extract autotuner.examples.transformer:example --out problems.json

With --args SPEC, FUNCTION is the program itself, called with one abstract argument per SPEC item (no data needed). SPEC is a JSON list, or @FILE holding one, of objects {"shape": list of sizes, "dtype": "float32", "spec": one entry per dimension, null or a mesh axis name or a list of names}. The axes are those of --mesh (required), e.g. '{"model": 4}', built over the first devices.

The mesh (both forms) has Auto axis types: GSPMD propagates shardings through plain jnp code, as models written for `jax.jit` expect; --explicit gives Explicit axis types (sharding in types).

The program is compiled, not run, on in-process CPU devices (--devices, default the mesh size, else 8). Every skipped collective/dot pair is printed with its reason (-q: only their number). Each problem gets a readable name from the dots' op_name metadata (the model's name stack, e.g. self_attention/query; grad/ for a backward dot, #2 on repeats). The file is a JSON object with "problems", "counts" and "names" (what `autotuner tune --problems` reads) unless --out ends in .jsonl (problems only, one per line) or .yaml/.yml (a YAML list). Tune it on a target of the problems' mesh size, e.g. --target inproc:4. Counts are runs per program call: occurrences times the trip counts of enclosing scan/fori_loop loops.
"""


def _abstract_args(spec: Any, mesh: Any) -> list[Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    if not isinstance(spec, list):
        fail("--args: expected a JSON list of {shape, dtype, spec}")
    out = []
    for i, a in enumerate(spec):
        if not isinstance(a, dict) or "shape" not in a:
            fail(f"--args[{i}]: expected an object with 'shape' (and 'dtype', 'spec')")
        extra = sorted(set(a) - {"shape", "dtype", "spec"})
        if extra:
            fail(f"--args[{i}].{extra[0]}: unknown field (expected shape, dtype, spec)")
        shape = a["shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                                  for d in shape):
            fail(f"--args[{i}].shape: expected a list of positive integers")
        try:
            dtype = jnp.dtype(a.get("dtype", "float32"))
        except TypeError:
            fail(f"--args[{i}].dtype: unknown dtype {a.get('dtype')!r}")
        entries = a.get("spec", [None] * len(shape))
        if not isinstance(entries, list) or len(entries) != len(shape):
            fail(f"--args[{i}].spec: expected {len(shape)} entries (null, an axis name or a list of names)")
        pspec = PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])
        try:
            sharding = NamedSharding(mesh, pspec)
            sharding.shard_shape(tuple(shape))
        except (ValueError, TypeError) as e:
            fail(f"--args[{i}].spec: {e}")
        out.append(jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding))
    return out


def write_problems(path: Path, problems: list[tuple[Any, int]], source: str,
                   names: list[str] | None = None) -> None:
    """JSON object {source, counts, keys, names, problems} (default), JSONL of problems, or a YAML
    list, by suffix."""
    dicts = [p.to_dict() for p, _ in problems]
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        text = "".join(json.dumps(d) + "\n" for d in dicts)
    elif suffix in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(dicts, sort_keys=False)
    else:
        head = {"source": source, "counts": [c for _, c in problems], "keys": [p.key for p, _ in problems],
                "names": list(names) if names and len(names) == len(problems) else [None] * len(problems)}
        body = ",\n".join("  " + json.dumps(d) for d in dicts)
        text = json.dumps(head)[:-1] + ', "problems": [\n' + body + ("\n" if dicts else "") + "]}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _hint(explicit: bool, mesh: Any) -> str:
    if mesh is None or explicit:
        return ""
    return " (the mesh has Auto axis types; a program written for sharding in types needs --explicit)"


def _first_line(e: BaseException) -> str:
    return next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)[:500]


@app.command("extract", help=HELP)
def extract_cmd(
    target: Annotated[str, typer.Argument(metavar="MODULE:FUNCTION", help="the program or a factory")],
    out: Annotated[Path, typer.Option("--out", "-o", help="problems file to write")],
    args: Annotated[str | None, typer.Option("--args", help="JSON list (or @FILE) of {shape, dtype, "
                                             "spec}: TARGET is then the program itself")] = None,
    mesh: Annotated[str | None, typer.Option("--mesh", help='mesh axes, e.g. \'{"model": 4}\'')] = None,
    devices: Annotated[int | None, typer.Option("--devices", min=1, max=64,
                                                help="in-process CPU devices (default: mesh size or 8)")] = None,
    kwargs: Annotated[str | None, typer.Option("--kwargs", help="JSON object of keyword arguments "
                                               "for the factory")] = None,
    explicit: Annotated[bool, typer.Option("--explicit/--auto", help="mesh axis types: Explicit, or Auto "
                                           "(GSPMD-propagated, the default)")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="one JSON object per problem on stdout")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="count the skipped pairs, do not list them")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", hidden=True,
                                          help="accepted for compatibility: skipped pairs are listed by default")] = False,
    on: Annotated[str | None, typer.Option("--target", help="aot:tpu:TOPOLOGY: extract from XLA:TPU's "
                                           "partitioner for that slice (the program built on as many "
                                           "CPU devices, then re-laid there)")] = None,
) -> None:
    from autotuner.program.factory import ModelError, call_factory, import_target, make_mesh
    from autotuner.program.load import (
        aot_target,
        json_arg,
        parse_kwargs,
        parse_mesh,
        relaid,
        setup_devices,
    )

    shape = parse_mesh(mesh)
    if args is not None and shape is None:
        fail("--args needs --mesh (the axes its specs name)")
    aot = aot_target(on)
    n = devices or (math.prod(shape.values()) if shape else len(aot[1]) if aot else 8)
    if shape and math.prod(shape.values()) > n:
        fail(f"--mesh {shape} needs {math.prod(shape.values())} devices; --devices is {n}")
    fkw = parse_kwargs(kwargs)
    setup_devices(n)
    try:
        obj = import_target(target)
    except ModelError as e:
        fail(str(e))

    import jax

    from autotuner.hlo import ExtractError, extract_report

    jmesh = make_mesh(shape, explicit) if shape else None
    if args is not None:
        fn, fargs, fkwargs = obj, tuple(_abstract_args(json_arg(args, "--args"), jmesh)), {}
    else:
        try:
            prog = call_factory(obj, target, fkw, jmesh)
        except ModelError as e:
            fail(f"{e}; pass --args to treat the target as the program itself"
                 if "must return" in str(e) else str(e))
        fn, fargs, fkwargs = prog.fn, prog.args, prog.kwargs
    where = f"{n} in-process CPU devices"
    if aot is not None:
        fn, fargs, fkwargs, jmesh, dev = relaid(fn, fargs, fkwargs, jmesh, *aot)
        where = f"{dev.label} (XLA:TPU's partitioner, no TPU)"
    err.print(f"extracting {target} on {where}", highlight=False)
    try:
        if jmesh is not None:
            with jax.set_mesh(jmesh):
                report = extract_report(fn, *fargs, mesh=jmesh if args is not None else None, **fkwargs)
        else:
            report = extract_report(fn, *fargs, **fkwargs)
    except ExtractError as e:
        fail(" ".join(str(e).split()) + _hint(explicit, jmesh))
    except Exception as e:  # noqa: BLE001 - the user's program failed to lower or compile
        fail(f"{target}: compiling the program raised {type(e).__name__}: {_first_line(e)}{_hint(explicit, jmesh)}")
    names = report.names or [""] * len(report.problems)
    for (p, c), name in zip(report.problems, names, strict=True):
        if json_out:
            sys.stdout.write(json.dumps({"key": p.key, "name": name, "count": c, "pattern": p.pattern.label,
                                         "problem": p.to_dict()}) + "\n")
        else:
            sys.stdout.write(f"{c:>3}x  {name}  {p.describe()}  key {p.key[:12]}\n")
    sys.stdout.flush()
    write_problems(out, report.problems, target, report.names)
    total = sum(c for _, c in report.problems)
    err.print(f"{len(report.problems)} problem(s), {total} occurrence(s) from {report.pairs} "
              f"collective/dot pair(s) on mesh {report.mesh}; wrote {out}", highlight=False)
    if report.skipped:
        err.print(f"{len(report.skipped)} pair(s) skipped" + (" (without -q: each with its reason)" if quiet
                                                               else ":"), highlight=False)
        if not quiet:
            for where, why in report.skipped:
                err.print(f"  {where}: {why}", highlight=False, soft_wrap=True)
    if not report.problems:
        err.print("no all-gather -> einsum or einsum -> reduce-scatter pairs found; "
                  "`autotuner tune` needs at least one problem", highlight=False)
