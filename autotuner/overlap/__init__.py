"""The compiler pass `autotuner.overlap(fn)`, readable top-down:

- `api`    — `overlap` / `Overlapped`: per input signature, tag -> find -> choose -> apply -> plan;
- `apply`  — the jaxpr interpreter that tags every dot and replaces the chosen ones (`Action`);
- `find`   — compile the tagged program, map each collective/dot pair to its equation (`Site`),
             as the HLO has it (`dotview`: operands swapped, a transpose folded in);
- `choose` — the Strategy per site (client, forced, callable), shared gathers, never slower;
- `plan`   — what the pass did, one `PlanRow` per pair.

Imports no database, web or Optuna code. The package itself is callable (`autotuner.overlap(fn)`
works whether `autotuner.overlap` was first reached as this package or as the function).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from autotuner.overlap.api import OverlapError, Overlapped, overlap
from autotuner.overlap.plan import Plan, PlanRow

__all__ = ["OverlapError", "Overlapped", "Plan", "PlanRow", "overlap"]


class _CallableModule(types.ModuleType):
    def __call__(self, fn: Any = None, **kwargs: Any) -> Any:
        return overlap(fn, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
