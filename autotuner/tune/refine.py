"""Refinement in the program: the isolated search's choices tried in the whole step.

The tuner times each problem alone; a step runs them together, and what a decomposition does
there (to the work around it, to the other collectives) is not what it does alone
(`bench-model --attribute` measures the difference). Refinement starts from the plan the
isolated winners give and, problem by problem (all occurrences together), times the step with
the current choice against the step with each candidate the isolated ranking put close to the
winner (and baseline), interleaved. A candidate replaces the current choice only when the step's
interval says it is faster (the ratio's lower bound above 1); the result is stored as evidence
for that (device, program, problem), whether it changed the choice or not, so a killed
refinement resumes where it stopped and the next `overlap` of the same program can rest on it.

`refine` is the loop; the step is a `Rig` (the program built on the target, in this process or
in every process of a lab): `variants(choices)` builds the steps to time and `time(reps)` times
plain, the plan and them interleaved. Candidates come from `close_candidates`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from autotuner.measure.stats import ratio_ci
from autotuner.rule import MIN_SPEEDUP_LO
from autotuner.strategy import Strategy

__all__ = ["Evidence", "RefineUnit", "Rig", "close_candidates", "refine"]


class Rig(Protocol):
    def variants(self, choices: list[dict[str, Strategy]]) -> list[set[str]]: ...

    def time(self, reps: int) -> list[list[float]]:
        """Samples of plain, the rig's plan, then each variant, interleaved."""
        ...


@dataclass(frozen=True)
class RefineUnit:
    """One problem of the program (all its occurrences), and what to try for it."""

    key: str
    name: str
    count: int
    candidates: tuple[Strategy, ...]   # besides the current choice; baseline among them


@dataclass(frozen=True)
class Evidence:
    """What the step said about one problem's choice: `strategy` is kept (the isolated choice,
    `previous`, unless a candidate was faster in the step beyond the interval); `speedup` is the
    step with the previous choice over the step with the best candidate tried, with its 95%
    interval; `tried` each candidate timed: its key and the step's speedup with it over the
    step with `previous` (`speedup`, `speedup_lo`, `speedup_hi`)."""

    problem_key: str
    strategy: Strategy
    previous: Strategy
    speedup: float | None
    speedup_lo: float | None
    speedup_hi: float | None
    reps: int
    tried: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def changed(self) -> bool:
        return self.strategy != self.previous


def close_candidates(measurements: Sequence[Any], current: Strategy, k: int = 2) -> tuple[Strategy, ...]:
    """Up to `k` strategies the isolated ranking put close to `current` (their ratio interval
    reaches its lower bound; best ratio first), then baseline, never `current` itself.
    `measurements`: records with `status`, `strategy` (a dict), `ratio`, `ratio_lo`, `ratio_hi`."""
    best: dict[str, Any] = {}
    for m in measurements:
        if m.status != "ok" or m.ratio is None:
            continue
        s = Strategy.from_dict(m.strategy)
        if s.is_baseline:
            continue
        if s.key not in best or m.ratio > best[s.key].ratio:
            best[s.key] = m
    cur = best.get(current.key)
    floor = cur.ratio_lo if cur is not None and cur.ratio_lo is not None else MIN_SPEEDUP_LO
    close = sorted((m for key, m in best.items() if key != current.key
                    and (m.ratio_hi if m.ratio_hi is not None else m.ratio) >= floor),
                   key=lambda m: -m.ratio)
    out = [Strategy.from_dict(m.strategy) for m in close[:k]]
    if not current.is_baseline:
        out.append(Strategy.baseline())
    return tuple(out)


def refine(rig: Rig, units: Sequence[RefineUnit], current: dict[str, Strategy], *, reps: int,
           stored: dict[str, Evidence], store: Callable[[Evidence], None],
           log: Callable[[str], None] = lambda m: None) -> tuple[dict[str, Strategy], list[Evidence]]:
    """The choices after refinement and the evidence of each unit, in order. Units with stored
    evidence are not timed again (their stored choice is applied). `current` (problem key ->
    Strategy; absent: baseline) is not modified."""
    choice = dict(current)
    out: list[Evidence] = []
    for i, u in enumerate(units, 1):
        prev = choice.get(u.key, Strategy.baseline())
        if u.key in stored:
            ev = stored[u.key]
            log(f"[{i}/{len(units)}] {u.name}: stored evidence, {ev.strategy.key} (not timed again)")
            choice[u.key] = ev.strategy
            out.append(ev)
            continue
        cands = [c for c in u.candidates if c != prev]
        if not cands:
            ev = Evidence(u.key, prev, prev, None, None, None, 0)
        else:
            log(f"[{i}/{len(units)}] {u.name} (x{u.count}): {prev.key} against "
                f"{', '.join(c.key for c in cands)} in the step")
            choices = [choice] + [{**choice, u.key: c} for c in cands]
            rig.variants(choices)
            _, _, base, *others = rig.time(reps)
            ratios = [ratio_ci(base, o) for o in others]
            j = max(range(len(others)), key=lambda x: ratios[x][0])
            sp, lo, hi = ratios[j]
            keep = cands[j] if (not math.isnan(lo) and lo > MIN_SPEEDUP_LO) else prev
            tried = tuple({"strategy_key": c.key, "speedup": r[0], "speedup_lo": _num(r[1]),
                           "speedup_hi": _num(r[2])} for c, r in zip(cands, ratios, strict=True))
            ev = Evidence(u.key, keep, prev, sp, _num(lo), _num(hi), reps, tried)
            log(f"    best {cands[j].key}: step {sp:.3f}x [{lo:.3f}, {hi:.3f}] -> "
                f"{'changed to ' + keep.key if keep != prev else 'kept ' + prev.key}")
        store(ev)
        choice[u.key] = ev.strategy
        out.append(ev)
    return choice, out


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x
