"""Find: the pairs of a tagged program, each mapped to its dot equation (a `Site`) or to why not.

The tagged program (every dot under its `__overlapT__` scope, see `apply`) is compiled once; the
HLO around XLA's SPMD partitioner gives the all-gather -> dot and dot -> reduce-scatter pairs
(`hlo.pairs`), each matched to its Problem as `extract` matches it (`hlo.problems.match_dot`); the
tag in the dot's op_name names the equation exactly, whose traced types are checked against the
Problem (`mismatch`). The dots one all-gather feeds become members of one GroupedProblem.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import logging
from dataclasses import dataclass, replace
from typing import Any

from autotuner.hlo.compile import keep_json
from autotuner.hlo.evaluate import in_loops, manual_computations, multiplicity
from autotuner.hlo.group_pairs import group_units
from autotuner.hlo.names import dot_label, short_name
from autotuner.hlo.pairs import Pair, find_pairs
from autotuner.hlo.problems import dot_index, pair_problem, several
from autotuner.hlo.shardings import MeshInfo
from autotuner.hlo.text import PASS_THROUGH, ExtractError, HloModule, parse_hlo
from autotuner.overlap.apply import TAG_PREFIX, Interpreter
from autotuner.overlap.dotview import IDENTITY, DotInfo, View, views
from autotuner.overlap.plan import PlanRow
from autotuner.problem import GroupedProblem, Problem, problem_from_dict
from autotuner.strategy import Strategy

log = logging.getLogger("autotuner.overlap")


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
    view: View = IDENTITY   # how the traced dot computes the Problem, where XLA's HLO changed it
    in_loop: bool = False   # the dot runs in a while loop's body (a scanned layer's)

    @property
    def unit(self) -> Problem | GroupedProblem:
        """What is chosen for and applied: the group, else the pair's Problem."""
        return self.group if self.group is not None else self.problem

    @property
    def extra_users(self) -> int:
        """Users of the gathered value that are not dots of this unit."""
        return self.other_users - (len(self.tags) - 1 if self.group is not None else 0)


@dataclass
class Found:
    """One analysis of the tagged program: a site per decomposable pair (None where the pair cannot
    be decomposed, its row says why), a plan row per pair (baseline for now), notes on the whole
    program."""

    sites: list[Site | None]
    rows: list[PlanRow]
    notes: list[str]


def other_users(mod: HloModule, pair: Pair) -> int:
    """How many instructions besides the pair's dot use the all-gather's value (through layout ops)."""
    if pair.kind != "all_gather":
        return 0
    seen: set[str] = set()
    todo, ends = [pair.collective.name], set()
    while todo:
        for u in mod.users.get(todo.pop(), []):
            if u in seen:
                continue
            seen.add(u)
            if mod.instrs[u].opcode in PASS_THROUGH:
                todo.append(u)
            elif u != pair.dot.name:
                ends.add(u)
    return len(ends)


def _tag(op_name: str) -> str | None:
    i = op_name.rfind(TAG_PREFIX)
    if i < 0:
        return None
    rest = op_name[i + len(TAG_PREFIX):]
    j = rest.find("__")
    return rest[:j] if j > 0 else None


WINDOWED = "windowed_dot_general"  # what XLA calls the loop of its own windowed einsum


def windowed_tags(compiled_text: str) -> frozenset[str]:
    """The tags of the dots that XLA decomposed itself (its windowed einsum) in a compiled module:
    the dots inside its `windowed_dot_general` loops (XLA:TPU does this in plain jit above its
    size threshold)."""
    mod = parse_hlo(compiled_text)
    tags = set()
    for comp, names in mod.computations.items():
        if WINDOWED in comp:
            tags.update(t for n in names if (t := _tag(mod.instrs[n].op_name)) is not None)
    return frozenset(tags)


# Platforms whose compiler decomposes gather/scatter einsums itself in plain jit (XLA:TPU's
# windowed einsum, on by default above its size threshold): the analysis compiles without it
# (`hlo.compile.ANALYSIS_OPTIONS`) and plain jit's own program is compiled once more to say which
# pairs it windows and what its temp memory is.
WINDOWS_ITSELF = frozenset({"tpu"})


