"""Hook for a cost model's prediction (``source: "model"`` lookups).

:func:`model_answer` here answers ``None`` (no model: lookups go from ``nearest`` straight to
``default``). ``create_app`` plugs in the calibrated cost model,
``autotuner.costmodel.model_answer(database)``, unless it is given ``model=fn``: ``fn(problem, device)``
returning a :class:`ModelAnswer`, a ``(strategy, speedup)`` pair (the form of
``autotuner.costmodel.model_answer(database)``) or ``None``; the service checks that the
strategy can run the problem and never invents an answer itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autotuner import Device, Problem, Strategy


@dataclass(frozen=True)
class ModelAnswer:
    strategy: Strategy
    speedup: float
    confidence: tuple[float, float] | None = None


ModelFn = Callable[[Problem, Device], "ModelAnswer | tuple[Strategy, float] | None"]


def as_answer(got: object) -> ModelAnswer | None:
    """A model function's result as a :class:`ModelAnswer` (None stays None)."""
    if got is None or isinstance(got, ModelAnswer):
        return got
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], Strategy):
        return ModelAnswer(strategy=got[0], speedup=float(got[1]))
    raise TypeError(f"a cost model returned {got!r}; expected ModelAnswer, (Strategy, speedup) or None")


def model_answer(problem: Problem, device: Device) -> ModelAnswer | None:
    """The cost model's choice for ``problem`` on ``device``; ``None``: no model (yet)."""
    return None
