"""Pairs -> Problems: the dot's dimension numbers give the equation, the matching dot of the
propagated module gives global shapes and specs, the collective's groups give the mesh axis."""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotuner.hlo.evaluate import manual_computations, multiplicity
from autotuner.hlo.group_pairs import group_units
from autotuner.hlo.names import dot_label, problem_names
from autotuner.hlo.pairs import ExtractReport, Pair, find_pairs, skip
from autotuner.hlo.shardings import MeshInfo, parse_sharding, tiling_spec
from autotuner.hlo.text import DTYPES, ExtractError, HloModule, Instr, parse_hlo
from autotuner.problem import Entry, Problem, ProblemError

log = logging.getLogger(__name__)

# -- pairs -> Problems ---------------------------------------------------------------------------------

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class DotDims:
    lc: tuple[int, ...]
    rc: tuple[int, ...]
    lb: tuple[int, ...]
    rb: tuple[int, ...]
    lrank: int
    rrank: int

    @classmethod
    def of(cls, mod: HloModule, dot: Instr) -> DotDims | None:
        a, b = mod.op(dot.operands[0]), mod.op(dot.operands[1])
        if a is None or b is None or a.shape is None or b.shape is None:
            return None
        return cls(dot.attr_ints("lhs_contracting_dims"), dot.attr_ints("rhs_contracting_dims"),
                   dot.attr_ints("lhs_batch_dims"), dot.attr_ints("rhs_batch_dims"), len(a.shape), len(b.shape))


def _letters(dims: DotDims, op_name: str) -> tuple[str, str, str]:
    """(lhs, rhs, out) subscripts of the dot; the einsum's own letters when its op_name has them."""
    m = re.search(r"([A-Za-z]+),([A-Za-z]+)->([A-Za-z]*)", op_name)
    tries: list[tuple[str, str]] = []
    if m:
        tries += [(m.group(1), m.group(2)), (m.group(2), m.group(1))]
    for lhs, rhs in tries:
        if len(lhs) != dims.lrank or len(rhs) != dims.rrank or len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
            continue
        paired_l = set(dims.lc) | set(dims.lb)
        paired_r = set(dims.rc) | set(dims.rb)
        ok = all(lhs[i] == rhs[j] for i, j in zip(dims.lc + dims.lb, dims.rc + dims.rb, strict=True))
        ok = ok and not any(lhs[i] in rhs for i in range(len(lhs)) if i not in paired_l)
        ok = ok and not any(rhs[j] in lhs for j in range(len(rhs)) if j not in paired_r)
        if ok:
            return lhs, rhs, _out(dims, lhs, rhs)
    lhs = _LETTERS[: dims.lrank]
    rhs_l = []
    fresh = iter(_LETTERS[dims.lrank:])
    pair = dict(zip(dims.rc + dims.rb, dims.lc + dims.lb, strict=True))
    for j in range(dims.rrank):
        rhs_l.append(lhs[pair[j]] if j in pair else next(fresh))
    rhs = "".join(rhs_l)
    return lhs, rhs, _out(dims, lhs, rhs)


def _out(dims: DotDims, lhs: str, rhs: str) -> str:
    """HLO dot output order: batch dims, then lhs free dims, then rhs free dims."""
    lfree = [lhs[i] for i in range(dims.lrank) if i not in dims.lc and i not in dims.lb]
    rfree = [rhs[j] for j in range(dims.rrank) if j not in dims.rc and j not in dims.rb]
    return "".join([lhs[i] for i in dims.lb] + lfree + rfree)