def xla_windowing(lowered: Any, stop: bool) -> tuple[frozenset[str], int | None]:
    """(the tags of the dots plain jit's compiler windows itself, its temp bytes) for the
    analysed program compiled with the target's default options."""
    from autotuner.hlo.compile import temp_bytes

    if stop:   # an analysis program ending in analysis_stop cannot be compiled whole
        return frozenset(), None
    compiled = lowered.compile()
    return windowed_tags(compiled.as_text()), temp_bytes(compiled)


def _ident(pair: Pair) -> str:
    """What names a pair across rounds: its dot's tag, else its op_name, form and instruction."""
    return _tag(pair.dot.op_name) or f"{pair.dot.op_name}|{pair.form}|{pair.dot.name}"


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


def _auto_layouts(info: DotInfo) -> bool:
    """Whether no operand or result of the traced dot carries an explicit layout."""
    return info.out_spec is None and all(s is None for s in (*info.lhs_chain, *info.rhs_chain, *info.out_relayouts))


def _row(name: str, where: str, form: str, problem: Problem | None, source: str, count: int,
         note: str) -> PlanRow:
    return PlanRow(name, where, form, problem, Strategy.baseline(), source, None, count, note)


def find_sites(pre_text: str, post_text: str, parts: int, tagger: Interpreter, mesh: Any,
               seen: set[str]) -> Found:
    """The pairs of the tagged program (`tagger` evaluated it; `pre_text`/`post_text`: its HLO
    around the SPMD partitioner, `hlo.compile.partitioned_texts`) not `seen` before (by tag, or
    op_name for untagged dots; `seen` is updated). Pairs inside shard_map are left out once the
    pass has rewritten the program (they are its own rings)."""
    if parts <= 1 or not post_text:
        return Found([], [], ["the program runs on one device: nothing to decompose"])
    info = MeshInfo(tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes))
    post = parse_hlo(post_text)
    if post.num_partitions != info.size:
        raise ExtractError(f"the module runs on {post.num_partitions} partitions but the mesh "
                           f"{info.as_dict()} has {info.size} devices")
    times, manual, looped = multiplicity(post), manual_computations(post), in_loops(post)
    notes = [f"equation {path}: {why}" for path, why in tagger.failed.items()]
    found = find_pairs(post, info, [])
    if all(_ident(p) in seen or (p.dot.computation in manual and tagger.actions) for p in found):
        return Found([], [], notes)   # nothing new (a later round): the propagated module is not read
    pre = parse_hlo(pre_text)
    read = functools.partial(pair_problem, post=post, pre=pre, pre_dots=dot_index(pre), used=set(), info=info,
                             shared=several(found, post), manual=manual)
    sites: list[Site | None] = []
    rows: list[PlanRow] = []
    this_round: set[str] = set()
    mapped_tags: set[str] = set()
    pairs: list[tuple[Pair, int]] = []   # (pair, its site's index) of the mapped pairs
    for pair in found:
        if pair.dot.computation in manual and tagger.actions:
            continue
        op = pair.dot.op_name
        n = times.get(pair.dot.computation, 1)
        got = read(pair)
        problem, why = (None, got) if isinstance(got, str) else (got, None)
        tag, ident = _tag(op), _ident(pair)
        if ident in seen and ident not in this_round:
            continue   # planned in an earlier round
        seen.add(ident)
        this_round.add(ident)
        dot = tagger.infos.get(tag) if tag else None
        name = short_name(dot_label(op, post.arguments(pair.dot)))
        where = dot.where if dot else ""
        view = IDENTITY
        if why is None:
            why, view = _unmapped(dot, tag, problem, mapped_tags)
        if why is not None:
            sites.append(None)
            rows.append(_row(name, where, pair.form, problem, "unmapped", n, why))
            continue
        assert problem is not None and dot is not None and tag is not None
        mapped_tags.add(tag)
        sites.append(Site(tag, problem, dot, other_users(post, pair),
                          pair.collective.name if pair.kind == "all_gather" else "", view=view,
                          in_loop=pair.dot.computation in looped))
        rows.append(_row(name, where, pair.form, problem, "", n, ""))
        pairs.append((pair, len(sites) - 1))
    sites, rows = _grouped(sites, rows, pairs)
    return Found(sites, rows, notes)


