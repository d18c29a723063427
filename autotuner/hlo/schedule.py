"""What a compiled XLA:TPU program costs, estimated from its own schedule. An estimate, never a
measurement: nothing here runs on a TPU.

XLA:TPU prints a scheduled module (`is_scheduled=true`: the instruction order is the order the
TensorCore issues them) and annotates nearly every op with its own cost model's
`"estimated_cycles"`. `estimate` walks that order once, as the chip would:
- an op with an estimate costs `cycles / clock` on the compute stream (`Chip.clock_hz`); ops with
  no work (parameters, tuples, bitcasts, constants) cost nothing; any other op without an estimate
  is counted (`unestimated_ops`) and costs nothing;
- an async collective (`*-start` ... `*-done`) starts its transfer when it is issued and the
  compute stream only waits at its `-done` if the transfer is not over; a synchronous one blocks;
- a transfer's duration comes from the interconnect, not from XLA (it gives no estimate for
  collectives): a collective-permute moves each source's operand to its target along the
  physical torus (dimension-order routing over the devices' coordinates, no wrap-around links on
  these small slices), the busiest directed link setting its time, plus `hop_latency_s` per
  transfer; a gather, scatter or reduction over a group of n devices runs as a bidirectional
  ring, n - 1 steps of 1/n of the data split over both directions of one link; transfers that
  need a link another transfer holds wait for it; two cores of one chip (v4) exchange through HBM;
- a while loop runs its body (and condition) its trip count times (`known_trip_count`, else the
  condition's compare against a constant); a loop beyond `MAX_SIMULATED_TRIPS` is extrapolated
  from its last simulated trip; a conditional costs its longest branch.
`overlapped_collectives` counts the async collectives with a dot scheduled inside their span:
where XLA's schedule hides communication behind the work that depends on it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from autotuner.hlo.chips import Chip
from autotuner.hlo.text import HloModule, Instr, parse_hlo

BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1, "bf16": 2, "f16": 2,
         "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8}
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                  "partition-id", "replica-id", "opt-barrier", "copy-start", "copy-done", "slice-start",
                  "slice-done", "custom-call", "get-dimension-size", "add-dependency"})
RING = {"all-gather": 1, "reduce-scatter": 1, "all-to-all": 1, "all-reduce": 2}  # ring passes
PERMUTE = "collective-permute"
MAX_SIMULATED_TRIPS = 64
UNESTIMATED_BYTES = 4096  # smaller ops without an estimate (a loop's counters) are not counted
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass(frozen=True)
class Placement:
    """Where each partition of the program runs: its chip's coordinates on the slice (and the
    slice's extent per axis). Partition i is the mesh's i-th device."""

    coords: tuple[tuple[int, ...], ...]

    def route(self, a: int, b: int) -> list[tuple[tuple[int, ...], int, int]]:
        """The directed links from partition a's chip to b's: dimension order, no wrap-around."""
        here, there = list(self.coords[a]), self.coords[b]
        links = []
        for d in range(len(here)):
            step = 1 if there[d] > here[d] else -1
            while here[d] != there[d]:
                links.append((tuple(here), d, step))
                here[d] += step
        return links


@dataclass
class ScheduleEstimate:
    estimated_s: float = 0.0
    compute_s: float = 0.0
    collective_s: float = 0.0      # the transfers' own durations, summed
    exposed_s: float = 0.0         # time the compute stream waited for communication
    collectives: int = 0           # executed collectives (loop trips counted)
    async_collectives: int = 0
    overlapped_collectives: int = 0  # async ones with a dot scheduled inside their span
    unestimated_ops: int = 0       # array ops (> 4 KiB) with no compiler estimate (cost 0)
    unknown_trips: int = 0         # loops whose trip count was not found (run once)

    @property
    def hidden_fraction(self) -> float | None:
        """How much of the transfers' time the schedule hid behind compute."""
        if self.collective_s <= 0:
            return None
        return max(0.0, 1.0 - self.exposed_s / self.collective_s)

    def to_dict(self) -> dict[str, float | int | None]:
        return {**asdict(self), "hidden_fraction": self.hidden_fraction}


