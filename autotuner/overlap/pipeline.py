"""One input signature's preparation, as the pass's stages in order (`Build.run`):

    analyse (per round: compile -> find -> tune what is missing -> choose -> fit memory
      -> agree across processes) -> rewrite -> check memory -> report -> all processes together

Round 1 analyses the program with every dot tagged: only its partitioned HLO is wanted, so the
backend compiles it at its cheapest (or the texts come from the persistent cache). Each later
round compiles the rewritten program, the one that runs; with Auto layouts (which GSPMD may
choose differently around the rewritten dots) it is analysed too, for any new pairs. Explicit
layouts are part of the types, which the rewrite keeps: no new pair can appear, so nothing is
analysed there. The jaxpr is traced once for all rounds. Any stage that fails leaves the whole
program plain jit (`Fallback`): never worse than plain jit. In a multi-process job process 0's
plan is every process's, and all run it or all run plain jit (`overlap.agree`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from autotuner.overlap import agree
from autotuner.overlap.plan import Cost, Memory, Plan, PlanRow, numbered, program_key
from autotuner.strategy import Strategy

log = logging.getLogger("autotuner.overlap")
MAX_ROUNDS = 3   # analyses of an Auto-layout program (each compiles it once)


@dataclass
class Prepared:
    call: Any           # the compiled program where the analysis compiled it, else `jitted`
    plan: Plan
    jitted: Any = None  # the jax.jit of the program (lower/trace)

    def __post_init__(self) -> None:
        if self.jitted is None:
            self.jitted = self.call


class Fallback(Exception):   # noqa: N818 - a result, not an error: the program runs as plain jit
    def __init__(self, prepared: Prepared) -> None:
        super().__init__("plain jit")
        self.prepared = prepared


@dataclass
class Build:
    """The state of one preparation: what the stages read and leave for the next."""

    ov: Any                       # the Overlapped (fn, mode, chosen, client, memory, tune, jit_kwargs, _jit)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    mesh: Any
    plain: Any                    # jax.jit(fn): what runs when nothing is rewritten
    actions: dict[str, Any] = field(default_factory=dict)   # tag -> Action
    found: list[tuple[str | None, PlanRow]] = field(default_factory=list)  # per pair: (its dot's tag, row)
    notes: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    traced: dict[str, Any] = field(default_factory=dict)
    cost: Cost = field(default_factory=Cost)
    compiled: Any = None
    analysed: Any = None          # round 1's Partitioned: its temp bytes may still be on the way
    program: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    windowed: frozenset[str] = frozenset()   # tags of the dots plain jit's compiler windows itself
    shed: dict[str, str] = field(default_factory=dict)   # tag -> why the memory bound shed or changed it
    xla_temp: int | None = None   # plain jit's temp bytes where the analysis is not plain jit
    interp: Any = None
    jitted: Any = None

    def __post_init__(self) -> None:
        from jax.sharding import AxisType

        from autotuner.hlo.compile import stops_here
        from autotuner.overlap.injob import InJob

        self.platform = str(self.mesh.devices.flat[0].platform)
        self.explicit = AxisType.Explicit in set(self.mesh.axis_types)
        self.rounds = 2 if self.explicit else MAX_ROUNDS
        # the analysis compile ends before code generation where the backend allows it (an extra
        # output, so not where the caller fixed the outputs' shardings)
        self.stops = stops_here(self.platform) and self.ov.jit_kwargs.get("out_shardings") is None
        self.injob = InJob(self.ov.client, self.mesh, self.ov.tune_budget_s) if self.ov.tune == "missing" else None
        self.rank, self.count = agree.processes()
        self.job_key = agree.next_job_key() if self.count > 1 else ""   # "": a one-process job
        self.stage = 0                # the plans process 0 has published (or this process received)
        self.sites: dict[str, Any] = {}   # tag -> its Site (what another process's plan names)

    # -- the pipeline -----------------------------------------------------------------------------
    def run(self) -> Prepared:
        try:
            prepared = self.prepare()
        except Fallback as f:
            if self.job_key and self.rank == 0:   # whoever waits for this plan runs plain jit too
                why = next((r.note for r in f.prepared.plan if r.note), "") or "; ".join(f.prepared.plan.notes[-1:])
                try:
                    agree.publish(f"{self.job_key}/plan/{self.stage}", {"plain": [why]})
                except Exception as e:  # noqa: BLE001 - the others then time out, and run plain jit too
                    log.warning("overlap: process 0 could not publish its fallback (%s: %s)", type(e).__name__, e)
            prepared = f.prepared
        return self.together(prepared)

    def prepare(self) -> Prepared:
        """The stages, on this process."""
        self.analyse()
        plain_temp = self.plain_memory()
        if not self.actions:   # nothing to rewrite: exactly plain jit (compiled on the first call)
            owners = {r.name for t, r in self.found if t in self.shed}
            rows = [self.final_row(t, r, self.shed, owners) for t, r in self.found] if self.shed else self.rows()
            return Prepared(self.plain, self._plan(rows, Memory(plain_temp, plain_temp, self.ov.memory)))
        self.rewrite()
        return self.report(self.check_memory(plain_temp))

    def rows(self) -> list[PlanRow]:
        return [r for _t, r in self.found]

    def _plan(self, rows: list[PlanRow], memory: Memory | None = None) -> Plan:
        return Plan(numbered(rows), self.notes, memory or Memory(), self.program, self.cost)

    def fall_back(self, why: str, memory: Memory | None = None) -> Fallback:
        """Plain jit after all: every applied row is left alone, and says why (and a served one's
        all-gather stays)."""
        return Fallback(Prepared(self.plain, Plan(numbered(_plain_rows(self.rows(), why)), self.notes,
                                                  memory or Memory(), cost=self.cost)))

    # -- analyse ----------------------------------------------------------------------------------
    def analyse(self) -> None:
        for n in range(self.rounds):
            found = self.compile_round(n)
            more = found is not None and self.choose(n, found)
            self.fit_memory()   # before the compile: the memory bound costs none
            if not self.agree(more):
                break

    # -- agree across processes -------------------------------------------------------------------
    def agree(self, more: bool) -> bool:
        """In a multi-process job, process 0's plan: it publishes its actions and rows, every other
        process applies them (`overlap.agree`); whether to analyse another round, as process 0 says."""
        if not self.job_key:
            return more
        name, self.stage = f"{self.job_key}/plan/{self.stage}", self.stage + 1
        if self.rank == 0:
            try:
                agree.publish(name, {"more": more, "shed": self.shed, "rows": [_row_doc(r) for _t, r in self.found],
                                     "actions": {t: [a.strategy.to_dict(), a.keep, a.strict]
                                                 for t, a in self.actions.items()}})
            except Exception as e:  # noqa: BLE001 - no key-value store: plain jit (the others time out)
                raise self.fall_back(f"process 0 could not publish its plan ({type(e).__name__}: {e})") from None
            return more
        try:
            doc = agree.receive(name, "plan from process 0")
            if "plain" in doc:
                raise agree.AgreeError(f"process 0 runs plain jit ({'; '.join(doc['plain']) or 'it fell back'})")
            self.adopt(doc)
        except (agree.AgreeError, KeyError, TypeError, ValueError) as e:
            raise self.fall_back(f"the job's processes could not agree on a plan: {e}") from None
        return bool(doc["more"])

    def adopt(self, doc: dict[str, Any]) -> None:
        """Process 0's plan as this process's: its actions (on this process's sites) and rows."""
        from autotuner.overlap.apply import Action

        rows = doc["rows"]
        if len(rows) != len(self.found):
            raise agree.AgreeError(f"process 0 found {len(rows)} pairs, this process {len(self.found)}")
        self.found = [(t, _row_of(r, d)) for (t, r), d in zip(self.found, rows, strict=True)]
        actions = {}
        for tag, (strategy, keep, strict) in doc["actions"].items():
            site = self.sites.get(tag)
            if site is None:
                raise agree.AgreeError(f"process 0 rewrites a dot ({tag}) this process did not find")
            actions[tag] = Action(site.unit, Strategy.from_dict(strategy), site.tags, keep=keep, strict=strict,
                                  view=site.view)
        self.actions, self.shed = actions, dict(doc["shed"])

    def together(self, prepared: Prepared) -> Prepared:
        """Every process's digest of what it runs, compared: all equal, or every process plain."""
        if not self.job_key:
            return prepared
        plan, plain = prepared.plan, prepared.call is self.plain
        mine = agree.digest(plan, plain)
        try:
            why = agree.everyone(self.job_key, mine, self.rank, self.count)
        except Exception as e:  # noqa: BLE001 - no key-value store: nobody can say they agree
            why = f"{type(e).__name__}: {e}"
        if why is None:
            note = f"the job's {self.count} processes run one plan (digest {mine})"
            return Prepared(prepared.call, Plan(list(plan), plan.notes + [note], plan.memory, plan.program,
                                                plan.cost), prepared.jitted)
        text = f"the job's processes do not run one plan ({why}): every process runs plain jit"
        log.warning("overlap: process %d: %s", self.rank, text)
        return Prepared(self.plain, Plan(_plain_rows(plan, text), plan.notes + [text], Memory(plan.memory.plain_bytes,
                                         plan.memory.plain_bytes, plan.memory.bound), plan.program, plan.cost))

    def compile_round(self, n: int) -> Any:
        """Round n's program compiled, and the pairs found in it (None: nothing to read)."""
        from autotuner.hlo.compile import lower, partitioned_texts
        from autotuner.overlap.apply import Interpreter
        from autotuner.overlap.find import WINDOWS_ITSELF, find_sites_kept, xla_windowing

        self.interp = Interpreter(self.mesh, dict(self.actions), traced=self.traced)
        self.jitted = self.ov._jit(self.interp, stop=n == 0 and self.stops)
        try:
            with self.cost.timing("rewrite" if n else "trace"):
                lowered = lower(self.jitted, *self.args, **self.kwargs)
            if n and self.explicit:
                with self.cost.timing("compile"):
                    self.compiled = lowered.compile()
                return None
            with self.cost.timing("compile" if n else "analysis"):
                part = partitioned_texts(lowered, analysis=n == 0, stops=n == 0 and self.stops,
                                         platform=self.platform)
            self.compiled = part.compiled
            if n == 0:
                self.analysed = part
                if self.platform in WINDOWS_ITSELF:
                    with self.cost.timing("analysis"):
                        self.windowed, self.xla_temp = xla_windowing(lowered, stop=self.stops)
            with self.cost.timing("reading"):
                return find_sites_kept(part, self.interp, self.mesh, self.seen)
        except Exception as e:  # noqa: BLE001 - never worse than plain jit
            changed = _changed_arguments(e)
            if changed is not None:
                raise changed from None   # plain jit would lose the changes too: the caller is told
            if not self.actions:
                note = f"the program could not be analysed, so it runs as plain jit: {e}"
                log.warning("overlap: %s", note)
                self.notes.append(note)
                raise Fallback(Prepared(self.plain, self._plan(self.rows()))) from None
            log.warning("overlap: the rewritten program could not be compiled (%s: %s); using "
                        "plain jit", type(e).__name__, e)
            raise self.fall_back("the rewritten program could not be compiled; plain jit") from None

    def choose(self, n: int, found: Any) -> bool:
        """Round n's pairs chosen for (their missing answers measured first, in-job); whether any
        new decomposition is to be applied."""
        from autotuner.overlap.choose import choose
        from autotuner.strategy import reference

        self.notes += [t for t in found.notes if t not in self.notes]
        if n == 0:
            self.program = program_key(found.rows)
            with self.cost.timing("reading"):
                self.evidence = _evidence(self.ov.client, self.program) if self.ov.mode == "auto" else {}
        self.tune_missing(found)
        self.sites.update((site.tag, site) for site in found.sites if site is not None)
        with self.cost.timing("reading"):
            actions, rows = choose(self.ov.mode, self.ov.chosen, self.ov.client, found.sites, found.rows,
                                   self.evidence, reference(self.platform), self.platform,
                                   shared=not self.job_key)
        if self.injob is not None:
            rows = self.injob.mark(found.sites, rows)
        tags = [s.tag if s else None for s in found.sites]
        for tag, row in zip(tags, rows, strict=True):
            if n:
                row = replace(row, note=(row.note + "; " if row.note else "") + f"found in round {n + 1}")
            if tag in self.windowed:
                row = replace(row, xla="windowed")
            self.found.append((tag, row))
        self.actions.update(actions)
        return bool(actions)

    def tune_missing(self, found: Any) -> None:
        """In-job tuning (`tune="missing"`): the untuned units measured now, so that `choose` finds
        their answers."""
        if self.injob is None:
            return
        if self.analysed is not None:
            with self.cost.timing("analysis"):
                self.analysed.temp_bytes   # noqa: B018 - no compile beside the measurements
        with self.cost.timing("tuning"):
            self.injob.run(found.sites, self.evidence)
        self.notes[:] = [t for t in self.notes if not t.startswith("in-job tuning")] + [self.injob.summary()]

    def plain_memory(self) -> int | None:
        """The plain step's temp bytes: the analysis compile may have gone on beside the rounds;
        where it compiled without XLA's own windowing (TPU), plain jit's own compile says."""
        with self.cost.timing("analysis"):
            plain_temp = self.analysed.temp_bytes if self.analysed is not None else None
        return self.xla_temp if self.xla_temp is not None else plain_temp

    # -- rewrite, memory ---------------------------------------------------------------------------
    def rewrite(self) -> None:
        """The program with every action traced, where the last round found more than it compiled."""
        from autotuner.overlap.apply import Interpreter

        if self.interp.actions == self.actions:
            return
        self.interp = Interpreter(self.mesh, dict(self.actions), traced=self.traced)
        self.jitted, self.compiled = self.ov._jit(self.interp), None
        try:
            with self.cost.timing("rewrite"):
                self.jitted.trace(*self.args, **self.kwargs)   # the rewrite happens at trace time
        except Exception as e:  # noqa: BLE001 - never worse than plain jit
            log.warning("overlap: the rewritten program did not trace (%s: %s); using plain jit",
                        type(e).__name__, e)
            raise self.fall_back(f"the rewritten program did not trace ({type(e).__name__}); plain jit") from None

    def fit_memory(self) -> None:
        """The memory bound, kept by prediction: decompositions shed until what they may add fits
        (`overlap.memory.fit`), before the program is compiled."""
        from autotuner.overlap.memory import fit, ring_bytes

        bound = self.ov.memory
        if bound is None or not any(ring_bytes(a.problem) for a in self.actions.values()):
            return   # nothing charged: no need to wait for the plain step's temp bytes
        plain_temp = self.plain_memory()
        if plain_temp is None:
            return
        looped = frozenset(t for t, site in self.sites.items() if site.in_loop)
        self.shed.update(fit(self.actions, self.speedups(), int(plain_temp * bound), bound, looped))

    def speedups(self) -> dict[str, float | None]:
        """Each tagged pair's predicted speedup (what shedding weighs a ring by)."""
        return {t: r.speedup for t, r in self.found if t}

    def check_memory(self, plain_temp: int | None) -> Memory:
        """The compiled step's temp bytes against the bound. Past it (the prediction missed), one
        more step is shed to cover the excess (`overlap.memory.cover`) and the step compiled once
        more; past it still, the whole step runs as plain jit."""
        from autotuner.hlo.compile import temp_bytes
        from autotuner.overlap.memory import cover, growth, over

        bound, temp = self.ov.memory, temp_bytes(self.compiled) if self.compiled is not None else None
        if over(plain_temp, temp, bound):
            assert plain_temp is not None and temp is not None and bound is not None
            self.shed.update(cover(self.actions, self.speedups(), temp - int(plain_temp * (1 + bound)),
                                   temp - plain_temp, bound))
            temp = self.recompile() if self.actions else self.nothing_left(plain_temp)
        if over(plain_temp, temp, bound):
            g = growth(plain_temp, temp) or 0.0
            log.warning("overlap: the rewritten step's temp memory grew by %+.1f%%, past the bound; "
                        "using plain jit", 100 * g)
            raise self.fall_back(f"the memory bound: the rewritten step's temp memory grew by {100 * g:+.1f}% "
                                 f"(past +{100 * (bound or 0):g}%), so the step runs as plain jit",
                                 Memory(plain_temp, plain_temp, bound))
        return Memory(plain_temp, temp, bound)

    def nothing_left(self, plain_temp: int) -> int:
        """Every decomposition shed: plain jit runs (compiled on the first call)."""
        from autotuner.overlap.apply import Interpreter

        self.interp = Interpreter(self.mesh, {}, traced=self.traced)
        self.jitted, self.compiled = self.plain, None
        return plain_temp

    def recompile(self) -> int | None:
        """The rewritten program, with the actions left, compiled (what runs); its temp bytes."""
        from autotuner.hlo.compile import lower, temp_bytes
        from autotuner.overlap.apply import Interpreter

        self.interp = Interpreter(self.mesh, dict(self.actions), traced=self.traced)
        self.jitted = self.ov._jit(self.interp)
        try:
            with self.cost.timing("rewrite"):
                lowered = lower(self.jitted, *self.args, **self.kwargs)
            with self.cost.timing("compile"):
                self.compiled = lowered.compile()
        except Exception as e:  # noqa: BLE001 - never worse than plain jit
            raise self.fall_back(f"the rewritten program could not be compiled ({type(e).__name__}); "
                                 "plain jit") from None
        return temp_bytes(self.compiled)

    # -- report -----------------------------------------------------------------------------------
    def report(self, memory: Memory) -> Prepared:
        """The rows as the program that runs has them (built here, once), and what runs."""
        owners = {r.name for t, r in self.found if t in self.shed}
        rows = [self.final_row(tag, r, self.shed, owners) for tag, r in self.found]
        jk = self.ov.jit_kwargs
        static = jk.get("static_argnums") is not None or jk.get("static_argnames")
        run = self.compiled if self.compiled is not None and not static else self.jitted
        return Prepared(run, self._plan(rows, memory), self.jitted)

    def final_row(self, tag: str | None, r: PlanRow, shed: dict[str, str], owners: set[str]) -> PlanRow:
        """One pair's row after the memory bound and the rewrite: shed, served, failed or kept."""
        from autotuner.overlap.memory import gathered_bytes, mib

        interp, actions = self.interp, self.actions
        if tag in shed and tag not in actions:
            r = r.unapplied(shed[tag] + (f" (it was chosen: {r.note})" if r.note else ""))
        elif r.served_by and r.served_by in owners and tag not in interp.served:
            r = replace(r, served_by="", note=r.note + "; its all-gather stays (the memory bound "
                        "dropped the kept copy)")
        elif tag in shed:
            r = replace(r, note=(r.note + "; " if r.note else "") + shed[tag])
        if r.applied and tag not in interp.applied:
            why = interp.failed.get(tag or "") or next(
                (w for t, w in interp.failed.items() if tag and tag.startswith(t + "_")),
                "not applied (unknown reason)")
            return r.unapplied(why)
        if r.served_by and tag not in interp.served:
            return replace(r, served_by="", note=r.note + "; but it did not reach this dot, whose all-gather stays")
        if r.applied and tag in actions and actions[tag].keep:
            first = (actions[tag].tags or (tag,))[0]
            n_kept = interp.kept.get(first, 0)
            held = gathered_bytes(actions[tag].problem)
            span = interp.kept_span.get(first)
            return replace(r, kept_bytes=held if n_kept else 0, note=r.note + (
                f" ({n_kept} later equation(s) take it); it holds {mib(held)} per device over "
                f"equations {span[0]}-{span[1]} of its jaxpr's {span[2]}" if n_kept and span else
                "; no later equation of its jaxpr takes it, so it is not passed on"))
        return r


def _changed_arguments(e: BaseException | None) -> Exception | None:
    """The `arguments.ArgumentsChanged` behind `e` (raised while tracing, wrapped by `hlo.compile.lower`)."""
    from autotuner.overlap.arguments import ArgumentsChanged

    while e is not None:
        if isinstance(e, ArgumentsChanged):
            return e
        e = e.__cause__
    return None


def _plain_rows(rows: list[PlanRow], why: str) -> list[PlanRow]:
    """The rows of a step that runs as plain jit after all: an applied pair left alone and a served
    one's all-gather kept, each saying why."""
    return [r.unapplied(why) if r.applied else replace(r, served_by="", note=why) if r.served_by else r
            for r in rows]


def _row_doc(r: PlanRow) -> list[Any]:
    return [r.strategy.to_dict(), r.source, r.speedup, r.note, r.served_by]


def _row_of(r: PlanRow, d: list[Any]) -> PlanRow:
    """This process's row as process 0 chose it (`_row_doc`)."""
    return replace(r, strategy=Strategy.from_dict(d[0]), source=str(d[1]),
                   speedup=None if d[2] is None else float(d[2]), note=str(d[3]), served_by=str(d[4]))


def _evidence(client: Any, program: str) -> dict[str, Any]:
    """The client's in-program evidence for this program (problem key -> answer); {} where it
    has none, or no such method, or fails (then the isolated winners decide, as without it)."""
    get = getattr(client, "evidence", None)
    if not program or get is None:
        return {}
    try:
        return dict(get(program) or {})
    except Exception as e:  # noqa: BLE001 - never worse than the isolated winners
        log.warning("overlap: in-program evidence unavailable (%s: %s)", type(e).__name__, e)
        return {}
