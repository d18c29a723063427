"""The measurement harness: compile, check numerics, warm up, time, summarize.

The only module that times anything. A `Runner` owns the compiled programs of one problem on one
mesh and times one program for one repetition; `LocalRunner` does it in this process (in-process
devices, or one process of the lab, where `sync` aligns the processes), the lab's parent side
forwards the same calls to the lab (see `autotuner.measure.lab_target`). `run_session` drives a runner:
baseline and candidates in one session, repetitions interleaved, robust summaries, the ratio to
baseline with a bootstrap confidence interval, the bound max(T_comm, T_comp) + fill and the
overlap efficiency (T_base - T) / (T_base - T_bound).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from autotuner.measure.adaptive import BUDGET, CAP, FIXED, Precision, decide
from autotuner.measure.stats import Summary, aa_width, bound, efficiency, ratio_ci
from autotuner.measurement import overlap_speedup
from autotuner.problem import Problem
from autotuner.strategy import Strategy

COMM, COMP = "comm", "comp"  # program ids of the collective alone and the einsum alone
AA_KEY = "baseline (A/A)"    # the baseline entered a second time (SessionResult.aa)


@dataclass
class Candidate:
    strategy: dict[str, Any]
    key: str
    status: str = "ok"                 # ok | failed
    reason: str | None = None
    compile_s: float | None = None
    memory: dict[str, int] | None = None
    error: float | None = None         # relative error against the baseline's result
    samples: list[float] = field(default_factory=list)
    median_s: float | None = None
    iqr_s: float | None = None
    min_s: float | None = None
    n: int = 0
    ratio: float | None = None         # baseline / this (> 1 is faster than baseline)
    ratio_lo: float | None = None
    ratio_hi: float | None = None
    efficiency: float | None = None
    pruned: bool = False               # timing stopped early by the tuner's pruner
    aa_width: float | None = None      # its session's A/A width (stats.aa_width)
    schedule: dict[str, Any] | None = None  # an estimate target's reading of the compiled schedule
    #                                         (autotuner.hlo.schedule.ScheduleEstimate.to_dict)

    def fail(self, reason: str) -> None:
        self.status, self.reason = "failed", reason

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


NO_SPLIT: dict[str, float | None] = {"serial_s": None, "traffic_speedup": None, "overlap_speedup": None}


def split(c: Candidate, control: Candidate | None) -> dict[str, float | None]:
    """A ring's speedup split by its serial control (`Strategy.serial`) timed in the same session:
    `serial_s` (the control's median), `traffic_speedup` = reference / control (what decomposing
    saves without overlap: the transfers the ring moves instead of the collective's) and
    `overlap_speedup` = control / ring (what running the transfers beside the einsums adds); their
    product is the ring's `ratio`. All None without a usable control."""
    if control is None or control.status != "ok" or c.status != "ok":
        return dict(NO_SPLIT)
    traffic, ratio = control.ratio, c.ratio
    if traffic is None or ratio is None or not (math.isfinite(traffic) and math.isfinite(ratio)) or traffic <= 0:
        return dict(NO_SPLIT)
    return {"serial_s": control.median_s, "traffic_speedup": traffic, "overlap_speedup": overlap_speedup(ratio, traffic)}


def controls_of(cands: Sequence[Candidate]) -> dict[int, Candidate]:
    """`id(ring candidate)` -> its serial control, for each control in `cands` (the candidates of
    one or more sessions, in order): the ring is the latest candidate of its key before the
    control, so both come from the control's session (`run_session` keeps the given order)."""
    out: dict[int, Candidate] = {}
    latest: dict[str, Candidate] = {}
    for c in cands:
        s = Strategy.from_dict(c.strategy)
        if s.is_control and s.ring().key in latest:
            out[id(latest[s.ring().key])] = c
        latest[c.key] = c
    return out


@dataclass
class SessionResult:
    problem: dict[str, Any]
    baseline: Candidate                # the reference every ratio is over: the baseline, or plain on TPU
    candidates: list[Candidate]
    comm_s: float | None
    comp_s: float | None
    bound_s: float | None
    reps: int                          # repetitions done (more than asked when adaptive)
    seconds: float
    aa: Candidate | None = None        # the A/A twin: the baseline entered a second time
    aa_width: float | None = None      # stats.aa_width of the twin's ratio CI
    stop: str = "fixed"                # why the repetitions stopped (adaptive.FIXED, TARGET, ...)

    def ok(self) -> list[Candidate]:
        return [c for c in [self.baseline, *self.candidates] if c.status == "ok"]

    def best(self) -> Candidate:
        """The fastest ok candidate by median (the baseline if nothing beats it)."""
        return min(self.ok(), key=lambda c: c.median_s if c.median_s is not None else math.inf,
                   default=self.baseline)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["baseline"] = self.baseline.to_dict()
        d["candidates"] = [c.to_dict() for c in self.candidates]
        d["aa"] = self.aa.to_dict() if self.aa is not None else None
        return d


class Runner(Protocol):
    estimates: bool   # True: `time` returns the compiled program's estimated time, nothing runs

    def prepare(self, problem: Problem, strategies: Sequence[Strategy], parts: bool = True
                ) -> list[dict[str, Any]]:
        """Build and compile the baseline (index 0 must be it), the candidates and the parts;
        check each candidate's numbers against the baseline; warm up. One status dict per
        strategy: {"ok", "reason", "compile_s", "memory", "rel_error"}; plus parts' status."""
        ...

    def time(self, program: int | str) -> float:
        """One repetition of one prepared program (an index, COMM or COMP), seconds, max over
        processes. Raises on failure."""
        ...


class Sync(Protocol):
    def barrier(self) -> None: ...
    def max_over_processes(self, value: float) -> float: ...


class NoSync:
    def barrier(self) -> None:
        pass

    def max_over_processes(self, value: float) -> float:
        return value



def run_session(runner: Runner, problem: Problem, strategies: Sequence[Strategy], *, reps: int = 7,
                log: Callable[[str], None] | None = None,
                on_rep: Callable[[int, int], None] | None = None,
                prune: Callable[[int, Candidate, Candidate, int], bool] | None = None,
                parts: bool = True, aa: bool = False,
                precision: Precision | None = None, reference: Strategy | None = None) -> SessionResult:
    """Measure `strategies` in one interleaved session against `reference` (default the
    baseline; `autotuner.strategy.reference` of the target's platform), which is put first if it
    is not (every ratio is over it; `SessionResult.baseline` holds it).

    `parts=False` skips timing the collective and the einsum alone (no bound then; a tuner
    needs them once per problem, not once per batch).
    `prune(index, candidate, baseline, reps_done)` is asked after every repetition from the third
    on; when it says True the candidate's timing stops there (its samples so far are kept).
    `aa=True` enters the baseline a second time, compiled and timed like any candidate (the A/A
    twin, `SessionResult.aa`, never a winner): its ratio CI against the baseline is the noise
    floor of this session (`SessionResult.aa_width`, see `stats.aa_width`).
    `precision` (see `adaptive.Precision`): after the `reps` fixed repetitions, repeat the
    baseline, the twin and the candidates that could still win until the leader's speedup CI is
    that narrow or the time budget ends (`SessionResult.stop` says which).
    A ring's serial control (`Strategy.serial`) is timed exactly when its ring is, so that the
    two have the same repetitions (`split`); it never leads or stops the session.
    """
    t_start = time.perf_counter()
    ref = reference if reference is not None else Strategy.baseline()
    strategies = list(strategies)
    if not strategies or strategies[0] != ref:
        strategies = [ref] + [s for s in strategies if s != ref]
    exact = bool(getattr(runner, "estimates", False))  # an estimate is one number, no interval
    cands = [Candidate(s.to_dict(), s.key) for s in strategies]
    if aa:  # last, so the candidates keep their indices (a tuner's prune maps them to trials)
        strategies.append(strategies[0])
        cands.append(Candidate(strategies[0].to_dict(), AA_KEY))
    twin = len(cands) - 1 if aa else None
    # a ring's serial control rides along with its ring: timed while the ring is, never a contender
    by_key = {c.key: i for i, c in enumerate(cands)}
    ride = {i: by_key.get(st.ring().key) for i, st in enumerate(strategies) if st.is_control}
    for c, st in zip(cands, runner.prepare(problem, strategies, parts), strict=True):
        c.compile_s, c.memory, c.error = st.get("compile_s"), st.get("memory"), st.get("rel_error")
        c.schedule = st.get("schedule")
        if not st["ok"]:
            c.fail(st["reason"] or "failed")
            if log:
                log(f"  {c.key}: failed: {c.reason}")
    base = cands[0]
    has_parts = parts and problem.pattern.kind != "none" and base.status == "ok"
    live = [i for i, c in enumerate(cands) if c.status == "ok"]
    adaptive = precision is not None and precision.on
    stop, t_fixed = FIXED, (math.inf if reps > 0 else time.perf_counter())
    comm: list[float] = []
    comp: list[float] = []
    r = 0
    while r < reps or adaptive:
        # interleave: rotate the order every repetition so no program always runs first
        order: list[int | str] = live[r % len(live):] + live[: r % len(live)] if live else []
        if has_parts and r < reps:
            order += [COMM, COMP] if r % 2 == 0 else [COMP, COMM]
        for prog in order:
            if isinstance(prog, int) and (cands[prog].status != "ok" or cands[prog].pruned):
                continue
            try:
                t = runner.time(prog)
            except Exception as e:  # noqa: BLE001
                if isinstance(prog, int):
                    cands[prog].fail(f"{type(e).__name__} while timing: {e}"[:2000])
                    if log:
                        log(f"  {cands[prog].key}: failed: {cands[prog].reason}")
                    continue
                has_parts = False
                comm, comp = [], []
                continue
            if prog == COMM:
                comm.append(t)
            elif prog == COMP:
                comp.append(t)
            else:
                cands[prog].samples.append(t)
        r += 1
        if prune and r >= 3 and base.status == "ok":
            for i in live[1:]:
                c = cands[i]
                if i != twin and c.status == "ok" and not c.pruned and prune(i, c, base, r):
                    c.pruned = True
                    if log:
                        log(f"  {c.key}: pruned after {r} repetitions")
        if on_rep:
            on_rep(r, reps if not adaptive or r < reps else r + 1)
        if r < reps:
            continue
        if r == reps:
            t_fixed = time.perf_counter()
        if not adaptive or base.status != "ok":
            break
        assert precision is not None
        timed = _timed(cands, [i for i in live if i not in ride], twin)
        decision = decide(base.samples, timed, precision, aa=twin in timed)
        stop = decision.stop or (CAP if r >= precision.max_reps else None) or (
            BUDGET if time.perf_counter() - t_fixed >= precision.seconds else None) or ""
        if stop:
            break
        live = [i for i in live if i in (0, twin) or i in decision.keep or ride.get(i, -1) in decision.keep]
    if log and adaptive and r > reps:
        log(f"  {r} repetitions ({stop})")
    for c in cands:
        if c.status == "ok":
            s = Summary.of(c.samples)
            c.median_s, c.iqr_s, c.min_s, c.n = s.median, s.iqr, s.min, s.n
    t_comm = Summary.of(comm).median if comm else None
    t_comp = Summary.of(comp).median if comp else None
    t_bound = (bound(t_comm, t_comp, problem.axis_size, base.median_s if base.status == "ok" else None)
               if t_comm is not None and t_comp is not None else None)
    for c in cands:
        if c.status != "ok" or base.status != "ok":
            continue
        c.ratio, lo, hi = ratio_ci(base.samples, c.samples)
        if exact:
            lo = hi = c.ratio
        c.ratio_lo = None if math.isnan(lo) else lo
        c.ratio_hi = None if math.isnan(hi) else hi
        if t_bound is not None and base.median_s is not None and c.median_s is not None:
            c.efficiency = efficiency(base.median_s, c.median_s, t_bound)
    twin_c = cands.pop() if aa else None
    width = aa_width(twin_c.ratio_lo, twin_c.ratio_hi) if twin_c is not None else None
    for c in cands:
        c.aa_width = width
    return SessionResult(problem.to_dict(), base, cands[1:], t_comm, t_comp, t_bound, r,
                         time.perf_counter() - t_start, aa=twin_c, aa_width=width, stop=stop)


# the programs that are some platform's reference (`autotuner.strategy.reference`)
REFERENCES = ("baseline", "plain")


def _timed(cands: list[Candidate], live: list[int], twin: int | None) -> dict[int, list[float]]:
    """The candidates still timed (the reference and the twin aside); in an A/A session, where
    nothing else is left, the twin itself, so that it is its CI that narrows. The other
    reference (plain beside the baseline, or the baseline beside plain) keeps its fixed
    repetitions: it is there to be compared with, and as close to the reference as it usually is,
    its interval would keep every session repeating to its budget for a choice that rewrites
    nothing."""
    ref = cands[0].strategy.get("method")
    timed = {i: cands[i].samples for i in live
             if i not in (0, twin) and cands[i].status == "ok" and not cands[i].pruned
             and (cands[i].strategy.get("method") not in REFERENCES or cands[i].strategy.get("method") == ref)}
    if not timed and twin is not None and cands[twin].status == "ok":
        timed = {twin: cands[twin].samples}
    return timed