@dataclass
class _State:
    t: float = 0.0                                   # the compute stream's clock
    compute: float = 0.0
    dots: int = 0
    link_free: dict = field(default_factory=dict)    # directed link -> when it is free
    ring_free: float = 0.0                           # ring collectives hold every link
    inflight: dict = field(default_factory=dict)     # start op name -> [end, compute at start, dots at start]
    orphans: list = field(default_factory=list)      # the same, for starts a done cannot name (loop carries)
    est: ScheduleEstimate = field(default_factory=ScheduleEstimate)


def estimate(text: str, chip: Chip, placement: Placement) -> ScheduleEstimate:
    """The estimate of one compiled module's text (`compiled.as_text()`) on `chip`."""
    mod = parse_hlo(text)
    entry = _entry(text, mod)
    sim = _Sim(mod, chip, placement)
    st = _State()
    sim.run(entry, st)
    ends = [v[0] for v in st.inflight.values()] + [v[0] for v in st.orphans]
    st.est.estimated_s = max([st.t, *ends])
    st.est.compute_s = st.compute
    return st.est


def _entry(text: str, mod: HloModule) -> str:
    m = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    if m and m.group(1) in mod.computations:
        return m.group(1)
    return list(mod.computations)[-1]


def array_bytes(ins: Instr | None) -> int:
    if ins is None or ins.shape is None or ins.etype is None:
        return 0
    n = 1
    for d in ins.shape:
        n *= d
    return n * BYTES.get(ins.etype, 4)


def _group_size(ins: Instr) -> int:
    """Devices per replica group, in each of the forms XLA prints: `{{0,1,..}}`, iota
    `[groups,size]<=[n]`, and named `mesh['axis_0'=1,'axis_1'=8] {'axis_1'}`."""
    rg = ins.attrs.get("replica_groups", "")
    m = re.match(r"\[(\d+),(\d+)\]<=", rg)
    if m:
        return int(m.group(2))
    m = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", rg)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        n = 1
        for axis in re.findall(r"'([^']+)'", m.group(2)):
            n *= sizes.get(axis, 1)
        return n
    first = re.match(r"\{\{([^}]*)\}", rg)
    if first:
        return len([x for x in first.group(1).split(",") if x.strip()])
    return 1


def _pairs(ins: Instr) -> list[tuple[int, int]]:
    nums = ins.attr_ints("source_target_pairs")
    return list(zip(nums[::2], nums[1::2], strict=False))


