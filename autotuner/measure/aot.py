"""`aot:tpu:TOPOLOGY`: XLA:TPU's real compile for a TPU slice that is not here, and an estimate.

libtpu (`pip install "jax[tpu]==<jax's version>"`) compiles for a named topology without any TPU
(`jax.experimental.topologies.get_topology_desc`): `v5e:2x4`, `v5p:2x2x1`, `v4:2x2x1`, `v6e:2x2`,
whatever it accepts. `AotRunner` builds each strategy on a mesh of those devices, lowers it with
abstract arguments (`jax.ShapeDtypeStruct` with the problem's shardings), compiles it with
XLA:TPU's whole pipeline and reads the result: compiled or the compiler's reason, temp and
argument bytes on the target (`memory_analysis()`), and the schedule's estimate
(`autotuner.hlo.schedule`): the compiler's own per-op cycle estimates, the interconnect of that
generation, how much of each collective the schedule overlaps. Nothing runs, so nothing is
checked numerically here: the strategies are checked against `jnp.einsum` on CPU
(tests/autotuner/decompose), and these are the same programs. Its "times" are estimates: the
runner says so (`estimates = True`), a session gives them no interval, and what is stored from
this target is keyed by a device whose topology says `aot:` (`Device.estimated`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotuner.device import Device
from autotuner.errors import AutotunerError
from autotuner.measure.platforms import cpu_unless_chosen
from autotuner.measure.session import COMM, COMP
from autotuner.problem import GroupedProblem, Problem
from autotuner.strategy import Strategy

PLATFORMS = ("tpu",)
INSTALL = 'pip install "jax[tpu]==<the installed jax version>" (jax\'s tpu extra brings the matching libtpu)'


# how a session on this target runs: an estimate is one number, so one "repetition", no A/A twin,
# no repetitions for precision (`tune` and the search both apply it)
ESTIMATE_SESSION = {"reps": 1, "aa": False, "precision": None}


class AotError(AutotunerError, ValueError):
    pass


@dataclass(frozen=True)
class AotSpec:
    platform: str   # tpu
    topology: str   # e.g. v5e:2x4

    @classmethod
    def parse(cls, text: str) -> AotSpec:
        parts = text.strip().split(":", 2)
        if len(parts) != 3 or parts[0] != "aot" or parts[1] not in PLATFORMS or not parts[2]:
            raise AotError(f"target {text!r}: expected aot:tpu:TOPOLOGY, e.g. aot:tpu:v5e:2x4 or aot:tpu:v5p:2x2x1")
        return cls(parts[1], parts[2])

    @property
    def text(self) -> str:
        return f"aot:{self.platform}:{self.topology}"


def quiet_libtpu() -> None:
    """Before JAX first loads libtpu: it probes the host for a TPU when it loads, and naming an
    accelerator type stops most of that (its warnings about the missing chip remain); it also takes
    a lock file (/tmp/libtpu_lockfile) so that one process at a time owns the chips, which a
    compile-only use need not (JAX's own multi-process tests allow it the same way). Off a Cloud TPU
    VM libtpu finds no worker hostnames and logs an `E0000 ... INVALID_ARGUMENT: ... unexpected
    worker hostname` error with a source trace to stderr on every load; this host as the one worker
    stops that (the topologies' devices are the same: checked with v5e:4x2, v5p:2x2x2, v4:2x2x4, v6e:4x4)."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    cpu_unless_chosen()   # the slice is only compiled for: JAX itself runs on the CPU


def topology_devices(spec: AotSpec) -> list[Any]:
    """The target's devices (compile-only: arrays cannot be placed on them)."""
    quiet_libtpu()
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise AotError(f"{spec.text} needs libtpu, the XLA:TPU compiler: {INSTALL}") from None
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform=spec.platform, topology_name=spec.topology).devices)
    except Exception as e:  # noqa: BLE001 - libtpu's own message says what it accepts
        first = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise AotError(f"{spec.text}: libtpu does not know this topology: {first[:300]}") from None


def device_of(spec: AotSpec, devices: Sequence[Any]) -> Device:
    import jax
    import jaxlib

    return Device(platform=spec.platform, device_kind=str(devices[0].device_kind), num_devices=len(devices),
                  num_processes=1, topology=spec.text, jax_version=jax.__version__,
                  jaxlib_version=jaxlib.__version__)


