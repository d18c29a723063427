"""Every strategy's overlap structure simulated as a schedule of tasks on the cpu, the links
and the message resource; `predict` picks the model's fastest strategy of `space`."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autotuner.costmodel.params import CostModelError, Params
from autotuner.device import Device
from autotuner.problem import DTYPE_BYTES, Problem
from autotuner.strategy import Strategy

# ============================================================================ problem geometry


@dataclass(frozen=True)
class Geometry:
    """What the model needs of a problem, per device of the collective axis."""

    kind: str          # all_gather | reduce_scatter | none
    n: int
    blk: int           # per-device block of the decomposed letter
    shard_bytes: float  # bytes of the block that travels (gathered operand's / accumulator's block)
    flops: float       # the whole local einsum (all n blocks)
    in_bytes: float    # bytes the whole local einsum reads (gathered operand whole)
    out_bytes: float   # bytes of the local result (for reduce-scatter: the unreduced partial, all blocks)
    comm_bytes: float  # what the baseline's collective moves (Problem.comm_bytes)


def geometry(problem: Problem) -> Geometry:
    from autotuner.decompose._common import Layout

    pat, n = problem.pattern, problem.axis_size
    item = DTYPE_BYTES[problem.dtype]
    mesh, sizes = problem.mesh_shape, problem.sizes

    def local(letters: str, shape: Sequence[int], spec: Sequence[Sequence[str]]) -> dict[str, int]:
        return {c: d // math.prod(mesh[a] for a in e) for c, d, e in zip(letters, shape, spec, strict=True)}

    lhs = local(problem.eq.lhs, problem.lhs.shape, problem.lhs.spec)
    rhs = local(problem.eq.rhs, problem.rhs.shape, problem.rhs.spec)
    out = local(problem.eq.out, problem.out_shape, problem.out_spec)
    if pat.kind == "all_gather":
        (lhs if pat.operand == "lhs" else rhs)[pat.letter] *= n
        out = dict(out)
        if pat.letter in out:
            out[pat.letter] = max(out[pat.letter], lhs.get(pat.letter, 0), rhs.get(pat.letter, 0))
    elif pat.kind == "reduce_scatter":
        out = dict(out)
        out[pat.letter] *= n
    dims = {**lhs, **rhs}
    flops = 2.0 * math.prod(dims[c] for c in set(problem.eq.lhs) | set(problem.eq.rhs))
    in_bytes = float(item * (math.prod(lhs.values()) + math.prod(rhs.values())))
    out_bytes = float(item * math.prod(out.values()))
    if pat.kind == "none":
        return Geometry("none", n, 1, 0.0, flops, in_bytes, out_bytes, 0.0)
    operand = "out" if pat.kind == "reduce_scatter" else pat.operand
    blk = Layout(problem, pat.axis, n).local_extent(operand, pat.letter)
    if pat.kind == "all_gather":
        x = lhs if pat.operand == "lhs" else rhs
        shard = item * math.prod(x.values()) / n
    else:
        shard = out_bytes / n
    del sizes
    return Geometry(pat.kind, n, blk, float(shard), flops, in_bytes, out_bytes, float(problem.comm_bytes()))


# ============================================================================ the schedule


@dataclass
class _Task:
    res: str            # cpu | r | l
    work: float         # seconds at full rate
    deps: list[int]
    order: int          # program order on its resource
    done: float = math.nan
    left: float = 0.0


LINKS = ("r", "l")


class _Schedule:
    """Tasks on the cpu and on one link per direction, started as soon as their inputs are ready,
    as XLA:CPU's executor runs thunks once their operands are there: a link carries one transfer
    at a time (the first ready in program order), the cpu runs every ready einsum at once (up to
    `slots`), sharing its rate. So `send_first` (the order of a step's transfer and einsum in the
    program) does not change the schedule (measured here, it made no consistent difference), and
    straight-line code whose partial einsums do not wait for data (the reduce-scatter ring) runs
    them all together, late for the ring's chain, where a rolled loop runs one step's at a time.
    The cpu runs slower while a link is busy (1 + kappa), a link while the cpu computes
    (1 + kappa_x). Small (at most a few hundred tasks), simulated exactly between completions."""

    def __init__(self, kappa: float, kappa_x: float = 0.0, slots: int = 1):
        self.tasks: list[_Task] = []
        self.kappa, self.kappa_x, self.slots = kappa, kappa_x, max(1, int(slots))

    def add(self, res: str, work: float, deps: Sequence[int | None] = ()) -> int:
        self.tasks.append(_Task(res, max(0.0, work), [d for d in deps if d is not None], len(self.tasks)))
        return len(self.tasks) - 1

    def send(self, link: str, data_s: float, alpha: float, deps: Sequence[int | None] = ()) -> int:
        """A transfer: its data holds `link` for `data_s`, its per-message cost holds the one
        message resource (shared by both directions: the process handles one at a time) for
        `alpha`; it has arrived when both are done (a join)."""
        m = self.add("msg", alpha, deps)
        x = self.add(link, data_s, deps)
        return self.add("join", 0.0, [m, x])

    def makespan(self) -> float:
        ts = self.tasks
        waiting = [len(t.deps) for t in ts]  # inputs not yet done
        children: list[list[int]] = [[] for _ in ts]
        ready: dict[str, list[int]] = {}  # per resource, a heap of ready tasks in program order
        for i, t in enumerate(ts):
            t.left, t.done = t.work, math.nan
            ready.setdefault(t.res, [])
            for d in t.deps:
                children[d].append(i)
            if not t.deps:
                ready[t.res].append(i)  # i ascends: already a heap
        caps = {r: self.slots if r == "cpu" else 1 << 30 if r == "join" else 1 for r in ready}
        running: dict[str, list[int]] = {r: [] for r in ready}
        now = 0.0
        finished = 0
        while finished < len(ts):
            for r, q in ready.items():
                # a link carries one transfer at a time (the first ready in program order); the cpu
                # runs up to `slots` ready einsums at once, sharing its rate (XLA:CPU runs
                # independent thunks concurrently on one thread pool)
                run = running[r]
                while q and len(run) < caps[r]:
                    run.append(heapq.heappop(q))
            busy = {r: xs for r, xs in running.items() if xs}
            if not busy:
                raise CostModelError("schedule deadlock (a task waits on a later one)")
            links = any(r in LINKS for r in busy)
            cpu = "cpu" in busy
            rate = {r: ((1.0 / (1.0 + self.kappa) if links else 1.0) / len(xs)) if r == "cpu"
                    else (1.0 / (1.0 + self.kappa_x) if cpu else 1.0) if r in LINKS else 1.0
                    for r, xs in busy.items()}
            step = min(ts[i].left / rate[r] for r, xs in busy.items() for i in xs)
            now += step
            for r, xs in busy.items():
                for i in list(xs):
                    ts[i].left -= step * rate[r]
                    if ts[i].left <= 1e-15:
                        ts[i].done = now
                        xs.remove(i)
                        finished += 1
                        for c in children[i]:
                            waiting[c] -= 1
                            if not waiting[c]:
                                heapq.heappush(ready[ts[c].res], c)
        return now


def _iterations(trips: int, unroll: int | str) -> list[list[int]]:
    """Steps grouped per rolled-loop iteration (scan unrolled by `unroll`); one group when the
    loop is straight-line code."""
    if unroll == "full":
        return [list(range(trips))]
    u = int(unroll)
    return [list(range(s, min(s + u, trips))) for s in range(0, trips, u)]


def _loop(sch: _Schedule, trips: int, unroll: int | str, params: Params,
          body: Callable[[int, int | None], None]) -> int | None:
    """Emit `trips` steps with `body(step, gate)`. A rolled loop's iteration starts (`gate`: the
    loop's per-iteration overhead) only when every task of the previous one is done, and the code
    after the loop waits for the whole loop (the returned task); straight-line code has neither.
    With `params.loop_serial` the body's tasks also run one after another (what calibration says
    of the target's while loops)."""
    if trips <= 0:
        return None
    if unroll == "full":
        for t in range(trips):
            body(t, None)
        return None
    prev: list[int] = []
    for grp in _iterations(trips, unroll):
        gate = sch.add("cpu", params.loop_s, prev)
        start = len(sch.tasks)
        for t in grp:
            body(t, gate)
        if params.loop_serial:  # the body's ops in program order, none overlapping the next
            for i in range(start + 1, len(sch.tasks)):
                sch.tasks[i].deps.append(i - 1)
        prev = [gate, *range(start, len(sch.tasks))]
    return sch.add("cpu", 0.0, prev)