def _unmapped(dot: DotInfo | None, tag: str | None, problem: Problem | None, mapped: set[str]
              ) -> tuple[str | None, View]:
    """(why a pair whose HLO maps to `problem` still cannot be decomposed, or None; how the traced
    dot computes the Problem). Where XLA changed the dot before its partitioner (`views`), it is
    decomposed as the Problem, its operands taken and its result given back through the `View`
    (`apply`), with Auto layouts only: an explicit layout would have to be permuted too."""
    if dot is None:
        return "no traced dot_general carries this dot's name (it was not rebuilt by the pass)", IDENTITY
    if tag in mapped:
        return "the same dot as another pair (one decomposition per dot)", IDENTITY
    assert problem is not None
    why = mismatch(dot, problem)
    if why is not None and _auto_layouts(dot):
        view = next((v for seen, v in views(dot) if mismatch(seen, problem) is None), None)
        if view is not None:
            return None, view
    return why, IDENTITY


def _grouped(sites: list[Site | None], rows: list[PlanRow], pairs: list[tuple[Pair, int]]
             ) -> tuple[list[Site | None], list[PlanRow]]:
    """The sites of the dots one all-gather feeds, made members of their GroupedProblem (as
    extraction groups them: `hlo.group_pairs.group_units`); the others unchanged."""
    by_pair = {id(pair): i for pair, i in pairs}
    units = group_units([(pair, sites[i].problem, rows[i].count) for pair, i in pairs])  # type: ignore[union-attr]
    for unit, unit_pairs, _ in units:
        if not isinstance(unit, GroupedProblem):
            continue
        idx = [by_pair[id(q)] for q in unit_pairs]
        members = [sites[i] for i in idx]
        assert all(m is not None for m in members)
        if any(m.view != IDENTITY for m in members):  # type: ignore[union-attr]
            for j, i in enumerate(idx):
                sites[i] = None
                rows[i] = replace(rows[i], problem=unit, member=j, source="unmapped",
                                  note="a dot of a grouped all-gather that XLA's HLO changes (operands "
                                       "swapped or a transpose folded in; a group is decomposed with its "
                                       "dots as traced)")
            continue
        tags = tuple(m.tag for m in members)  # type: ignore[union-attr]
        infos = tuple(m.info for m in members)  # type: ignore[union-attr]
        for j, i in enumerate(idx):
            sites[i] = replace(sites[i], group=unit, tags=tags, infos=infos)  # type: ignore[type-var]
            rows[i] = replace(rows[i], problem=unit, member=j,
                              note=f"dot {j + 1} of the {unit.k} its all-gather feeds (one grouped problem)")
    return sites, rows


# -- kept beside the partitioned texts ----------------------------------------------------------------

FOUND_FORMAT = 4   # 2: a site says whether its dot's operands are swapped; 3: whether it runs in a loop;
#                   4: its View (operands swapped, transposes folded)
_FINDER = ("autotuner.overlap.find", "autotuner.hlo.text", "autotuner.hlo.pairs", "autotuner.hlo.problems",
           "autotuner.hlo.group_pairs", "autotuner.hlo.evaluate", "autotuner.hlo.shardings", "autotuner.hlo.names",
           "autotuner.overlap.dotview")


@functools.cache
def _finder_digest() -> str:
    """A digest of the code that reads pairs from HLO: a kept result is only reused by the code
    that made it (a changed finder reads the texts again)."""
    try:
        version = importlib.metadata.version("overlap-autotuner")
    except importlib.metadata.PackageNotFoundError:   # run from a checkout, not installed
        version = ""
    h = hashlib.sha256(f"{FOUND_FORMAT} {version}".encode())
    for name in _FINDER:
        try:
            with open(importlib.import_module(name).__file__ or "", "rb") as fh:
                h.update(fh.read())
        except OSError:   # no source beside the module (a frozen install): the version stands for it
            h.update(name.encode())
    return h.hexdigest()[:16]


