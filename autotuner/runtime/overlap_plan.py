"""`overlap`'s planning: find the pairs of a tagged program, map them to equations, choose; and
the plan it shows (`PlanRow`, `Plan`).

Kept apart from `overlap.py` (the API) and `overlap_interp.py` (the jaxpr interpreter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autotuner.hlo.compile import compile_with_hlo
from autotuner.hlo.grouped import group_units
from autotuner.hlo.mapping import map_pairs
from autotuner.hlo.shardings import MeshInfo
from autotuner.hlo.text import ExtractError
from autotuner.problem import GroupedProblem, Problem
from autotuner.runtime.overlap_interp import TAG_PREFIX, Action, DotInfo, Interpreter
from autotuner.strategy import Strategy, StrategyError

log = logging.getLogger("autotuner.runtime.overlap")
MIN_SPEEDUP_LO = 1.0   # auto: a tuned winner applies only if its speedup interval lies above this


@dataclass(frozen=True)
class PlanRow:
    """One decomposable pair of the program and what the pass does with it."""

    name: str                 # the dot's name stack, e.g. transpose(jvp(bsd,df->bsf))
    where: str                # user source of the einsum (file:line (function))
    form: str                 # the collective as compiled: all-gather | reduce-scatter | all-reduce+dynamic-slice
    problem: Problem | GroupedProblem | None   # a GroupedProblem for each dot of a shared gather
    strategy: Strategy        # what runs (baseline: the plain jit equation)
    source: str               # forced | callable | tuned | nearest | model | default | unmapped | ...
    speedup: float | None     # predicted speedup of the pair (baseline time / its time), if known
    count: int                # runs per call of the program
    note: str = ""            # why baseline, or anything to know
    member: int | None = None  # the dot's index in its GroupedProblem (None: a single problem)
    served_by: str = ""       # the pair whose ring keeps this dot's gathered operand for it (its collective is gone)

    @property
    def key(self) -> str | None:
        return self.problem.key if self.problem is not None else None

    @property
    def applied(self) -> bool:
        return not self.strategy.is_baseline

    @property
    def saving(self) -> float | None:
        """Predicted fraction of the pair's time saved (1 - 1/speedup), if known."""
        return None if not self.speedup else 1.0 - 1.0 / self.speedup


class Plan(list[PlanRow]):
    """The rows of `Overlapped.plan`; `notes`: what concerns the whole program; `str()`: a table."""

    def __init__(self, rows: Any = (), notes: Any = ()) -> None:
        super().__init__(rows)
        self.notes: list[str] = list(notes)

    def __str__(self) -> str:
        head = ("pair", "problem", "collective", "strategy", "source", "speedup", "x", "note")
        rows = [head]
        for r in self:
            rows.append((r.name, (r.key or "-")[:12], r.form, r.strategy.key, r.source,
                         f"{r.speedup:.2f}" if r.speedup else "-", str(r.count), r.note))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
                 for row in rows]
        n = sum(r.applied for r in self)
        return "\n".join(lines + [f"{n} of {len(self)} pairs decomposed"] + [f"note: {t}" for t in self.notes])


@dataclass(frozen=True)
class Site:
    """A pair mapped to its dot equation. The dots of one all-gather that feeds several of them
    form a group: each member's site has the GroupedProblem and every member's tag."""

    tag: str
    problem: Problem
    info: DotInfo
    other_users: int    # all-gather: other instructions its gathered value reaches
    collective: str = ""  # the collective's instruction name in the analysed module
    group: GroupedProblem | None = None
    tags: tuple[str, ...] = ()          # the group's dots, in member order
    infos: tuple[DotInfo, ...] = ()

    @property
    def unit(self) -> Problem | GroupedProblem:
        """What is chosen for and applied: the group, else the pair's Problem."""
        return self.group if self.group is not None else self.problem

    @property
    def extra_users(self) -> int:
        """Users of the gathered value that are not dots of this unit."""
        return self.other_users - (len(self.tags) - 1 if self.group is not None else 0)


def _tag(op_name: str) -> str | None:
    i = op_name.rfind(TAG_PREFIX)
    if i < 0:
        return None
    rest = op_name[i + len(TAG_PREFIX):]
    j = rest.find("__")
    return rest[:j] if j > 0 else None


def _readable(op_name: str) -> str:
    parts = [p for p in op_name.split("/") if not p.startswith(TAG_PREFIX)]
    if parts and parts[0].startswith("jit("):
        parts = parts[1:]
    if parts and parts[-1] == "dot_general":
        parts = parts[:-1]
    return "/".join(parts) or op_name


