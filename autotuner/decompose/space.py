"""The valid strategies for a problem on a device: invalid combinations are left out, never built."""

from __future__ import annotations

import itertools

from autotuner.device import Device
from autotuner.problem import GroupedProblem, Problem
from autotuner.strategy import CHUNKS, DIRECTIONS, FUSES, UNROLLS, Strategy, StrategyError


def space(problem: Problem | GroupedProblem, device: Device | None = None) -> list[Strategy]:
    """Every valid Strategy for `problem`, baseline first, the rings, then the compiler's own
    programs: `plain` (what plain jax.jit compiles the einsum to, on every platform) and
    `xla_windowed`; in a stable order.

    The ring decompositions are valid on every platform. `xla_windowed` (XLA's own windowed
    einsum, see `autotuner.decompose.xla`) is offered only when `device` names a platform whose
    compiler honours its options (gpu: with and without multi-streaming; tpu); never on CPU,
    which accepts the options and ignores them, nor when the device is unknown.
    A grouped problem (one gather feeding k einsums) gets the all-gather ring's knobs, each
    combination valid for every one of its einsums.
    """
    from autotuner.decompose import check_valid
    from autotuner.decompose.xla import MULTI_STREAM_PLATFORMS, PLATFORMS

    out = [Strategy.baseline()]
    if problem.pattern.kind == "none" or problem.axis_size == 1:
        return out  # nothing to communicate: a ring of one device is the baseline again
    fuses = FUSES if problem.pattern.kind == "all_gather" else ("loop",)
    for d, c, u, f, sf in itertools.product(DIRECTIONS, CHUNKS, UNROLLS, fuses, (True, False)):
        s = Strategy("ring", d, c, u, f, sf)
        try:
            check_valid(problem, s)
        except StrategyError:
            continue
        out.append(s)
    out.append(Strategy.plain())
    platform = device.platform if device is not None else None
    if platform in PLATFORMS:
        out.append(Strategy("xla_windowed"))
        if platform in MULTI_STREAM_PLATFORMS:
            out.append(Strategy("xla_windowed", multi_stream=True))
    return out