def mesh_on(devices: Sequence[Any], shape: Sequence[int], names: Sequence[str]) -> Any:
    """A mesh of the target's devices as a user would make it (`jax.make_mesh`, which orders a
    TPU slice's devices along its physical rings); in id order where it refuses (v4's
    compile-only devices are TensorCores, two per chip, and make_mesh wants one per chip)."""
    import math

    import jax
    import numpy as np
    from jax.sharding import Mesh

    shape, names = tuple(int(s) for s in shape), tuple(names)
    devs = list(devices)[: math.prod(shape)]
    try:
        return jax.make_mesh(shape, names, devices=devs)
    except Exception:  # noqa: BLE001 - a layout make_mesh does not do
        return Mesh(np.array(devs, dtype=object).reshape(shape), names)


def abstract(shape: Sequence[int], dtype: Any, mesh: Any, spec: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding

    from autotuner.decompose._common import pspec

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, pspec(spec)))


class AotRunner:
    """A `measure.Runner` that compiles for the target and estimates; `time` returns the estimate."""

    estimates = True

    def __init__(self, mesh: Any):
        from autotuner.hlo.chips import chip_for
        from autotuner.hlo.schedule import placement_of

        self.mesh = mesh
        self.chip = chip_for(str(mesh.devices.flat[0].device_kind))
        self.placement = placement_of(list(mesh.devices.flat))
        self.times: dict[int | str, float] = {}

    def _args(self, problem: Problem | GroupedProblem, specs: Sequence[Any] | None = None) -> tuple[Any, ...]:
        import jax.numpy as jnp

        dt = jnp.dtype(problem.dtype)
        if isinstance(problem, GroupedProblem):
            ops = [problem.gathered, *problem.weights()]
        else:
            ops = [problem.lhs, problem.rhs]
        specs = specs if specs is not None else [o.spec for o in ops]
        return tuple(abstract(o.shape, dt, self.mesh, s) for o, s in zip(ops, specs, strict=True))

    def compile(self, fn: Any, args: tuple[Any, ...], options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Compile `fn` for the target and read it: a status dict as `prepare` gives one."""
        import jax

        from autotuner.hlo.schedule import estimate
        from autotuner.measure.local import _memory

        st: dict[str, Any] = {"ok": False, "reason": None, "compile_s": None, "memory": None, "rel_error": None,
                              "schedule": None}
        t0 = time.perf_counter()
        try:
            lowered = jax.jit(fn).lower(*args)
            compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        except Exception as e:  # noqa: BLE001 - a strategy the compiler refuses is a result
            first = next((x for x in str(e).splitlines() if x.strip()), "")
            st["reason"] = f"XLA:TPU did not compile it: {type(e).__name__}: {first}"[:2000]
            return st
        st["compile_s"] = time.perf_counter() - t0
        st["memory"] = _memory(compiled)
        est = estimate(compiled.as_text(), self.chip, self.placement)
        st["schedule"] = {**est.to_dict(), "estimated": True}
        st["seconds"] = est.estimated_s
        st["ok"] = True
        return st

    def prepare(self, problem: Problem | GroupedProblem, strategies: Sequence[Strategy], parts: bool = True
                ) -> list[dict[str, Any]]:
        from autotuner.decompose import build, build_parts, compiler_options

        self.times.clear()
        args = self._args(problem)
        statuses = []
        for i, s in enumerate(strategies):
            try:
                fn = build(problem, s, self.mesh)
            except Exception as e:  # noqa: BLE001
                statuses.append({"ok": False, "reason": f"{type(e).__name__}: {e}"[:2000], "compile_s": None,
                                 "memory": None, "rel_error": None})
                continue
            st = self.compile(fn, args, compiler_options(s, "tpu"))
            if st["ok"]:
                self.times[i] = st["seconds"]
            statuses.append(st)
        if parts and problem.pattern.kind != "none":
            comm, comp = build_parts(problem, self.mesh)
            for key, fn, a in ((COMM, comm, args), (COMP, comp, self._args(problem, self._comp_specs(problem)))):
                st = self.compile(fn, a)
                if st["ok"]:
                    self.times[key] = st["seconds"]
        return statuses

    @staticmethod
    def _comp_specs(problem: Problem | GroupedProblem) -> list[Any]:
        if isinstance(problem, GroupedProblem):
            from autotuner.decompose.grouped_allgather import compute_specs

            return list(compute_specs(problem))
        from autotuner.decompose.baseline import gathered_specs

        return list(gathered_specs(problem))

    def time(self, program: int | str) -> float:
        if program not in self.times:
            raise RuntimeError(f"program {program!r} was not compiled for the target")
        return self.times[program]
