"""Where measurements run: `inproc:N`, `lab:TOPOLOGY:N[:RATE]` or `local`; and where nothing runs:
`aot:tpu:TOPOLOGY`, XLA:TPU's compile for a slice that is not here, with estimated times
(`autotuner.measure.aot`)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autotuner.device import Device
from autotuner.errors import AutotunerError
from autotuner.measure.platforms import backends_started, cpu_unless_chosen
from autotuner.problem import GroupedProblem, Problem


class TargetError(AutotunerError, ValueError):
    pass


@dataclass(frozen=True)
class Target:
    kind: str             # inproc | lab | local | aot
    n: int | None = None  # devices (inproc, lab)
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> Target:
        t = text.strip()
        if t == "local":
            return cls("local", None, t)
        if t.startswith("inproc:"):
            try:
                n = int(t.split(":", 1)[1])
            except ValueError:
                raise TargetError(f"target {text!r}: expected inproc:N with N a number of devices") from None
            if not 1 <= n <= 64:
                raise TargetError(f"target {text!r}: N must be between 1 and 64")
            return cls("inproc", n, t)
        if t.startswith("lab:"):
            from autotuner.lab import LabError, LabSpec

            try:
                spec = LabSpec.parse(t)
            except LabError as e:
                raise TargetError(str(e)) from None
            return cls("lab", spec.n, t)
        if t.startswith("aot:"):
            from autotuner.measure.aot import AotError, AotSpec

            try:
                return cls("aot", None, AotSpec.parse(t).text)
            except AotError as e:
                raise TargetError(str(e)) from None
        raise TargetError(f"target {text!r}: expected inproc:N, lab:TOPOLOGY:N:RATE (e.g. lab:shared:2:2gbit), "
                          "local or aot:tpu:TOPOLOGY (e.g. aot:tpu:v5e:2x4)")

    @property
    def estimates(self) -> bool:
        """Nothing runs on this target: its times are the compiler's estimates."""
        return self.kind == "aot"


def default_target(devices: int | None = None) -> str:
    """`local` where a GPU/TPU is present, else in-process CPU devices: `devices` (what the problems'
    mesh needs), else as many as XLA_FLAGS asks for, else 8 (a JAX already started: as many as it
    has). JAX starts its backends to tell, so the CPU's devices are asked for first (a GPU/TPU
    host's default backend is not the CPU's): asked after, the started JAX had 1 and `inproc:8`
    failed ("needs a fresh process") on every CPU host."""
    if not backends_started():
        have = re.search(rf"{HOST_DEVICES}(\d+)", os.environ.get("XLA_FLAGS", ""))
        _ask_host_devices(devices or (int(have.group(1)) if have else 8))
    try:
        import jax

        return "local" if jax.default_backend() != "cpu" else f"inproc:{jax.device_count()}"
    except Exception:  # noqa: BLE001 - a JAX that cannot start says so on the target itself
        return f"inproc:{devices or 8}"


def mesh_devices(problems: Sequence[Problem | GroupedProblem]) -> int | None:
    """The number of devices the problems' meshes need, where they all need the same."""
    sizes = {math.prod(s for _, s in p.mesh) for p in problems}
    return sizes.pop() if len(sizes) == 1 else None


def check_fits(problems: Sequence[Problem | GroupedProblem], target: Target) -> None:
    """TargetError where every problem's mesh needs another number of devices than the target
    has: each would fail alone (`TargetSession.check`; `tune` records each failure), so a run
    that makes its own problems (`tune-model`) says it once, before it starts."""
    n = mesh_devices(problems)
    if n is not None and target.n is not None and n != target.n:
        raise TargetError(f"the problems' mesh needs {n} devices; target {target.text} has {target.n}: give a "
                          f"target of {n} devices (e.g. inproc:{n})")


HOST_DEVICES = "--xla_force_host_platform_device_count="


def _ask_host_devices(n: int) -> None:
    """XLA_FLAGS asking for n CPU devices (read when JAX starts its backends), its other flags kept."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(HOST_DEVICES)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{HOST_DEVICES}{n}"])


def prepare_inproc(n: int) -> None:
    """In-process CPU devices must be asked for before JAX initialises its backend."""
    if backends_started():
        import jax

        if jax.device_count() != n and jax.default_backend() == "cpu":
            raise TargetError(f"JAX is already initialised with {jax.device_count()} devices; "
                              f"inproc:{n} needs a fresh process")
        return
    _ask_host_devices(n)
    cpu_unless_chosen()


class TargetSession:
    """An open target: its device fingerprint and a Runner per problem."""

    def __init__(self, target: Target, log: Callable[[str], None] | None = None, ctx: Any = None):
        """``ctx``: process 0's `WorkerContext` of a multi-process `local` run
        (`autotuner.measure.multiprocess`): every measurement then runs on all processes."""
        self.target, self.log = target, log or (lambda _m: None)
        self.lab: Any = None
        if ctx is not None and target.kind != "local":
            raise TargetError(f"a multi-process run measures on --target local, not {target.text}")
        if target.kind == "inproc":
            prepare_inproc(int(target.n or 1))
            self.device = Device.current(topology="inproc")
        elif target.kind == "aot":
            from autotuner.measure.aot import AotError, AotSpec, device_of, topology_devices

            spec = AotSpec.parse(target.text)
            try:
                self._aot_devices = topology_devices(spec)
            except AotError as e:
                raise TargetError(str(e)) from None
            self.device = device_of(spec, self._aot_devices)
        elif target.kind == "local":
            self.device = Device.current(topology="local")
            if ctx is not None:
                from autotuner.measure.lab_target import LabRunner
                from autotuner.measure.multiprocess import Leader

                self.lab = Leader(ctx, say=self.log)
                self._lab_runner = LabRunner(self.lab, log=self.log)
        else:
            from autotuner.lab import LabSpec
            from autotuner.measure.lab_target import LabRunner, open_lab

            spec = LabSpec.parse(target.text)
            self.lab = open_lab(spec, log=self.log)
            self.lab.start()
            self._lab_runner = LabRunner(self.lab, log=self.log)
            self.device = self._lab_runner.device()

    @property
    def num_devices(self) -> int:
        return self.device.num_devices

    @property
    def estimates(self) -> bool:
        return self.target.estimates

    def mesh(self, problem: Problem) -> Any:
        """The problem's mesh on this target's devices (the target's own on `aot`)."""
        import jax

        shape = tuple(s for _, s in problem.mesh)
        names = tuple(a for a, _ in problem.mesh)
        if self.target.kind == "aot":
            from autotuner.measure.aot import mesh_on

            return mesh_on(self._aot_devices, shape, names)
        return jax.make_mesh(shape, names, devices=jax.devices()[: math.prod(shape)])

    def check(self, problem: Problem) -> None:
        need = math.prod(s for _, s in problem.mesh)
        if need != self.num_devices:
            raise TargetError(f"the problem's mesh {problem.mesh_shape} needs {need} devices; target "
                              f"{self.target.text} has {self.num_devices}")

    def runner(self, problem: Problem) -> Any:
        self.check(problem)
        if self.lab is not None:
            return self._lab_runner
        if self.target.kind == "aot":
            from autotuner.measure.aot import AotRunner

            return AotRunner(self.mesh(problem))
        from autotuner.measure import LocalRunner

        return LocalRunner(self.mesh(problem))

    def close(self) -> None:
        if self.lab is not None:
            self.lab.close()
            self.lab = None

    def __enter__(self) -> TargetSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