def simulate(problem: Problem, strategy: Strategy, params: Params, geo: Geometry | None = None) -> float:
    """Predicted seconds of `strategy` on `problem` (one repetition, max over devices)."""
    g = geo or geometry(problem)
    if strategy.is_baseline or g.kind == "none" or g.n == 1:
        comp = params.t_mm(g.flops, g.in_bytes + g.out_bytes)
        if g.kind == "all_gather":
            return _coll(params.ag, g.comm_bytes) + comp
        if g.kind == "reduce_scatter":
            return comp + _coll(params.rs, g.comm_bytes)
        return comp
    if strategy.method == "xla_windowed":  # XLA's own loop: a unidirectional ring, one chunk, rolled
        strategy = Strategy("ring", "uni", 1, 1 if g.n > 2 else "full", "loop", True)
    if g.kind == "all_gather":
        return _ag(g, strategy, params)
    return _rs(g, strategy, params)


def _coll(ab: tuple[float, float], nbytes: float) -> float:
    """A collective alone, a + b * bytes (a may be negative), never below a quarter of b * bytes."""
    return max(ab[0] + ab[1] * nbytes, 0.25 * ab[1] * nbytes)


def _piece(g: Geometry, params: Params, pieces: int, frac: float = 1.0) -> float:
    """One partial einsum: 1/pieces of the local einsum (times frac)."""
    return params.t_mm(g.flops / pieces * frac, (g.in_bytes + g.out_bytes) / pieces * frac)