class _Sim:
    def __init__(self, mod: HloModule, chip: Chip, placement: Placement):
        self.mod, self.chip, self.place = mod, chip, placement
        self._has_dot: dict[str, bool] = {}
        self._fused: dict[str, tuple[str, Instr] | None] = {}

    # -- costs ----------------------------------------------------------------------------------
    def _kind(self, op: str) -> tuple[str, bool] | None:
        """(collective kind, async) of an op that starts or is a collective, else None."""
        base = op[:-6] if op.endswith("-start") else op
        if base == PERMUTE or base in RING:
            return base, op.endswith("-start")
        return None

    def _bytes(self, ins: Instr) -> int:
        return sum(array_bytes(self.mod.op(o)) for o in ins.operands)

    def _transfer(self, ins: Instr, kind: str, st: _State, issue: float, group: Instr | None = None) -> float:
        """Reserve the links a collective needs from `issue` on; returns when it ends. `group`:
        the instruction that names its replica groups (a fused collective's inner one)."""
        chip, size = self.chip, self._bytes(ins)
        if kind == PERMUTE:
            load: dict = {}
            local = 0
            for a, b in _pairs(ins):
                if a >= len(self.place.coords) or b >= len(self.place.coords):
                    continue
                route = self.place.route(a, b)
                if not route:
                    local = max(local, size)
                for link in route:
                    load[link] = load.get(link, 0) + size
            dur = chip.hop_latency_s + max([v / chip.link_bytes_per_s for v in load.values()]
                                           + [local / (chip.hbm_bytes_per_s / chip.cores)])
            begin = max([issue, st.ring_free, *(st.link_free.get(k, 0.0) for k in load)])
            for k in load:
                st.link_free[k] = begin + dur
        else:
            n = _group_size(group or ins)
            if kind == "all-gather":
                size *= n  # the operand is one device's part of the result
            steps = RING[kind] * max(n - 1, 0)
            dur = steps * (chip.hop_latency_s + size / max(n, 1) / (2 * chip.link_bytes_per_s))
            begin = max([issue, st.ring_free, *st.link_free.values()])
            st.ring_free = begin + dur
        st.est.collective_s += dur
        st.est.collectives += 1
        return begin + dur

    def _fused_collective(self, comp: str) -> tuple[str, Instr] | None:
        """(kind, the collective) a fusion runs: XLA:TPU fuses an all-reduce and the dynamic
        slice after it into one "all-reduce-scatter" fusion, a reduce-scatter of its operand."""
        if comp not in self._fused:
            names = self.mod.computations.get(comp, [])
            inner = [(k[0], i) for n in names
                     if (k := self._kind((i := self.mod.instrs[n]).opcode)) is not None]
            found = inner[0] if inner else None
            if found is not None and found[0] == "all-reduce" and self.mod.instrs[names[-1]].opcode == "dynamic-slice":
                found = ("reduce-scatter", found[1])
            self._fused[comp] = found
        return self._fused[comp]

    def _has_dots(self, comp: str) -> bool:
        if comp not in self._has_dot:
            ops = [self.mod.instrs[n] for n in self.mod.computations.get(comp, [])]
            self._has_dot[comp] = any(i.opcode in ("convolution", "dot")
                                      or (i.opcode == "fusion" and self._has_dots(_called(i, "calls")))
                                      for i in ops)
        return self._has_dot[comp]

    # -- the walk -------------------------------------------------------------------------------
    def run(self, comp: str, st: _State) -> None:
        for name in self.mod.computations.get(comp, []):
            self.step(self.mod.instrs[name], st)

    def step(self, ins: Instr, st: _State) -> None:
        op = ins.opcode
        kind = self._kind(op)
        if kind is not None:
            if kind[1]:
                st.inflight[ins.name] = [self._transfer(ins, kind[0], st, st.t), st.compute, st.dots]
                st.est.async_collectives += 1
            else:
                end = self._transfer(ins, kind[0], st, st.t)
                st.est.exposed_s += end - st.t
                st.t = end
            return
        if op.endswith("-done") and self._kind(op[:-5] + "-start") is not None:
            self._done(ins, st)
            return
        if op == "while":
            self._loop(ins, st)
            return
        if op == "call":
            self.run(_called(ins, "to_apply"), st)
            return
        if op == "conditional":
            self._branches(ins, st)
            return
        if op == "fusion" and (inner := self._fused_collective(_called(ins, "calls"))) is not None:
            end = self._transfer(ins, inner[0], st, st.t, inner[1])   # XLA:TPU fuses a collective with its slice
            st.est.exposed_s += end - st.t
            st.t = end
            return
        m = _CYCLES.search(ins.attr_text)
        if m:
            dt = int(m.group(1)) / self.chip.clock_hz
            st.t += dt
            st.compute += dt
            if op in ("convolution", "dot") or (op == "fusion" and self._has_dots(_called(ins, "calls"))):
                st.dots += 1
        elif op not in FREE and array_bytes(ins) > UNESTIMATED_BYTES:
            st.est.unestimated_ops += 1

    def _done(self, ins: Instr, st: _State) -> None:
        start = ins.operands[0] if ins.operands else ""
        rec = st.inflight.pop(start, None)
        if rec is None and st.orphans:   # started in an earlier trip, carried through the loop
            rec = st.orphans.pop(0)
        if rec is None:
            return
        end, compute0, dots0 = rec
        if st.dots > dots0:
            st.est.overlapped_collectives += 1
        if end > st.t:
            st.est.exposed_s += end - st.t
            st.t = end

    def _loop(self, ins: Instr, st: _State) -> None:
        body, cond = _called(ins, "body"), _called(ins, "condition")
        trips = self._trips(ins, cond)
        if trips is None:
            st.est.unknown_trips += 1
            trips = 1
        for i in range(min(trips, MAX_SIMULATED_TRIPS)):
            t0, c0 = st.t, st.compute
            before = copy.deepcopy(st.est) if i == MAX_SIMULATED_TRIPS - 1 else None
            self._trip(body, cond, st)
        if trips > MAX_SIMULATED_TRIPS and before is not None:
            rest = trips - MAX_SIMULATED_TRIPS
            st.t += rest * (st.t - t0)
            st.compute += rest * (st.compute - c0)
            for name in ("collective_s", "exposed_s", "collectives", "async_collectives",
                         "overlapped_collectives", "unestimated_ops"):
                one = getattr(st.est, name) - getattr(before, name)
                setattr(st.est, name, getattr(st.est, name) + rest * one)
        self.run(cond, st)

    def _trip(self, body: str, cond: str, st: _State) -> None:
        self.run(cond, st)
        carried = list(st.inflight.values())  # starts whose done comes in the next trip
        st.inflight.clear()
        st.orphans.extend(carried)
        self.run(body, st)

    def _trips(self, ins: Instr, cond: str) -> int | None:
        m = _TRIPS.search(ins.attr_text)
        if m:
            return int(m.group(1))
        names = self.mod.computations.get(cond, [])
        if not names:
            return None
        root = self.mod.instrs[names[-1]]
        if root.opcode != "compare" or len(root.operands) != 2:
            return None
        a, b = (self.mod.op(o) for o in root.operands)
        direction = root.attrs.get("direction", "")
        if b is not None and b.opcode != "constant" and a is not None and a.opcode == "constant":
            a, b = b, a
            direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
        bound = _const(b, self.mod)
        if a is None or bound is None or a.opcode != "get-tuple-element":
            return None
        index = int(a.attrs.get("index", "-1"))
        init, step = self._init(ins, index), self._step(_called(ins, "body"), index)
        if init is None or step is None or step == 0:
            return None
        span = {"LT": bound - init, "LE": bound - init + 1, "GT": init - bound, "GE": init - bound + 1}.get(direction)
        return None if span is None else max(-(-span // abs(step)), 0)

    def _step(self, body: str, index: int) -> int | None:
        """How much the body adds to the counter at `index` (the root tuple's `add(counter, c)`)."""
        names = self.mod.computations.get(body, [])
        root = self.mod.instrs[names[-1]] if names else None
        if root is None or root.opcode != "tuple" or not 0 <= index < len(root.operands):
            return None
        upd = self.mod.op(root.operands[index])
        if upd is None or upd.opcode not in ("add", "subtract") or len(upd.operands) != 2:
            return None
        x, y = (self.mod.op(o) for o in upd.operands)
        c = _const(y, self.mod) if upd.opcode == "subtract" else (_const(y, self.mod) if _const(y, self.mod) is not None
                                                                  else _const(x, self.mod))
        if c is None:
            return None
        return -c if upd.opcode == "subtract" else c

    def _init(self, ins: Instr, index: int) -> int | None:
        tup = self.mod.op(ins.operands[0]) if ins.operands else None
        if tup is None or tup.opcode != "tuple" or not 0 <= index < len(tup.operands):
            return None
        return _const(self.mod.op(tup.operands[index]), self.mod)

    def _branches(self, ins: Instr, st: _State) -> None:
        names = re.findall(r"%?([\w.\-]+)", ins.attrs.get("branch_computations", ""))
        names = names or [_called(ins, "true_computation"), _called(ins, "false_computation")]
        best: _State | None = None
        for comp in names:
            trial = copy.deepcopy(st)
            self.run(comp, trial)
            if best is None or trial.t > best.t:
                best = trial
        if best is not None:
            st.__dict__.update(best.__dict__)


def _called(ins: Instr, key: str) -> str:
    return ins.attrs.get(key, "").strip().lstrip("%")


def _const(ins: Instr | None, mod: HloModule | None = None) -> int | None:
    """An integer constant's value, through the copies and converts XLA puts in front of it."""
    while ins is not None and mod is not None and ins.opcode in ("copy", "convert", "bitcast") and ins.operands:
        ins = mod.op(ins.operands[0])
    if ins is None or ins.opcode != "constant":
        return None
    try:
        return int(ins.operand_text.strip())
    except ValueError:
        return None


def placement_of(devices: Sequence[object]) -> Placement:
    """The chips of a mesh's devices, in partition order (`mesh.devices.flat`)."""
    return Placement(tuple(tuple(int(c) for c in getattr(d, "coords", (i,))) for i, d in enumerate(devices)))