def _local(shape: Sequence[int], spec: Sequence[Entry], sizes: Mapping[str, int],
           drop: tuple[int, tuple[str, ...]] | None = None) -> tuple[int, ...] | None:
    out = []
    for i, (d, e) in enumerate(zip(shape, spec, strict=True)):
        axes = e
        if drop is not None and drop[0] == i:
            axes = e[: len(e) - len(drop[1])]
        parts = math.prod(sizes[a] for a in axes)
        if d % parts:
            return None
        out.append(d // parts)
    return tuple(out)


def _with_axes(e: Entry, axes: tuple[str, ...]) -> Entry:
    return e if e[len(e) - len(axes):] == axes and len(e) >= len(axes) else tuple(e) + axes


def _spec_of(mod: HloModule, name: str, mesh: MeshInfo) -> tuple[Entry, ...] | str:
    ins = mod.op(name)
    if ins is None or ins.shape is None:
        return f"no instruction {name} in the propagated module"
    sh = ins.attrs.get("sharding")
    if sh is None:
        return tuple(() for _ in ins.shape)  # unannotated: replicated
    spec = _sharding_spec(sh, len(ins.shape), mod.num_partitions, mesh)
    if spec == "unreadable":
        return f"cannot read sharding {sh!r} of {name}"
    if spec == "manual":
        return f"{name} is manually partitioned (inside shard_map)"
    if spec == "partial":
        return f"sharding {sh!r} of {name} is not a layout over whole mesh axes"
    return spec


@functools.lru_cache(maxsize=4096)
def _sharding_spec(sh: str, rank: int, parts: int, mesh: MeshInfo) -> tuple[Entry, ...] | str:
    """A sharding attribute's entries over the mesh axes, or why not ('unreadable', 'manual',
    'partial'); once per distinct attribute: a model's layers repeat a few."""
    t = parse_sharding(sh, rank, parts)
    if t is None:
        return "unreadable"
    if t.manual:
        return "manual"
    spec = tiling_spec(t, mesh)
    return "partial" if spec is None else spec


def _problem_for(pair: Pair, post: HloModule, pre: HloModule, cand: Instr, mesh: MeshInfo) -> Problem | str:
    """The Problem of `pair` using `cand` (the dot in the propagated module); a reason if none."""
    dims = DotDims.of(pre, cand)
    post_dims = DotDims.of(post, pair.dot)
    if dims is None or dims != post_dims:
        return "dimension numbers differ"
    lhs_i, rhs_i = pre.instrs[cand.operands[0]], pre.instrs[cand.operands[1]]
    if lhs_i.etype not in DTYPES or rhs_i.etype != lhs_i.etype:
        return f"operand types {lhs_i.etype}/{rhs_i.etype} (supported: {', '.join(DTYPES)}, both alike)"
    if any(ins.shape is None for ins in (lhs_i, rhs_i, cand)):
        return "tuple-shaped operands"
    ls, rs, os_ = (_spec_of(pre, n, mesh) for n in (cand.operands[0], cand.operands[1], cand.name))
    for s in (ls, rs, os_):
        if isinstance(s, str):
            return s
    assert not isinstance(ls, str) and not isinstance(rs, str) and not isinstance(os_, str)
    lspec, rspec, ospec = list(ls), list(rs), list(os_)
    sizes = mesh.as_dict()
    lpost = post.instrs[pair.dot.operands[0]].shape
    rpost = post.instrs[pair.dot.operands[1]].shape
    assert lhs_i.shape is not None and rhs_i.shape is not None and cand.shape is not None
    lshape, rshape, oshape = lhs_i.shape, rhs_i.shape, cand.shape
    ldrop = rdrop = odrop = None
    if pair.kind == "all_gather":
        spec = lspec if pair.operand == "lhs" else rspec
        spec[pair.dim] = _with_axes(spec[pair.dim], pair.axes)
        if pair.operand == "lhs":
            ldrop = (pair.dim, pair.axes)
        else:
            rdrop = (pair.dim, pair.axes)
    else:
        ospec[pair.dim] = _with_axes(ospec[pair.dim], pair.axes)
        odrop = (pair.dim, pair.axes)
    if (_local(lshape, lspec, sizes, ldrop) != lpost or _local(rshape, rspec, sizes, rdrop) != rpost
            or _local(oshape, ospec, sizes, odrop) != pair.dot.shape):
        return "the propagated shardings do not give the partitioned dot's per-device shapes"
    lhs, rhs, out = _letters(dims, cand.op_name)
    d = {"equation": f"{lhs},{rhs}->{out}",
         "lhs": {"shape": list(lshape), "spec": [_json(e) for e in lspec]},
         "rhs": {"shape": list(rshape), "spec": [_json(e) for e in rspec]},
         "out_spec": [_json(e) for e in ospec],
         "dtype": DTYPES[lhs_i.etype], "mesh": sizes}
    try:
        p = Problem.from_dict(d)
    except ProblemError as e:
        return _why_not(pair, str(e))
    pat = p.pattern
    want_letter = ((lhs if pair.operand == "lhs" else rhs)[pair.dim] if pair.kind == "all_gather"
                   else out[pair.dim])
    if (pat.kind != pair.kind or pat.letter != want_letter or len(pair.axes) != 1 or pat.axis != pair.axes[0]
            or (pair.kind == "all_gather" and pat.operand != pair.operand)):
        return (f"the layout classifies as {pat.label} over {pat.axis}, not the {pair.form} of "
                f"{want_letter!r} over {'/'.join(pair.axes)} that the HLO shows")
    return p


RESHARDS = frozenset({"all-to-all", "collective-permute"})   # how GSPMD moves an operand to another layout


def pair_problem(pair: Pair, post: HloModule, pre: HloModule, pre_dots: list[tuple[Instr, tuple[Any, ...]]],
                 used: set[str], info: MeshInfo, shared: dict[str, str], manual: set[str]) -> Problem | str:
    """The Problem of `pair`, or why it has none (extraction's rule, which the pass reads too): a dot
    inside shard_map (`manual`: its computations), a dot with two collectives (`shared`: `several`),
    else its dot in the propagated module (`match_dot`)."""
    if pair.dot.computation in manual:
        return "inside shard_map (already manually partitioned)"
    if pair.dot.name in shared:
        return shared[pair.dot.name]
    return match_dot(pair, post, pre, pre_dots, used, info)


def several(pairs: list[Pair], post: HloModule) -> dict[str, str]:
    """{dot name: why none of its pairs is a Problem} for the dots with more than one collective of
    their own: several pairs among `pairs`, or one whose dot's other operand GSPMD reshards too (an
    all-to-all or collective-permute before it, through layout-only ops). Extraction and the pass
    both skip them, for this one reason."""
    per_dot: dict[str, list[Pair]] = {}
    for pair in pairs:
        per_dot.setdefault(pair.dot.name, []).append(pair)
    out = {name: _several(ps) for name, ps in per_dot.items() if len(ps) > 1}
    for name, (pair, *_) in per_dot.items():
        if name in out:
            continue
        gathered = {"lhs": 0, "rhs": 1}.get(pair.operand or "", -1)
        moved = [(i, src) for i, o in enumerate(pair.dot.operands[:2])
                 if i != gathered and (src := post.source(o)) is not None and src.opcode in RESHARDS]
        if moved:
            i, src = moved[0]
            out[name] = (f"the dot has 2 collectives of its own ({pair.form} {pair.collective.name}, and its "
                         f"{('lhs', 'rhs')[i]} arrives through {src.opcode} {src.name}, which GSPMD reshards it "
                         "with): a Problem decomposes one all-gather or one reduce-scatter per dot, so it is not "
                         "decomposed")
    return out


def _several(pairs: list[Pair]) -> str:
    """Why a dot with several collectives around it (e.g. both operands all-gathered, as
    keras-hub's own layout map shards every kernel's hidden dimension too) is not one Problem."""
    what = ", ".join(f"{p.form} {p.collective.name} ({p.operand or 'result'})" for p in pairs)
    return (f"the dot has {len(pairs)} collectives of its own ({what}): a Problem decomposes one "
            "all-gather or one reduce-scatter per dot, so it is not decomposed")


def _why_not(pair: Pair, error: str) -> str:
    """The skip reason of a pair whose layout is not a Problem. The common one in a data-parallel
    training step: a weight gradient's dot gathers an activation over the model axis and also
    contracts the batch, sharded over data in both operands, so its result needs an all-reduce
    over data after the gather: two collectives on one dot, which no Problem kind (one all-gather or
    one reduce-scatter feeding or consuming the einsum) describes."""
    m = re.search(r"contracting letter '(\w)' is sharded over (\S+) in both operands", error)
    if m and pair.kind == "all_gather":
        return (f"not a Problem: the dot also contracts {m.group(1)!r}, which is sharded over {m.group(2)} in "
                f"both operands, so after the {pair.form} over {'/'.join(pair.axes)} its result still "
                f"needs an all-reduce over {m.group(2)} (two collectives on one dot, e.g. a weight gradient "
                "under data parallelism; a Problem has one all-gather or one reduce-scatter)")
    return f"not a Problem: {error}"


def _json(e: Entry) -> str | list[str] | None:
    return None if not e else e[0] if len(e) == 1 else list(e)


def _signature(mod: HloModule, dot: Instr) -> tuple[Any, ...]:
    return (dot.op_name, dot.stack_frame, DotDims.of(mod, dot))


def dot_index(pre: HloModule) -> list[tuple[Instr, tuple[Any, ...]]]:
    """The dots of the propagated module with their signatures, computed once per module."""
    return [(pre.instrs[n], _signature(pre, pre.instrs[n])) for n in pre.order if pre.instrs[n].opcode == "dot"]


def match_dot(pair: Pair, post: HloModule, pre: HloModule, pre_dots: list[tuple[Instr, tuple[Any, ...]]],
              used: set[str], info: MeshInfo) -> Problem | str:
    """The Problem of `pair`, read from its dot in the propagated module (`pre_dots`: its
    `dot_index`; a dot not in `used`, which gains it), or why there is none. Candidates: the same
    op_name/stack frame/dimension numbers; only where there is none, any dot of the same dimension
    numbers."""
    sig = _signature(post, pair.dot)
    # the same dot (op_name, stack frame, dimension numbers) where the propagated module has it
    # (its reason is then the pair's: no other dot is tried), else any of the same dimension numbers
    cands = [c for c, s in pre_dots if s == sig and c.name not in used] or [
        c for c, s in pre_dots if s != sig and s[2] == sig[2]]
    reasons = []
    for cand in cands:
        if cand.name in used:
            continue
        r = _problem_for(pair, post, pre, cand, info)
        if isinstance(r, Problem):
            used.add(cand.name)
            return r
        reasons.append(r)
    return reasons[0] if reasons else "no matching dot in the propagated module"


def extract_from_hlo(propagated: str, partitioned: str, mesh: Mapping[str, int] | MeshInfo) -> ExtractReport:
    """Problems from the two HLO texts (before and after `spmd-partitioning`) of one module."""
    info = mesh if isinstance(mesh, MeshInfo) else MeshInfo(tuple(mesh), tuple(mesh.values()))
    post, pre = parse_hlo(partitioned), parse_hlo(propagated)
    skipped: list[tuple[str, str]] = []
    if post.num_partitions != info.size:
        raise ExtractError(f"the module runs on {post.num_partitions} partitions but the mesh "
                           f"{info.as_dict()} has {info.size} devices")
    pairs = find_pairs(post, info, skipped)
    times = multiplicity(post)
    pre_dots = dot_index(pre)
    manual = manual_computations(post)
    used: set[str] = set()
    mapped: list[tuple[Pair, Problem, int]] = []
    shared = several(pairs, post)
    for pair in pairs:
        where = pair.where()
        result = pair_problem(pair, post, pre, pre_dots, used, info, shared, manual)
        if isinstance(result, str):
            skip(skipped, where, result)
            continue
        mapped.append((pair, result, times.get(pair.dot.computation, 1)))
        log.debug("extract: %s -> %s", where, result.describe())
    # one gather feeding k mapped dots is one GroupedProblem; the same key twice adds its counts
    found: dict[str, list[Any]] = {}
    ops: dict[str, list[str]] = {}   # problem key -> op_names of its dots, for its name
    for unit, unit_pairs, n in group_units(mapped):
        slot = found.setdefault(unit.key, [unit, 0])
        slot[1] += n
        ops.setdefault(unit.key, []).extend(dot_label(q.dot.op_name, post.arguments(q.dot)) for q in unit_pairs)
    problems = [(p, c) for p, c in found.values()]
    names = problem_names([ops[p.key] for p, _ in problems])
    return ExtractReport(problems, skipped, len(pairs), post.num_partitions, info.as_dict(), names)
