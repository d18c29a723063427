"""The Problem: one sharded einsum on one logical mesh, validated and classified.

A Problem is pure data (no JAX import): global shapes, PartitionSpec-like specs, the output spec,
the dtype and the mesh axes. Parsing validates everything and raises `ProblemError` naming the
offending field. `Problem.pattern` classifies the layout the way GSPMD would lower it: an
all-gather of one operand feeding a local einsum, a local einsum feeding a reduce-scatter, or a
purely local einsum. `Problem.key` is the one canonical key used by tuner, database and service.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from autotuner.errors import AutotunerError

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {
    "f32": "float32", "fp32": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "f16": "float16", "fp16": "float16", "float16": "float16", "half": "float16",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_RANK = 12

Entry = tuple[str, ...]  # the mesh axes one dimension is sharded over (major to minor); () = unsharded


class ProblemError(AutotunerError, ValueError):
    """An invalid or unsupported Problem. `field` names the offending part (e.g. `lhs.spec[1]`)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Operand:
    shape: tuple[int, ...]
    spec: tuple[Entry, ...]


@dataclass(frozen=True)
class Pattern:
    """How the einsum's collective is laid out.

    kind: `all_gather` (one operand is gathered along `letter` before the einsum),
    `reduce_scatter` (the einsum's partial sums over the sharded contracting `contract`
    letter are reduce-scattered along output `letter`), or `none` (purely local).
    dim_class: for all_gather, the class of the gathered letter: free, batch or contracting;
    for reduce_scatter, the class of the scattered output letter: free_lhs, free_rhs or batch.
    """

    kind: Literal["all_gather", "reduce_scatter", "none"]
    axis: str | None = None
    operand: Literal["lhs", "rhs"] | None = None
    letter: str | None = None
    dim_class: str | None = None
    contract: str | None = None

    @property
    def label(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "all_gather":
            return f"all_gather:{self.operand}:{self.dim_class}"
        return f"reduce_scatter:{self.dim_class}"


@dataclass(frozen=True)
class Equation:
    lhs: str
    rhs: str
    out: str

    @property
    def batch(self) -> tuple[str, ...]:
        return tuple(c for c in self.out if c in self.lhs and c in self.rhs)

    @property
    def contracting(self) -> tuple[str, ...]:
        return tuple(c for c in self.lhs if c in self.rhs and c not in self.out)

    @property
    def lhs_free(self) -> tuple[str, ...]:
        return tuple(c for c in self.out if c in self.lhs and c not in self.rhs)

    @property
    def rhs_free(self) -> tuple[str, ...]:
        return tuple(c for c in self.out if c in self.rhs and c not in self.lhs)

    def __str__(self) -> str:
        return f"{self.lhs},{self.rhs}->{self.out}"


def parse_equation(text: Any) -> Equation:
    f = "equation"
    if not isinstance(text, str):
        raise ProblemError(f, f"expected a string like 'bsd,df->bsf', got {type(text).__name__}")
    eq = "".join(text.split())
    if "..." in eq:
        raise ProblemError(f, "ellipsis ('...') is not supported; name every dimension")
    if eq.count("->") != 1:
        raise ProblemError(f, f"{text!r} must have exactly one '->' (implicit output is not supported)")
    ins, out = eq.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        raise ProblemError(f, f"{text!r} must have exactly two operands, got {len(parts)}")
    lhs, rhs = parts
    for name, s in (("lhs", lhs), ("rhs", rhs), ("output", out)):
        bad = [c for c in s if not c.isascii() or not c.isalpha()]
        if bad:
            raise ProblemError(f, f"{name} subscripts {s!r} contain {bad[0]!r}; use letters a-z, A-Z")
        if len(set(s)) != len(s):
            rep = next(c for c in s if s.count(c) > 1)
            raise ProblemError(f, f"letter {rep!r} repeats within the {name} ({s!r}); traces and "
                                  "diagonals are not supported")
        if len(s) > MAX_RANK:
            raise ProblemError(f, f"{name} has rank {len(s)}, more than {MAX_RANK}")
    if not lhs or not rhs:
        raise ProblemError(f, f"{text!r} has an empty operand")
    for c in out:
        if c not in lhs and c not in rhs:
            raise ProblemError(f, f"output letter {c!r} appears in neither operand")
    for name, s, other in (("lhs", lhs, rhs), ("rhs", rhs, lhs)):
        for c in s:
            if c not in other and c not in out:
                raise ProblemError(f, f"letter {c!r} is summed within the {name} alone; "
                                      "reduce it before the einsum")
    return Equation(lhs, rhs, out)


def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ProblemError(f"{where}{key}" if where else key, "missing field")
    return d[key]


def _parse_shape(value: Any, field_: str, rank: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ProblemError(field_, f"expected a list of positive integers, got {type(value).__name__}")
    if len(value) != rank:
        raise ProblemError(field_, f"has rank {len(value)} but the equation gives this operand rank {rank}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ProblemError(f"{field_}[{i}]", f"expected an integer, got {v!r}")
        if v <= 0:
            raise ProblemError(f"{field_}[{i}]", f"sizes must be positive, got {v}")
        out.append(v)
    return tuple(out)


def _parse_spec(value: Any, field_: str, rank: int, mesh: Mapping[str, int]) -> tuple[Entry, ...]:
    if not isinstance(value, (list, tuple)):
        raise ProblemError(field_, f"expected a list (one entry per dimension), got {type(value).__name__}")
    if len(value) != rank:
        raise ProblemError(field_, f"has {len(value)} entries for a rank-{rank} operand")
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for i, e in enumerate(value):
        f = f"{field_}[{i}]"
        if e is None:
            axes: tuple[Any, ...] = ()
        elif isinstance(e, str):
            axes = (e,)
        elif isinstance(e, (list, tuple)):
            axes = tuple(e)
        else:
            raise ProblemError(f, f"expected null, a mesh axis name or a list of names, got {e!r}")
        for a in axes:
            if not isinstance(a, str):
                raise ProblemError(f, f"axis names must be strings, got {a!r}")
            if a not in mesh:
                raise ProblemError(f, f"unknown mesh axis {a!r} (mesh has {', '.join(mesh) or 'no axes'})")
            if a in seen:
                raise ProblemError(f, f"mesh axis {a!r} is already used by entry {seen[a]}; "
                                      "an axis may shard one dimension only")
            seen[a] = i
        entries.append(tuple(axes))
    return tuple(entries)


def _parse_mesh(value: Any) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise ProblemError("mesh", f"expected an object of axis name -> size, got {type(value).__name__}")
    if not value:
        raise ProblemError("mesh", "needs at least one axis")
    out: dict[str, int] = {}
    for name, size in value.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ProblemError("mesh", f"axis name {name!r} must be an identifier")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ProblemError(f"mesh.{name}", f"axis size must be a positive integer, got {size!r}")
        out[name] = size
    return out


def _divisibility(shape: tuple[int, ...], spec: tuple[Entry, ...], mesh: Mapping[str, int], field_: str,
                  letters: str) -> None:
    for i, (d, e) in enumerate(zip(shape, spec, strict=True)):
        parts = math.prod(mesh[a] for a in e)
        if d % parts:
            raise ProblemError(f"{field_}.shape[{i}]", f"dimension {letters[i]!r} of size {d} is not "
                                                       f"divisible by its {parts} shards ({'x'.join(e)})")


@dataclass(frozen=True)
class Problem:
    """One sharded einsum. Shapes are global; specs follow `jax.sharding.PartitionSpec`."""

    equation: str
    lhs: Operand
    rhs: Operand
    out_spec: tuple[Entry, ...]
    dtype: str
    mesh: tuple[tuple[str, int], ...]
    eq: Equation = field(init=False, repr=False, compare=False)
    pattern: Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eq", parse_equation(self.equation))
        object.__setattr__(self, "pattern", _classify(self))

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Any) -> Problem:
        if not isinstance(d, Mapping):
            raise ProblemError("problem", f"expected a JSON object, got {type(d).__name__}")
        known = {"equation", "lhs", "rhs", "out_spec", "dtype", "mesh"}
        extra = sorted(set(d) - known)
        if extra:
            raise ProblemError(extra[0], f"unknown field (expected {', '.join(sorted(known))})")
        eq = parse_equation(_require(d, "equation", ""))
        mesh = _parse_mesh(_require(d, "mesh", ""))
        ops = {}
        for name, letters in (("lhs", eq.lhs), ("rhs", eq.rhs)):
            o = _require(d, name, "")
            if not isinstance(o, Mapping):
                raise ProblemError(name, f"expected an object with 'shape' and 'spec', got {type(o).__name__}")
            extra = sorted(set(o) - {"shape", "spec"})
            if extra:
                raise ProblemError(f"{name}.{extra[0]}", "unknown field (expected shape, spec)")
            shape = _parse_shape(_require(o, "shape", f"{name}."), f"{name}.shape", len(letters))
            spec_v = o.get("spec", [None] * len(letters))
            spec = _parse_spec(spec_v, f"{name}.spec", len(letters), mesh)
            _divisibility(shape, spec, mesh, name, letters)
            ops[name] = Operand(shape, spec)
        for c in eq.lhs:
            if c in eq.rhs:
                a, b = ops["lhs"].shape[eq.lhs.index(c)], ops["rhs"].shape[eq.rhs.index(c)]
                if a != b:
                    raise ProblemError(f"rhs.shape[{eq.rhs.index(c)}]",
                                       f"letter {c!r} has size {a} in lhs but {b} in rhs")
        out_spec = _parse_spec(d.get("out_spec", [None] * len(eq.out)), "out_spec", len(eq.out), mesh)
        dt = _require(d, "dtype", "")
        if not isinstance(dt, str) or dt.lower() not in _DTYPE_ALIASES:
            raise ProblemError("dtype", f"unsupported dtype {dt!r} (supported: {', '.join(DTYPES)})")
        sizes = _letter_sizes(eq, ops["lhs"].shape, ops["rhs"].shape)
        out_shape = tuple(sizes[c] for c in eq.out)
        _divisibility(out_shape, out_spec, mesh, "out_spec", eq.out)
        return cls(str(eq), ops["lhs"], ops["rhs"], out_spec, _DTYPE_ALIASES[dt.lower()],
                   tuple(mesh.items()))

    @classmethod
    def from_json(cls, text: str) -> Problem:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProblemError("problem", f"invalid JSON: {e}") from None
        return cls.from_dict(d)

    # -- views ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "equation": self.equation,
            "lhs": {"shape": list(self.lhs.shape), "spec": [_entry_json(e) for e in self.lhs.spec]},
            "rhs": {"shape": list(self.rhs.shape), "spec": [_entry_json(e) for e in self.rhs.spec]},
            "out_spec": [_entry_json(e) for e in self.out_spec],
            "dtype": self.dtype,
            "mesh": dict(self.mesh),
        }

    def canonical(self) -> dict[str, Any]:
        """The key's JSON: letters renamed in order of appearance, specs normalised, mesh sorted."""
        ren: dict[str, str] = {}
        for c in self.eq.lhs + self.eq.rhs:
            ren.setdefault(c, chr(ord("a") + len(ren)))
        d = self.to_dict()
        d["equation"] = "".join(ren.get(c, c) for c in self.equation)
        d["mesh"] = dict(sorted(self.mesh))
        return d

    @property
    def key(self) -> str:
        return problem_key(self.canonical())

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def sizes(self) -> dict[str, int]:
        return _letter_sizes(self.eq, self.lhs.shape, self.rhs.shape)

    @property
    def out_shape(self) -> tuple[int, ...]:
        s = self.sizes
        return tuple(s[c] for c in self.eq.out)

    @property
    def axis_size(self) -> int:
        """Size of the collective's mesh axis (1 for a local einsum)."""
        return self.mesh_shape[self.pattern.axis] if self.pattern.axis else 1

    def features(self) -> dict[str, float]:
        """Shape features for nearest-shape queries: GEMM-like m, n, k, batch, flops, comm bytes."""
        s, eq = self.sizes, self.eq
        m = math.prod(s[c] for c in eq.lhs_free)
        n = math.prod(s[c] for c in eq.rhs_free)
        k = math.prod(s[c] for c in eq.contracting)
        b = math.prod(s[c] for c in eq.batch)
        return {"m": float(m), "n": float(n), "k": float(k), "b": float(b),
                "flops": 2.0 * m * n * k * b, "comm_bytes": float(self.comm_bytes())}

    def comm_bytes(self) -> int:
        """Bytes each device receives in the plain collective."""
        p, n = self.pattern, self.axis_size
        if p.kind == "none":
            return 0
        item = DTYPE_BYTES[self.dtype]
        mesh = self.mesh_shape
        if p.kind == "all_gather":
            op = self.lhs if p.operand == "lhs" else self.rhs
            local = math.prod(d // math.prod(mesh[a] for a in e) for d, e in zip(op.shape, op.spec, strict=True))
            return local * (n - 1) * item
        local_out = math.prod(d // math.prod(mesh[a] for a in e)
                              for d, e in zip(self.out_shape, self.out_spec, strict=True))
        return local_out * (n - 1) * item

    def describe(self) -> str:
        dims = ",".join(f"{c}={v}" for c, v in self.sizes.items())
        mesh = "x".join(f"{a}{n}" for a, n in self.mesh)
        return f"{self.equation} [{dims}] {self.dtype} mesh {mesh} {self.pattern.label}"


def problem_key(canonical: Mapping[str, Any]) -> str:
    """THE canonical key: sha256 of compact, key-sorted JSON; same on every process and machine."""
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _entry_json(e: Entry) -> str | list[str] | None:
    if not e:
        return None
    return e[0] if len(e) == 1 else list(e)


def _letter_sizes(eq: Equation, lshape: Sequence[int], rshape: Sequence[int]) -> dict[str, int]:
    sizes = dict(zip(eq.lhs, lshape, strict=True))
    for c, v in zip(eq.rhs, rshape, strict=True):
        sizes.setdefault(c, v)
    return sizes


# -- classification --------------------------------------------------------------------------------

def _entries(p: Problem) -> dict[str, dict[str, Entry]]:
    """letter -> {place -> entry} for the places (lhs, rhs, out) the letter appears in."""
    table: dict[str, dict[str, Entry]] = {}
    for place, letters, spec in (("lhs", p.eq.lhs, p.lhs.spec), ("rhs", p.eq.rhs, p.rhs.spec),
                                 ("out", p.eq.out, p.out_spec)):
        for c, e in zip(letters, spec, strict=True):
            table.setdefault(c, {})[place] = e
    return table


def _local_inconsistency(eq: Equation, table: Mapping[str, Mapping[str, Entry]]) -> str | None:
    """Why the einsum cannot run shard-locally as laid out (None if it can)."""
    for c, places in table.items():
        if c in eq.contracting and any(places.values()):
            axes = "/".join(sorted({a for e in places.values() for a in e}))
            return f"contracting letter {c!r} is sharded over {axes}"
        vals = set(places.values())
        if len(vals) > 1:
            desc = ", ".join(f"{k} {list(v) or 'unsharded'}" for k, v in places.items())
            return f"letter {c!r} is sharded differently ({desc})"
    return None


def _strip_minor(e: Entry, axis: str) -> Entry | None:
    return e[:-1] if e and e[-1] == axis else None


def _classify(p: Problem) -> Pattern:
    eq, table = p.eq, _entries(p)
    why = _local_inconsistency(eq, table)
    if why is None:
        return Pattern("none")
    axes = [a for a, _ in p.mesh]
    # all-gather of one operand along one letter
    for operand in ("lhs", "rhs"):
        letters = eq.lhs if operand == "lhs" else eq.rhs
        for c in letters:
            for a in axes:
                stripped = _strip_minor(table[c][operand], a)
                if stripped is None:
                    continue
                t = {k: dict(v) for k, v in table.items()}
                t[c][operand] = stripped
                if _local_inconsistency(eq, t) is None:
                    cls = "contracting" if c in eq.contracting else "batch" if c in eq.batch else "free"
                    return Pattern("all_gather", a, operand, c, cls)
    # reduce-scatter of the output along one letter, summing over one sharded contracting letter
    for c in eq.out:
        for a in axes:
            stripped = _strip_minor(table[c]["out"], a)
            if stripped is None:
                continue
            for k in eq.contracting:
                sl, sr = _strip_minor(table[k]["lhs"], a), _strip_minor(table[k]["rhs"], a)
                if sl is None or sr is None:
                    continue
                t = {kk: dict(v) for kk, v in table.items()}
                t[c]["out"], t[k]["lhs"], t[k]["rhs"] = stripped, sl, sr
                if _local_inconsistency(eq, t) is None:
                    cls = "batch" if c in eq.batch else "free_lhs" if c in eq.lhs else "free_rhs"
                    return Pattern("reduce_scatter", a, None, c, cls, k)
    # explain the common layouts we do not decompose
    for k in eq.contracting:
        shared = set(table[k]["lhs"]) & set(table[k]["rhs"])
        out_axes = {a for c in eq.out for a in table[c]["out"]}
        if shared and not shared & out_axes:
            raise ProblemError("out_spec", f"layout not decomposed: contracting letter {k!r} is sharded "
                                           f"over {'/'.join(sorted(shared))} in both operands and the output "
                                           "is not sharded over it, which needs an all-reduce, not an "
                                           "all-gather or reduce-scatter")
    raise ProblemError("out_spec", f"layout not decomposed: {why}, and no single all-gather of one "
                                   "operand or reduce-scatter of the output makes the einsum local")
