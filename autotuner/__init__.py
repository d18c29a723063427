"""overlap-autotuner: per-shape choice of how to overlap a collective with its einsum.

Pure data (Problem, Strategy, Device) and the errors import without JAX; the functions and the
errors of the heavier rooms (`build`, `space`, `extract`, `collective_einsum`, `overlap`, ...) are imported
on first use, so `import autotuner` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from autotuner.device import Device, DeviceError
from autotuner.errors import AutotunerError, ServiceError
from autotuner.problem import GroupedProblem, Pattern, Problem, ProblemError, problem_key
from autotuner.strategy import Strategy, StrategyError

# public name -> the module that defines it, imported on first access
_LAZY = {
    "build": "autotuner.decompose",
    "space": "autotuner.decompose.space",
    "extract": "autotuner.hlo",
    "extract_report": "autotuner.hlo",
    "ExtractError": "autotuner.hlo",
    "collective_einsum": "autotuner.runtime.collective",
    "collective_einsums": "autotuner.runtime.grouped_collective",
    "DecisionError": "autotuner.runtime.collective",
    "overlap": "autotuner.overlap",
    "OverlapError": "autotuner.overlap",
    "Client": "autotuner.runtime.client",
    "ClientError": "autotuner.runtime.client",
    "ProblemsFileError": "autotuner.problem.problems_file",
    "load_problems": "autotuner.problem.problems_file",
    "TargetError": "autotuner.measure.targets",
    "LabError": "autotuner.lab.spec",
    "LabWorkerError": "autotuner.lab.spec",
    "CostModelError": "autotuner.costmodel.params",
}

__all__ = ["AutotunerError", "Device", "DeviceError", "GroupedProblem", "Pattern", "Problem", "ProblemError", "ServiceError",
           "Strategy", "StrategyError", "problem_key", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autotuner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # bind it over any submodule of the same name
    return value