def mismatch(info: DotInfo, p: Problem) -> str | None:
    """Why the traced dot is not the Problem's einsum (None when it is, operand for operand)."""
    if info.dtypes != (p.dtype,) * 3:
        return (f"the dot computes {info.dtypes[2]} from {info.dtypes[0]}/{info.dtypes[1]} operands "
                f"(preferred_element_type); the decompositions compute in the operand type")
    if info.lhs_shape != p.lhs.shape or info.rhs_shape != p.rhs.shape or info.out_shape != p.out_shape:
        return "the compiled dot's operand shapes differ from the traced equation's"
    eq = p.eq
    (lc, rc), (lb, rb) = info.dims
    if any(eq.lhs[i] != eq.rhs[j] for i, j in zip(lc + lb, rc + rb, strict=True)):
        return "the compiled dot's dimension numbers differ from the traced equation's"
    if any(eq.lhs[i] in eq.out for i in lc):
        return "the compiled dot's contracting dimensions differ from the traced equation's"
    shared = {eq.lhs[i] for i in lc + lb}
    lfree = [c for i, c in enumerate(eq.lhs) if i not in lc and i not in lb]
    rfree = [c for j, c in enumerate(eq.rhs) if j not in rc and j not in rb]
    if (len(shared) != len(set(eq.lhs) & set(eq.rhs))
            or "".join([eq.lhs[i] for i in lb] + lfree + rfree) != eq.out):
        return "the compiled dot's output order differs from the traced equation's"
    return None


def _row(name: str, where: str, form: str, problem: Problem | None, source: str, count: int,
         note: str) -> Any:
    return PlanRow(name, where, form, problem, Strategy.baseline(), source, None, count, note)


def find_sites(tagged: Any, tagger: Interpreter, args: Sequence[Any], kwargs: dict[str, Any],
               mesh: Any, seen: set[str]) -> tuple[list[Site | None], list[Any], list[str], Any]:
    """(sites, rows, notes, compiled): per pair of the partitioned program not `seen` before (by tag, or
    op_name for untagged dots; `seen` is updated), its Site (None where the pair cannot be
    decomposed) and its plan row (baseline for now, or why it stays baseline). Pairs inside
    shard_map are left out once the pass has rewritten the program (they are its own rings).
    `compiled`: the executable of `tagged` (None if it could not be compiled)."""
    notes: list[str] = []
    try:
        pre, post, parts, compiled = compile_with_hlo(tagged, *args, **kwargs)
    except ExtractError as e:
        notes.append(f"the program could not be analysed, so it runs as plain jit: {e}")
        log.warning("overlap: %s", notes[-1])
        return [], [], notes, None
    if parts <= 1 or not post:
        return [], [], ["the program runs on one device: nothing to decompose"], compiled
    info = MeshInfo(tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes))
    mapped, _ = map_pairs(pre, post, info)
    for path, why in tagger.failed.items():
        notes.append(f"equation {path}: {why}")
    sites: list[Site | None] = []
    rows: list[Any] = []
    this_round: set[str] = set()
    mapped_tags: set[str] = set()
    pairs: list[tuple[Any, int]] = []   # (pair, its site's index) of the mapped pairs
    for m in mapped:
        op = m.pair.dot.op_name
        tag = _tag(op)
        if tagger.actions and m.reason and m.reason.startswith("inside shard_map"):
            continue
        ident = tag or f"{op}|{m.pair.form}|{m.pair.dot.name}"
        if ident in seen and ident not in this_round:
            continue   # planned in an earlier round
        seen.add(ident)
        this_round.add(ident)
        dot = tagger.infos.get(tag) if tag else None
        name = dot.name if dot and dot.name else _readable(op)
        where = dot.where if dot else ""
        why = m.reason
        if why is None and dot is None:
            why = "no traced dot_general carries this dot's name (it was not rebuilt by the pass)"
        if why is None and tag in mapped_tags:
            why = "the same dot as another pair (one decomposition per dot)"
        if why is None:
            assert m.problem is not None and dot is not None and tag is not None
            why = mismatch(dot, m.problem)
        if why is not None:
            sites.append(None)
            rows.append(_row(name, where, m.pair.form, m.problem, "unmapped", m.times, why))
            continue
        assert m.problem is not None and dot is not None and tag is not None
        mapped_tags.add(tag)
        sites.append(Site(tag, m.problem, dot, m.other_users,
                          m.pair.collective.name if m.pair.kind == "all_gather" else ""))
        rows.append(_row(name, where, m.pair.form, m.problem, "", m.times, ""))
        pairs.append((m.pair, len(sites) - 1))
    sites, rows = _grouped(sites, rows, pairs)
    return sites, rows, notes, compiled


def _grouped(sites: list[Site | None], rows: list[Any], pairs: list[tuple[Any, int]]
             ) -> tuple[list[Site | None], list[Any]]:
    """The sites of the dots one all-gather feeds, made members of their GroupedProblem (as
    extraction groups them: `hlo.grouped.group_units`); the others unchanged."""
    by_pair = {id(pair): i for pair, i in pairs}
    units = group_units([(pair, sites[i].problem, rows[i].count) for pair, i in pairs])  # type: ignore[union-attr]
    for unit, unit_pairs, _ in units:
        if not isinstance(unit, GroupedProblem):
            continue
        idx = [by_pair[id(q)] for q in unit_pairs]
        members = [sites[i] for i in idx]
        assert all(m is not None for m in members)
        tags = tuple(m.tag for m in members)  # type: ignore[union-attr]
        infos = tuple(m.info for m in members)  # type: ignore[union-attr]
        for j, i in enumerate(idx):
            sites[i] = replace(sites[i], group=unit, tags=tags, infos=infos)  # type: ignore[type-var]
            rows[i] = replace(rows[i], problem=unit, member=j,
                              note=f"dot {j + 1} of the {unit.k} its all-gather feeds (one grouped problem)")
    return sites, rows


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


