"""The Problem: one sharded einsum on one logical mesh (parse, validate, classify, canonical key),
the problems files that hold them, and the built-in transformer suite. Pure data: no JAX."""

from __future__ import annotations

from autotuner.problem.core import (
    DTYPE_BYTES,
    DTYPES,
    Entry,
    Equation,
    Operand,
    Pattern,
    Problem,
    ProblemError,
    parse_equation,
    problem_key,
)
from autotuner.problem.grouped_problem import GroupedProblem, GroupPattern, problem_from_dict

__all__ = ["DTYPES", "DTYPE_BYTES", "Entry", "Equation", "GroupPattern", "GroupedProblem", "Operand", "Pattern",
           "Problem", "ProblemError", "parse_equation", "problem_from_dict", "problem_key"]
