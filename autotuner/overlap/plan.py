"""Plan: what the pass does to a program, one `PlanRow` per pair, and the `Plan` that lists them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

from autotuner.answer import Answer
from autotuner.problem import GroupedProblem, Problem
from autotuner.strategy import Strategy


@dataclass(frozen=True)
class PlanRow:
    """One decomposable pair of the program and what the pass does with it. `answer`: the
    lookup answer (the decision table's, `autotuner.runtime.collective`) the pass chose from,
    where it asked for one (`strategy="auto"`; None for forced, callable, in-program rows);
    `source` and `speedup` are the row's own (set for every row, an answer's where the pass
    followed it)."""

    name: str                 # the dot's name stack, e.g. transpose(jvp(bsd,df->bsf))
    where: str                # user source of the einsum (file:line (function))
    form: str                 # the collective as compiled: all-gather | reduce-scatter | all-reduce+dynamic-slice
    problem: Problem | GroupedProblem | None   # a GroupedProblem for each dot of a shared gather
    strategy: Strategy        # what runs (baseline: the plain jit equation)
    source: str               # forced | callable | tuned | in-job | nearest | model | default | unmapped | ...
    speedup: float | None     # predicted speedup of the pair (baseline time / its time), if known
    count: int                # runs per call of the program
    note: str = ""            # why baseline, or anything to know
    member: int | None = None  # the dot's index in its GroupedProblem (None: a single problem)
    served_by: str = ""       # the pair whose ring keeps this dot's gathered operand for it (its collective is gone)
    kept_bytes: int = 0       # bytes per device this pair's ring keeps alive for its gather's other users
    xla: str = ""             # what plain jit's compiler does with the pair itself: "windowed" (XLA:TPU's
    #                           windowed einsum, on by default above its size threshold), else ""
    left: str = "baseline"    # what a pair left alone runs: baseline, or plain where the compiler may
    #                           decompose it itself (TPU); a baseline chosen there is applied
    answer: Answer | None = None  # the answer chosen from (strategy="auto"), else None

    @property
    def key(self) -> str | None:
        return self.problem.key if self.problem is not None else None

    @property
    def applied(self) -> bool:
        """Whether the pass rewrote this pair (`overlap.choose.applies`)."""
        return self.strategy.rewrites or (self.strategy.is_baseline and self.left != "baseline")

    @property
    def split(self) -> tuple[float, float] | None:
        """(traffic, overlap): the speedup this row runs for, split by its serial control, where
        the answer it follows was measured with one (`Answer.traffic_speedup`); else None. A user on
        other hardware sees here whether a winner was chosen for moving less or for overlap."""
        a = self.answer
        if a is None or a.strategy != self.strategy or a.traffic_speedup is None or a.overlap_speedup is None:
            return None
        return a.traffic_speedup, a.overlap_speedup

    @property
    def saving(self) -> float | None:
        """Predicted fraction of the pair's time saved (1 - 1/speedup), if known."""
        return None if not self.speedup else 1.0 - 1.0 / self.speedup

    def unapplied(self, why: str) -> PlanRow:
        """This pair left as plain jit, and why."""
        return replace(self, strategy=Strategy(self.left), note=why)


@dataclass(frozen=True)
class Memory:
    """Temp (scratch) bytes per device of the compiled step, plain jit and overlapped (None where
    not compiled or not known), and the bound the pass kept to (a growth fraction; None: none)."""

    plain_bytes: int | None = None
    overlapped_bytes: int | None = None
    bound: float | None = None

    @property
    def growth(self) -> float | None:
        from autotuner.overlap.memory import growth

        return growth(self.plain_bytes, self.overlapped_bytes)

    def __str__(self) -> str:
        from autotuner.overlap.memory import mib

        g = self.growth
        bound = "no bound" if self.bound is None else f"bound +{100 * self.bound:g}%"
        return (f"temp memory per device: plain {mib(self.plain_bytes)}, overlapped {mib(self.overlapped_bytes)}"
                + (f" ({100 * g:+.1f}%; {bound})" if g is not None else f" ({bound})"))


@dataclass
class Cost:
    """Seconds the pass spent preparing one signature, by phase: `trace`, the function traced
    with every dot tagged and lowered (plain jit traces and lowers too); `analysis`, the compile
    whose only products are the partitioned HLO and the plain step's temp bytes; `reading`,
    finding the pairs in that HLO and choosing their strategies; `rewrite`, the rewritten
    program traced and lowered; `compile`, compiling the program that runs (with what the memory
    bound recompiles); `tuning`, measuring untuned pairs in the job (`tune="missing"`). A
    program with nothing to rewrite compiles as plain jit on its first call, outside these."""

    trace: float = 0.0
    analysis: float = 0.0
    reading: float = 0.0
    rewrite: float = 0.0
    compile: float = 0.0
    tuning: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Add the time of the `with` block to `phase`."""
        t = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - t)

    def as_dict(self) -> dict[str, float]:
        return {f.name: round(getattr(self, f.name), 3) for f in fields(self)} | {"total": round(self.total, 3)}

    def __str__(self) -> str:
        parts = [f"{f.name} {getattr(self, f.name):.2f}" for f in fields(self) if getattr(self, f.name)]
        return f"prepared in {self.total:.2f} s" + (f" ({', '.join(parts)})" if parts else "")


class Plan(list[PlanRow]):
    """The rows of `Overlapped.plan`; `notes`: what concerns the whole program; `memory`: the
    compiled step's temp bytes, plain and overlapped; `cost`: what preparing it took; `str()`:
    a table."""

    def __init__(self, rows: Any = (), notes: Any = (), memory: Memory | None = None, program: str = "",
                 cost: Cost | None = None) -> None:
        super().__init__(rows)
        self.notes: list[str] = list(notes)
        self.memory = memory or Memory()
        self.program = program   # `program_key` of the pairs the first analysis found ("" if none)
        self.cost = cost or Cost()

    def __str__(self) -> str:
        head = ("pair", "problem", "collective", "strategy", "source", "speedup", "traffic x overlap", "x", "note")
        rows = [head]
        for r in self:
            rows.append((r.name, (r.key or "-")[:12], r.form, r.strategy.key, r.source,
                         f"{r.speedup:.2f}" if r.speedup else "-", split_text(r.split), str(r.count), r.note))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
                 for row in rows]
        n = sum(r.applied for r in self)
        return "\n".join(lines + [f"{n} of {len(self)} pairs decomposed", str(self.memory), str(self.cost)]
                         + [f"note: {t}" for t in self.notes])


def split_text(split: tuple[float, float] | None) -> str:
    return f"{split[0]:.2f} x {split[1]:.2f}" if split else "-"


def program_key(rows: Any) -> str:
    """The program as the tuner sees it: its problems and how often each runs per call, hashed
    (16 hex digits; "" for no problem). In-program evidence (`autotuner tune-model`) is stored
    under it; `overlap` computes it from the pairs its first analysis finds, before choosing."""
    import hashlib

    counts: dict[str, int] = {}
    for r in rows:
        if r.problem is not None:
            counts[r.problem.key] = counts.get(r.problem.key, 0) + r.count
    if not counts:
        return ""
    text = ";".join(f"{k}x{n}" for k, n in sorted(counts.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def numbered(rows: list[PlanRow]) -> list[PlanRow]:
    """Rows whose names repeat (layers of a Python loop) get #2, #3, ... in program order."""
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        seen[r.name] = seen.get(r.name, 0) + 1
        out.append(r if seen[r.name] == 1 else replace(r, name=f"{r.name} #{seen[r.name]}"))
    return out