def _ag(g: Geometry, s: Strategy, params: Params) -> float:
    """All-gather ring: device i multiplies the block it holds while sending it on."""
    n, c = g.n, s.chunks
    sch = _Schedule(params.kappa, params.kappa_x, params.cpu_slots)
    bidi = s.direction == "bidi"
    tx = params.t_data(g.shard_bytes / c, bidi)
    tc = _piece(g, params, n * c) + params.piece_s
    comps: list[int] = []

    def step(held: dict[str, list[int | None]], gate: int | None, send: bool) -> dict[str, list[int | None]]:
        """Pass the chunks held (per direction) on, if `send`, and multiply them."""
        nxt: dict[str, list[int | None]] = {d: [None] * c for d in held}
        if send:
            nxt = {d: [sch.send(d, tx, params.alpha, [h[k], gate]) for k in range(c)] for d, h in held.items()}
        comps.extend(sch.add("cpu", tc, [h[k], gate]) for h in held.values() for k in range(c))
        return nxt

    state: dict[str, dict[str, list[int | None]]] = {}

    def body(_t: int, gate: int | None) -> None:
        state["held"] = step(state["held"], gate, True)

    if not bidi:  # steps 0..n-2 are the loop, the last one is peeled
        state["held"] = {"r": [None] * c}
        done = _loop(sch, n - 1, s.unroll, params, body)
        step(state["held"], done, False)
    else:
        h, even = (n - 1) // 2, n % 2 == 0
        # step 0: the local block, sent both ways (multiplied once); then steps 1..h-1 the loop
        state["held"] = {d: [sch.send(d, tx, params.alpha) for _ in range(c)] for d in ("r", "l")}
        comps.extend(sch.add("cpu", tc, []) for _ in range(c))
        done = _loop(sch, h - 1, s.unroll, params, body)
        held = state["held"]
        halves: list[int] = []
        if even:  # the antipodal block arrives in halves, one from each side
            th = params.t_data(g.shard_bytes / c / 2, True)
            halves = [sch.send(d, th, params.alpha, [hh[k], done]) for d, hh in held.items() for k in range(c)]
        step(held, done, False)
        comps.extend(sch.add("cpu", _piece(g, params, n * c, 0.5) + params.piece_s, [x]) for x in halves)
    if s.fuse == "after":  # the stacked partial results, rolled and moved into place after the loop
        sch.add("cpu", params.after_copies * g.out_bytes / params.copy_bw, comps)
    return sch.makespan()


