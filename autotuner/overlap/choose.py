"""Choose: per site (a pair, or the group of dots one all-gather feeds), the Strategy to apply.

`"auto"` asks the client through `collective_einsum`'s decision table (one per process; in a
multi-process job process 0 decides and every process applies the same plan) and applies only a
`tuned` winner whose speedup interval lies above 1.0 (never slower by default); a forced Strategy
applies wherever `space(problem)` offers it; a callable `Problem -> Strategy` chooses per unit.
A shared all-gather (its value also used elsewhere) is run by the first unit's ring, which keeps
the gathered value for the other users (`Action.keep`); a second unit on it is "served".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from autotuner.answer import Answer
from autotuner.overlap.apply import Action
from autotuner.overlap.dotview import DotInfo
from autotuner.overlap.find import Site
from autotuner.overlap.plan import PlanRow
from autotuner.problem import GroupedProblem, Problem
from autotuner.rule import (  # auto: a winner applies only if its interval clears it
    EXACT_SOURCES,
    MIN_SPEEDUP_LO,
)
from autotuner.strategy import Strategy, StrategyError

BASELINE = Strategy.baseline()


def _relayout(p: Problem, info: DotInfo) -> str | None:
    """With explicit layouts: why the decomposition would keep a collective outside it."""
    for what, chain, spec in (("lhs", info.lhs_chain, p.lhs.spec), ("rhs", info.rhs_chain, p.rhs.spec)):
        if chain and chain[0] is not None and spec not in chain:
            return (f"the {what} reaches the dot already laid out otherwise (its relayout is outside "
                    "the dot's jaxpr), so its collective would stay")
    if info.out_spec is not None and info.out_spec != p.out_spec:
        if p.out_spec not in info.out_relayouts:
            return "the result is not relaid out to the reduce-scatter's layout next to the dot"
        if info.out_used_as_is or any(s != p.out_spec for s in info.out_relayouts):
            return "the unscattered result is used too, so it would be gathered back"
    return None


def _valid(problem: Problem | GroupedProblem, s: Strategy, platform: str | None = None) -> str | None:
    from autotuner.decompose import check_valid
    from autotuner.decompose.xla import PLATFORMS, flags

    if s.method == "xla_windowed":
        if platform == "tpu":   # tests/autotuner/measure/test_aot.py: the options force nothing more
            how = ("plain jit runs it, and XLA:TPU windows the pair there when its own policy says so; "
                   f"forcing it ({flags(s, platform)}) windowed no pair more in this project's checks")
        elif platform in PLATFORMS:
            how = f"compile the step with {flags(s, platform)} for XLA's own decomposition"
        else:
            how = f"XLA:{(platform or 'this backend').upper()} has no windowed einsum"
        return f"{s.key} is a whole-program compile option, not a per-pair rewrite: {how}"
    try:
        check_valid(problem, s)
    except StrategyError as e:
        return f"{s.key} does not apply to this problem ({e})"
    return None


def applies(s: Strategy, leave: Strategy) -> bool:
    """Whether the pass rewrites a pair for `s`: a ring always; the hand-written baseline where the
    pair left alone is not the baseline (`leave` is plain on TPU, where XLA:TPU may window the pair
    itself in plain jit: a baseline chosen there is applied, so that XLA does not)."""
    return s.rewrites or (s.is_baseline and not leave.is_baseline)


def _decide(mode: str, chosen: Any, client: Any, site: Site, evidence: dict[str, Any] | None = None,
            leave: Strategy = BASELINE, platform: str | None = None, shared: bool = True
            ) -> tuple[Strategy, str, float | None, str, bool, Answer | None]:
    """(strategy, source, predicted speedup, note, keep, answer) for one site's unit (its group,
    or its pair); keep: the gathered value has other users, which the ring's kept copy serves;
    answer: the decision table's answer `auto` chose from (None for the other modes and for
    in-program evidence).
    `evidence`: in-program evidence for this program (problem key -> the client's answer), which
    `auto` prefers to the isolated winner. `leave`: what a pair the pass leaves alone runs
    (`autotuner.strategy.reference` of the platform)."""
    from autotuner.runtime.collective import decisions_for

    p = site.unit
    speedup = None
    note = ""
    d: Answer | None = None
    ev = (evidence or {}).get(p.key) if mode == "auto" else None
    if ev is not None:
        s, source = ev["strategy"], "in-program"
        note = in_program_note(ev)
    elif mode == "one":
        s, source = chosen, "forced"
    elif mode == "callable":
        s, source = _call(chosen, p)
        if isinstance(s, str):
            s, note = leave, s
    else:
        d = decisions_for(client).decide(p, client, shared)
        s, source, speedup = d.strategy, d.source, d.speedup
        ci = d.confidence
        if s != leave and (s.rewrites or source in EXACT_SOURCES or not s.is_baseline):
            if source not in EXACT_SOURCES:
                s, note = leave, f"{d.strategy.key} is a {source} answer, not tuned: {leave.key}"
            elif ci is None or ci[0] <= MIN_SPEEDUP_LO:
                s, note = leave, (f"{d.strategy.key}'s speedup interval "
                                  f"{list(ci) if ci else 'is unknown'}: {leave.key}")
        elif s != leave:
            s = leave   # a default answer (the baseline): the pair stays as the user wrote it
    if s != leave:
        why = _valid(p, s, platform)
        if why is not None:
            s, note = leave, why
    keep = False
    if applies(s, leave):
        why, keep, kept = _keeping(site, s)
        note = kept or note
        if why is not None and mode == "auto":
            s, note = leave, why + f": {leave.key}"
        elif why is not None:
            note = why
    return s, source, (speedup if s != leave else None), note, keep, d


def _keeping(site: Site, s: Strategy) -> tuple[str | None, bool, str]:
    """(why the decomposition would leave a collective outside it, or None; whether its ring keeps
    the gathered value for the gather's other users; the note that says so)."""
    members = [(site.problem, site.info)] if site.group is None else list(
        zip(site.group.members, site.infos, strict=True))
    why = next((w for q, info in members if (w := _relayout(q, info)) is not None), None)
    if why is not None or site.extra_users == 0:
        return why, False, ""
    used = f"its all-gather's value is also used by {site.extra_users} other instruction(s)"
    if site.view.transposes(site.problem.pattern.operand):
        return f"{used}, in the layout of a transpose that XLA folds into this dot, so the gather would stay", False, ""
    if s.method == "ring" and site.problem.pattern.kind == "all_gather":
        return None, True, f"{used}: the ring keeps the gathered value for them"
    return f"{used} (a shared gather), so the gather would stay", False, ""


def in_program_note(ev: dict[str, Any]) -> str:
    """What a choice resting on in-program evidence says: what was timed in the step, and how."""
    s, prev = ev["strategy"], ev["previous"]
    sp, ci = ev.get("speedup"), ev.get("confidence")
    timed = (f"; the step with {s.key if s != prev else 'the best candidate'} ran {sp:.3f}x"
             + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "") + f" against {prev.key}") if sp else ""
    return ("in-program evidence (tune-model): " + (f"changed from {prev.key}" if s != prev else "kept") + timed)


def choose(mode: str, chosen: Any, client: Any, sites: list[Site | None], rows: list[PlanRow],
           evidence: dict[str, Any] | None = None, leave: Strategy = BASELINE, platform: str | None = None,
           shared: bool = True) -> tuple[dict[str, Action], list[PlanRow]]:
    """({tag: Action} to apply, the rows with their choices). The dots of a group get one choice,
    made for their GroupedProblem. `evidence`, `leave`: see `_decide`; `platform`: the mesh's, whose
    flags an xla_windowed choice's note names; `shared=False`: an auto lookup is this process's own
    (in a multi-process job the pass agrees on the whole plan instead, `overlap.agree`)."""
    actions: dict[str, Action] = {}
    out = []
    made: dict[tuple[str, ...], tuple[Strategy, str, float | None, str, bool, Answer | None]] = {}
    owner: dict[str, tuple[tuple[str, ...], str]] = {}   # all-gather -> (the unit whose ring runs it, its name)
    served_by: dict[tuple[str, ...], str] = {}
    for site, row in zip(sites, rows, strict=True):
        if site is None:
            out.append(row)
            continue
        unit = site.tags or (site.tag,)
        first = owner.get(site.collective) if site.collective else None
        if (unit not in made and first is not None and first[0] != unit and made[first[0]][0].rewrites
                and _parent(first[0][0]) == _parent(site.tag)):
            # one all-gather feeding dots of two units (forward dot and weight gradient on a mesh
            # without a data axis): the first unit's ring keeps the gathered value, which serves
            # this dot as it is (a second ring would move the data again); the interpreter hands
            # it over within one jaxpr
            src = made[first[0]][1]
            made[unit] = (leave, src, None,
                          f"served by the gathered value that the ring of {first[1]} keeps", False, None)
            served_by[unit] = first[1]
        if unit not in made:
            made[unit] = _decide(mode, chosen, client, site, evidence, leave, platform, shared)
            if site.collective and site.collective not in owner and made[unit][0].rewrites:
                owner[site.collective] = (unit, row.name)
        s, source, speedup, note, keep, answer = made[unit]
        if applies(s, leave):
            actions[site.tag] = Action(site.unit, s, site.tags, keep=keep, strict=keep and mode == "auto",
                                        view=site.view)
        if row.note and note:
            note = f"{row.note}; {note}"
        out.append(replace(row, strategy=s, source=source, speedup=speedup, note=note or row.note,
                           served_by=served_by.get(unit, ""), left=leave.method, answer=answer))
    return actions, out


def _parent(tag: str) -> str:
    """The jaxpr a tagged dot is in (its tag less its own position)."""
    return tag.rsplit("_", 1)[0] if "_" in tag else ""


def _call(fn: Callable[[Problem], Any], p: Problem) -> tuple[Strategy | str, str]:
    try:
        got = fn(p)
    except Exception as e:  # noqa: BLE001 - a user callback: this pair stays baseline
        return f"the strategy callable raised {type(e).__name__}: {e}", "callable"
    if isinstance(got, dict):
        try:
            got = Strategy.from_dict(got)
        except StrategyError as e:
            return f"the strategy callable returned an invalid strategy: {e}", "callable"
    if got is None:
        return Strategy.baseline(), "callable"
    if not isinstance(got, Strategy):
        return f"the strategy callable returned {type(got).__name__}, not a Strategy", "callable"
    return got, "callable"