def _valid(problem: Problem | GroupedProblem, s: Strategy) -> str | None:
    from autotuner.strategies import check_valid

    if s.method == "xla_windowed":
        return "xla_windowed is a whole-program compile option, not a per-pair rewrite"
    try:
        check_valid(problem, s)
    except StrategyError as e:
        return f"{s.key} does not apply to this problem ({e})"
    return None


def _decide(mode: str, chosen: Any, client: Any, site: Site
            ) -> tuple[Strategy, str, float | None, str, bool]:
    """(strategy, source, predicted speedup, note, keep) for one site's unit (its group, or its
    pair); keep: the gathered value has other users, which the ring's kept copy serves."""
    from autotuner.runtime.collective import DECISIONS

    p = site.unit
    speedup = None
    note = ""
    if mode == "baseline":
        s, source = Strategy.baseline(), "forced"
    elif mode == "one":
        s, source = chosen, "forced"
    elif mode == "callable":
        s, source = _call(chosen, p)
        if isinstance(s, str):
            s, note = Strategy.baseline(), s
    else:
        d = DECISIONS.decide(p, client)
        s, source, speedup = d.strategy, d.source, d.speedup
        ci = d.confidence
        if not s.is_baseline:
            if source != "tuned":
                s, note = Strategy.baseline(), f"{d.strategy.key} is a {source} answer, not tuned: baseline"
            elif ci is None or ci[0] <= MIN_SPEEDUP_LO:
                s, note = Strategy.baseline(), (f"{d.strategy.key}'s speedup interval "
                                                f"{list(ci) if ci else 'is unknown'}: baseline")
    if not s.is_baseline:
        why = _valid(p, s)
        if why is not None:
            s, note = Strategy.baseline(), why
    keep = False
    if not s.is_baseline:
        members = [(site.problem, site.info)] if site.group is None else list(
            zip(site.group.members, site.infos, strict=True))
        why = next((w for q, info in members if (w := _relayout(q, info)) is not None), None)
        if why is None and site.extra_users > 0:
            if s.method == "ring" and site.problem.pattern.kind == "all_gather":
                keep = True   # the ring also yields the gathered value for the other users
                note = (f"its all-gather's value is also used by {site.extra_users} other "
                        "instruction(s): the ring keeps the gathered value for them")
            else:
                why = (f"its all-gather's value is also used by {site.extra_users} other instruction(s) "
                       "(a shared gather), so the gather would stay")
        if why is not None and mode == "auto":
            s, note = Strategy.baseline(), why + ": baseline"
        elif why is not None:
            note = why
    return s, source, (speedup if not s.is_baseline else None), note, keep


def choose(mode: str, chosen: Any, client: Any, sites: list[Site | None], rows: list[Any]
           ) -> tuple[dict[str, Action], list[Any]]:
    """({tag: Action} to apply, the rows with their choices). The dots of a group get one choice,
    made for their GroupedProblem."""
    actions: dict[str, Action] = {}
    out = []
    made: dict[tuple[str, ...], tuple[Strategy, str, float | None, str, bool]] = {}
    owner: dict[str, tuple[tuple[str, ...], str]] = {}   # all-gather -> (the unit whose ring runs it, its name)
    served_by: dict[tuple[str, ...], str] = {}
    for site, row in zip(sites, rows, strict=True):
        if site is None:
            out.append(row)
            continue
        unit = site.tags or (site.tag,)
        first = owner.get(site.collective) if site.collective else None
        if (unit not in made and first is not None and first[0] != unit and not made[first[0]][0].is_baseline
                and _parent(first[0][0]) == _parent(site.tag)):
            # one all-gather feeding dots of two units (forward dot and weight gradient on a mesh
            # without a data axis): the first unit's ring keeps the gathered value, which serves
            # this dot as it is (a second ring would move the data again); the interpreter hands
            # it over within one jaxpr
            src = made[first[0]][1]
            made[unit] = (Strategy.baseline(), src, None,
                          f"served by the gathered value that the ring of {first[1]} keeps", False)
            served_by[unit] = first[1]
        if unit not in made:
            made[unit] = _decide(mode, chosen, client, site)
            if site.collective and site.collective not in owner and not made[unit][0].is_baseline:
                owner[site.collective] = (unit, row.name)
        s, source, speedup, note, keep = made[unit]
        if not s.is_baseline:
            actions[site.tag] = Action(site.unit, s, site.tags, keep=keep, strict=keep and mode == "auto")
        if row.note and note:
            note = f"{row.note}; {note}"
        out.append(replace(row, strategy=s, source=source, speedup=speedup, note=note or row.note,
                           served_by=served_by.get(unit, "")))
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