def _rs(g: Geometry, s: Strategy, params: Params) -> float:
    """Reduce-scatter ring: accumulators travel; each device adds its partial of the block."""
    n, c = g.n, s.chunks
    sch = _Schedule(params.kappa, params.kappa_x, params.cpu_slots)
    bidi = s.direction == "bidi"
    abytes = g.shard_bytes / c
    tx = params.t_data(abytes, bidi)
    tc = _piece(g, params, n * c) + params.piece_s
    tadd = 3.0 * abytes / params.copy_bw      # read two chunks, write one

    def hop(accs: list[int | None], gate: int | None, d: str) -> list[int | None]:
        """Send the accumulators one hop; add this device's partial (computed meanwhile)."""
        xs = [sch.send(d, tx, params.alpha, [accs[k], gate]) for k in range(c)]
        ps = [sch.add("cpu", tc, [gate]) for _ in range(c)]
        return [sch.add("cpu", tadd, [xs[k], ps[k]]) for k in range(c)]

    state: dict[str, list[int | None]] = {}
    if not bidi:
        state["r"] = [sch.add("cpu", tc, []) for _ in range(c)]

        def body(_t: int, gate: int | None) -> None:
            state["r"] = hop(state["r"], gate, "r")

        done = _loop(sch, n - 1, s.unroll, params, body)
        ends = [a for a in state["r"] if a is not None] + ([done] if done is not None else [])
    else:
        h, even = (n - 1) // 2, n % 2 == 0
        if even:  # step 0: the antipodal block's halves go first, one each way
            th = params.t_data(abytes / 2, True)
            half = _piece(g, params, n * c, 0.5) + params.piece_s
            pa = [sch.add("cpu", half, []) for _ in range(c)]
            pb = [sch.add("cpu", half, []) for _ in range(c)]
            xa = [sch.send("r", th, params.alpha, [pa[k]]) for k in range(c)]
            xb = [sch.send("l", th, params.alpha, [pb[k]]) for k in range(c)]
            pr = [sch.add("cpu", tc, []) for _ in range(c)]
            pl = [sch.add("cpu", tc, []) for _ in range(c)]
            state["r"] = [sch.add("cpu", tadd / 2, [xa[k], pr[k]]) for k in range(c)]
            state["l"] = [sch.add("cpu", tadd / 2, [xb[k], pl[k]]) for k in range(c)]
        else:
            state["r"] = [sch.add("cpu", tc, []) for _ in range(c)]
            state["l"] = [sch.add("cpu", tc, []) for _ in range(c)]

        def body(_t: int, gate: int | None) -> None:
            state["r"] = hop(state["r"], gate, "r")
            state["l"] = hop(state["l"], gate, "l")

        done = _loop(sch, h - 1, s.unroll, params, body)
        xr = [sch.send("r", tx, params.alpha, [state["r"][k], done]) for k in range(c)]
        xl = [sch.send("l", tx, params.alpha, [state["l"][k], done]) for k in range(c)]
        own = [sch.add("cpu", tc, [done]) for _ in range(c)]
        ends = [sch.add("cpu", tadd * 4 / 3, [xr[k], xl[k], own[k]]) for k in range(c)]
    if c > 1:  # the chunks concatenated into the output block
        sch.add("cpu", 2.0 * g.out_bytes / n / params.copy_bw, ends)
    return sch.makespan()


# ============================================================================ uses


def predict_all(problem: Problem, strategies: Sequence[Strategy], params: Params) -> dict[str, float]:
    """Predicted seconds per strategy key."""
    geo = geometry(problem)
    return {s.key: simulate(problem, s, params, geo) for s in strategies}


def ranker(params: Params, problem: Problem) -> Callable[[list[Strategy]], list[Strategy]]:
    """An `order` for `search.tune_problem(..., order=...)`: the candidates of `problem`,
    predicted-fastest first (a permutation of what it is given; ties by key)."""

    def order(cands: list[Strategy]) -> list[Strategy]:
        pred = predict_all(problem, cands, params)
        return sorted(cands, key=lambda s: (pred[s.key], s.key))

    return order



def predict(problem: Problem, device: Device | None, params: Params) -> tuple[Strategy, float]:
    """The strategy the model expects fastest for `problem` (of `space(problem, device)`) and its
    predicted speedup over the baseline (1.0 when the baseline is predicted fastest)."""
    from autotuner.decompose.space import space

    if params.num_devices and device is not None and device.num_devices != params.num_devices:
        raise CostModelError(f"calibrated on {params.num_devices} devices, asked about {device.num_devices}")
    cands = space(problem, device)
    pred = predict_all(problem, cands, params)
    base = pred[Strategy.baseline().key]
    best = min(cands, key=lambda s: (pred[s.key], not s.is_baseline, s.key))
    return best, (base / pred[best.key] if pred[best.key] > 0 else 1.0)
