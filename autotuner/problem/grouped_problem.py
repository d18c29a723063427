"""The grouped problem: one all-gather feeding k einsums (k >= 2).

Real models gather one activation once and feed several projections with it: the Q, K and V
projections of sequence-parallel attention, the gate and up projections of a gated MLP. Tuning
each einsum as if it had its own gather is not what the program does (the gather runs once) and
not what a decomposition can win (one ring of the gathered shards can drive all k einsums per
step). A `GroupedProblem` is that unit: k `Problem`s, each an all-gather of the same operand (the
same global shape and spec, gathered along the same dimension over the same mesh axis), with
their own weights, equations and output specs.

JSON form (the single-einsum form is unchanged; a grouped problem is told apart by `einsums`):

    {"einsums": [<Problem>, <Problem>, ...]}

Every member is a full Problem JSON. Its key is THE canonical key (`problem_key`) of
`{"einsums": [members' canonical forms, sorted]}`: the order of the members does not change the
key (Q, K, V and V, K, Q are one problem), and no grouped key equals a single einsum's key.
Pure data, no JAX, like `autotuner.problem.core`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from autotuner.problem.core import Operand, Problem, ProblemError, problem_key

MAX_EINSUMS = 8
MAX_EQUATIONS_CHARS = 256   # the equations joined by ';' are stored in the database's equation column


@dataclass(frozen=True)
class GroupPattern:
    """How a grouped problem is laid out: one all-gather over `axis` of the shared operand along
    its dimension `dim` (letter `letter` in the first einsum), of class `dim_class` (free, batch or
    contracting, the same in every einsum), feeding `k` einsums."""

    axis: str
    dim: int
    letter: str
    dim_class: str
    k: int
    kind: Literal["all_gather"] = "all_gather"

    @property
    def label(self) -> str:
        return f"all_gather_group{self.k}:{self.dim_class}"


@dataclass(frozen=True)
class GroupedProblem:
    """k all-gather Problems sharing their gathered operand (see the module docs)."""

    members: tuple[Problem, ...]
    pattern: GroupPattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", _check(self.members))

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Any) -> GroupedProblem:
        if not isinstance(d, Mapping):
            raise ProblemError("problem", f"expected a JSON object, got {type(d).__name__}")
        extra = sorted(set(d) - {"einsums"})
        if extra:
            raise ProblemError(extra[0], "unknown field (a grouped problem has only 'einsums')")
        items = d.get("einsums")
        if not isinstance(items, list):
            raise ProblemError("einsums", f"expected a list of problems, got {type(items).__name__}")
        if not 2 <= len(items) <= MAX_EINSUMS:
            raise ProblemError("einsums", f"a grouped problem has 2 to {MAX_EINSUMS} einsums, got {len(items)}")
        members = []
        for i, item in enumerate(items):
            try:
                members.append(Problem.from_dict(item))
            except ProblemError as e:
                raise ProblemError(f"einsums[{i}].{e.field}" if e.field != "problem" else f"einsums[{i}]",
                                   e.message) from None
        return cls(tuple(members))

    @classmethod
    def from_json(cls, text: str) -> GroupedProblem:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProblemError("problem", f"invalid JSON: {e}") from None
        return cls.from_dict(d)

    # -- views ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"einsums": [m.to_dict() for m in self.members]}

    def canonical(self) -> dict[str, Any]:
        forms = [m.canonical() for m in self.members]
        return {"einsums": sorted(forms, key=lambda f: json.dumps(f, sort_keys=True))}

    @property
    def key(self) -> str:
        return problem_key(self.canonical())

    @property
    def k(self) -> int:
        return len(self.members)

    @property
    def equation(self) -> str:
        return ";".join(m.equation for m in self.members)

    @property
    def dtype(self) -> str:
        return self.members[0].dtype

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        return self.members[0].mesh

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def axis_size(self) -> int:
        return self.mesh_shape[self.pattern.axis]

    @property
    def gathered(self) -> Operand:
        """The shared operand, as every member has it (sharded, before the gather)."""
        m = self.members[0]
        return m.lhs if m.pattern.operand == "lhs" else m.rhs

    def weights(self) -> tuple[Operand, ...]:
        """Each member's other operand (its weight), in member order."""
        return tuple(m.rhs if m.pattern.operand == "lhs" else m.lhs for m in self.members)

    def features(self) -> dict[str, float]:
        """As `Problem.features`: `m` the shared operand's free extent, `k` and `b` as in the first
        einsum, `n` the weights' free extents summed (the group is one GEMM against the weights side
        by side), their flops summed, the bytes of the one gather."""
        fs = [m.features() for m in self.members]
        # m: the shared operand's own extent, n: each weight's, whichever side of its equation
        # the shared operand stands on
        sides = [(f["m"], f["n"]) if p.pattern.operand == "lhs" else (f["n"], f["m"])
                 for p, f in zip(self.members, fs, strict=True)]
        out = dict(fs[0])
        out["m"] = float(sides[0][0])
        out["n"] = float(sum(n for _, n in sides))
        out["flops"] = float(sum(f["flops"] for f in fs))
        out["comm_bytes"] = float(self.comm_bytes())
        return out

    def comm_bytes(self) -> int:
        """Bytes each device receives in the one plain all-gather."""
        return self.members[0].comm_bytes()

    def describe(self) -> str:
        return f"group of {self.k} [{' | '.join(m.describe() for m in self.members)}] {self.pattern.label}"


