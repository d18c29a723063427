"""overlap-autotuner: per-shape choice of how to overlap a collective with its einsum.

Pure data (Problem, Strategy, Device) imports without JAX; `build` and `space` import it lazily.
"""

from __future__ import annotations

from typing import Any

from .device import Device, DeviceError
from .problem import Pattern, Problem, ProblemError, problem_key
from .strategy import Strategy, StrategyError

__all__ = ["Device", "DeviceError", "Pattern", "Problem", "ProblemError", "Strategy",
           "StrategyError", "build", "collective_einsum", "extract", "problem_key", "space"]


def __getattr__(name: str) -> Any:
    # Importing the submodule binds it as a package attribute; bind the function over it.
    if name == "build":
        from .strategies import build as fn
    elif name == "space":
        from .space import space as fn
    elif name == "extract":
        from .extract import extract as fn
    elif name == "collective_einsum":
        from .collective import collective_einsum as fn
    else:
        raise AttributeError(f"module 'autotuner' has no attribute {name!r}")
    globals()[name] = fn
    return fn
