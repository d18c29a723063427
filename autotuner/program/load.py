"""Loading a user's program for the commands that run a whole one (`plan`, `bench-model`):
MODULE:FACTORY, the factory returning (fn, args) or (fn, args, kwargs), called with --kwargs and,
when --mesh is given and it takes a `mesh` parameter, the mesh; the --mesh, --kwargs, --target and
--memory options parsed, and the size of the mesh a loaded program runs on (`mesh_size`).

The same rules as `autotuner extract`'s factory form; the command fails (`console.fail`) on a bad option.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from autotuner.program.console import fail, say

FACTORY_HELP = ("The argument is MODULE:FACTORY (MODULE a dotted module name or a path to a .py file); "
                "FACTORY returns (fn, args) or (fn, args, kwargs) and is called with --kwargs, plus "
                "mesh=(the --mesh as a jax Mesh) when --mesh is given and it takes a `mesh` parameter.")


def json_arg(text: str, what: str) -> Any:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as e:
            fail(f"{what}: cannot read {text[1:]}: {e.strerror or e}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        fail(f"{what}: invalid JSON: {e.msg} (column {e.colno})")


def parse_mesh(text: str | None) -> dict[str, int] | None:
    if text is None:
        return None
    m = json_arg(text, "--mesh")
    if (not isinstance(m, dict) or not m
            or not all(isinstance(k, str) and k.strip() and isinstance(v, int) and not isinstance(v, bool) and v > 0
                       for k, v in m.items())):
        fail('--mesh: expected an object of axis name -> size, e.g. {"model": 4}')
    return m


def setup_devices(n: int) -> None:
    """n in-process CPU devices (before JAX initialises), or check JAX has at least n."""
    from autotuner.measure.platforms import backends_started
    from autotuner.measure.targets import TargetError, prepare_inproc

    try:
        if not backends_started():
            prepare_inproc(n)
            return
        import jax

        have = jax.device_count()
    except Exception as e:  # noqa: BLE001
        fail(str(e) if isinstance(e, TargetError) else f"JAX could not start: {e}")
    if have < n:
        fail(f"needs {n} devices but JAX is already initialised with {have}")


def load_program(target: str, *, mesh: str | None, kwargs: str | None, explicit: bool,
                 devices: int | None = None) -> Any:
    """The factory's program (`program.factory.Program`), on `devices` in-process CPU devices
    (default: the mesh's size, else 8) unless JAX already runs."""
    from autotuner.program.factory import ModelError, load_factory

    shape = parse_mesh(mesh)
    fkw = parse_kwargs(kwargs)
    n = devices or (math.prod(shape.values()) if shape else 8)
    if shape and math.prod(shape.values()) > n:
        fail(f"--mesh {shape} needs {math.prod(shape.values())} devices; --devices is {n}")
    setup_devices(n)
    try:
        return load_factory(target, fkw, shape, explicit)
    except ModelError as e:
        fail(str(e))


def parse_kwargs(kwargs: str | None) -> dict[str, Any]:
    fkw = json_arg(kwargs, "--kwargs") if kwargs else {}
    if not isinstance(fkw, dict):
        fail("--kwargs: expected a JSON object")
    return fkw


def aot_target(text: str | None) -> tuple[Any, list[Any]] | None:
    """--target: None, or (the aot spec, its devices); the command fails on anything else."""
    if text is None:
        return None
    from autotuner.measure.aot import AotError, AotSpec, topology_devices

    try:
        spec = AotSpec.parse(text)
        return spec, topology_devices(spec)
    except AotError as e:
        fail(f"--target {text!r}: {e}" if "expected" in str(e) else str(e))
    raise AssertionError("unreachable")


def relaid(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: Any, spec: Any, devices: list[Any]
           ) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any, Any]:
    """A program built on CPU devices (`mesh`: the one it runs under, if any) moved onto an aot
    target's devices (`measure.relay`): (fn, abstract args, kwargs, the target's mesh where the
    program ran under one, the target's Device). The command fails, in one line, if it cannot be."""
    import contextlib

    import jax

    from autotuner.measure.aot import device_of
    from autotuner.measure.relay import relay

    try:
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            fn, args, kwargs, moved = relay(fn, args, kwargs, devices)
    except Exception as e:  # noqa: BLE001 - the user's program: say what failed, in one line
        fail(f"could not move the program onto {spec.text}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    if moved.size != len(devices):
        say(f"note: the program's mesh has {moved.size} of the target's {len(devices)} devices")
    return fn, args, kwargs, moved if mesh is not None else None, device_of(spec, devices)


MEMORY_HELP = ("how much the step's temp memory may grow over plain jit's: a fraction (default 0.05, "
               "+5%) or 'none'; past it the pass sheds kept gathers, then rings")


def memory_arg(text: str) -> float | None:
    """--memory: a growth fraction >= 0, or none."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        fail(f"--memory {text!r}: expected a growth fraction >= 0 (0.05 for +5%) or 'none'")
    return value


def mesh_size(prog: Any) -> int:
    """Devices of the mesh the program's arguments are laid out on (or --mesh), else all."""
    import jax
    from jax.sharding import NamedSharding

    if prog.mesh is not None:
        return int(prog.mesh.size)
    for leaf in jax.tree.leaves((prog.args, prog.kwargs)):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding):
            return int(sh.mesh.size)
    return jax.device_count()