def find_sites_kept(part: Any, tagger: Interpreter, mesh: Any, seen: set[str]) -> Found:
    """`find_sites` of a `hlo.compile.Partitioned`; where its texts are kept (JAX's persistent cache
    configured: `Partitioned.kept`), so is the result, so that a restarted job reads no HLO for
    it. Keyed by the texts, the pairs seen in earlier rounds, whether the program is already
    rewritten, the mesh, what the trace says of its dots that the rows and notes repeat (their
    source lines, which the texts do not hold, and why any was not rewritten) and the finder's
    code; a kept result whose tags the traced program lacks is read again."""
    if not part.kept:
        return find_sites(part.pre, part.post, part.parts, tagger, mesh, seen)
    h = hashlib.sha256(json.dumps([sorted(seen), bool(tagger.actions), list(mesh.axis_names),
                                   [int(s) for s in mesh.axis_sizes], _finder_digest(),
                                   sorted((t, i.where) for t, i in tagger.infos.items()),
                                   sorted(tagger.failed.items())]).encode())
    path = f"{part.kept}.found-{h.hexdigest()[:16]}.json"
    got = _load_found(path, tagger)
    if got is not None:
        found, added = got
        seen.update(added)
        return found
    before = set(seen)
    found = find_sites(part.pre, part.post, part.parts, tagger, mesh, seen)
    _store_found(path, found, sorted(seen - before))
    return found


def _store_found(path: str, found: Found, added: list[str]) -> None:
    if any(not r.strategy.is_baseline or r.speedup is not None or r.served_by or r.kept_bytes for r in found.rows):
        return   # only what find_sites itself makes is kept
    unit = lambda p: None if p is None else p.to_dict()  # noqa: E731
    doc = {"added": added, "notes": found.notes,
           "sites": [None if s is None else {"tag": s.tag, "problem": s.problem.to_dict(), "other_users": s.other_users,
                                             "collective": s.collective, "group": unit(s.group), "tags": list(s.tags),
                                             "view": s.view.to_dict(), "in_loop": s.in_loop}
                     for s in found.sites],
           "rows": [{"name": r.name, "where": r.where, "form": r.form, "problem": unit(r.problem), "source": r.source,
                     "count": r.count, "note": r.note, "member": r.member} for r in found.rows]}
    keep_json(path, doc, "the pairs found")


def _load_found(path: str, tagger: Interpreter) -> tuple[Found, list[str]] | None:
    """The kept result (and the pair names it adds to `seen`), its dots relinked to this trace's
    equations by tag; None where there is none, it does not parse, or a tag is not traced."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
        unit = lambda d: None if d is None else problem_from_dict(d)  # noqa: E731
        infos = tagger.infos
        sites: list[Site | None] = []
        for d in doc["sites"]:
            if d is None:
                sites.append(None)
                continue
            tags = tuple(d["tags"])
            sites.append(Site(d["tag"], Problem.from_dict(d["problem"]), infos[d["tag"]], int(d["other_users"]),
                              str(d["collective"]), unit(d["group"]), tags, tuple(infos[t] for t in tags),
                              View.from_dict(d["view"]), bool(d["in_loop"])))
        rows = [PlanRow(str(d["name"]), str(d["where"]), str(d["form"]), unit(d["problem"]), Strategy.baseline(),
                        str(d["source"]), None, int(d["count"]), str(d["note"]), d["member"]) for d in doc["rows"]]
        return Found(sites, rows, [str(n) for n in doc["notes"]]), [str(a) for a in doc["added"]]
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - any byte string that is not what was kept: read the texts
        log.debug("overlap: the kept pairs in %s are not usable (%s: %s)", path, type(e).__name__, e)
        return None