def _check(members: tuple[Problem, ...]) -> GroupPattern:
    if not isinstance(members, tuple) or not all(isinstance(m, Problem) for m in members):
        raise TypeError("GroupedProblem needs a tuple of Problems")
    if not 2 <= len(members) <= MAX_EINSUMS:
        raise ProblemError("einsums", f"a grouped problem has 2 to {MAX_EINSUMS} einsums, got {len(members)}")
    first = members[0]
    for i, m in enumerate(members):
        pat = m.pattern
        if pat.kind != "all_gather":
            raise ProblemError(f"einsums[{i}].out_spec", f"the layout is {pat.label}: every einsum of a grouped "
                                                        "problem is fed by the one all-gather")
        if m.mesh != first.mesh:
            raise ProblemError(f"einsums[{i}].mesh", f"{dict(m.mesh)} differs from einsums[0]'s {dict(first.mesh)}")
        if m.dtype != first.dtype:
            raise ProblemError(f"einsums[{i}].dtype", f"{m.dtype} differs from einsums[0]'s {first.dtype}")
        if pat.axis != first.pattern.axis:
            raise ProblemError(f"einsums[{i}]", f"gathered over {pat.axis}, einsums[0] over {first.pattern.axis}")
        if pat.dim_class != first.pattern.dim_class:
            raise ProblemError(f"einsums[{i}]", f"the gathered letter is {pat.dim_class} here but "
                                                f"{first.pattern.dim_class} in einsums[0]")
        x0, x = _gathered(first), _gathered(m)
        if x[1:] != x0[1:]:
            raise ProblemError(f"einsums[{i}].{pat.operand}",
                               f"the gathered operand (shape {list(x[1])}, gathered dimension {x[2]}) is not "
                               f"einsums[0]'s (shape {list(x0[1])}, dimension {x0[2]})")
        if x[0].spec != x0[0].spec:
            raise ProblemError(f"einsums[{i}].{pat.operand}.spec", "the gathered operand is laid out differently "
                                                                   "from einsums[0]'s")
    joined = sum(len(m.equation) for m in members) + len(members) - 1
    if joined > MAX_EQUATIONS_CHARS:
        raise ProblemError("einsums", f"the equations take {joined} characters joined; at most "
                                      f"{MAX_EQUATIONS_CHARS} (the stored equation column)")
    p0 = first.pattern
    assert p0.axis is not None and p0.letter is not None and p0.dim_class is not None
    return GroupPattern(p0.axis, _gathered(first)[2], p0.letter, p0.dim_class, len(members))


def _gathered(p: Problem) -> tuple[Operand, tuple[int, ...], int]:
    pat = p.pattern
    op, letters = (p.lhs, p.eq.lhs) if pat.operand == "lhs" else (p.rhs, p.eq.rhs)
    assert pat.letter is not None
    return op, op.shape, letters.index(pat.letter)


def problem_from_dict(d: Any) -> Problem | GroupedProblem:
    """A Problem, or a GroupedProblem when the object has `einsums`."""
    if isinstance(d, Mapping) and "einsums" in d:
        return GroupedProblem.from_dict(d)
    return Problem.from_dict(d)
