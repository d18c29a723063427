"""Answering lookups: tuned, else nearest, else model, else default; misses become demand.

- ``tuned``: the stored winner of this exact problem (canonical key) on this device.
- ``nearest``: the winner of the closest tuned problem with the same pattern, dtype and mesh
  size on this device (``repository.nearest_winners``), within
  ``settings.nearest_max_distance`` (log2-shape distance) and only if its strategy is valid
  for the problem asked about.
- ``model``: the cost-model hook (:mod:`service.costmodel_hook`; by default no model, no answer).
- ``default``: the baseline.

Exact matches are looked up in one read transaction per batch request, and the single lookups
that arrive while one is running are answered together (:class:`_Coalescer`). Answers are
kept until a winner they depend on changes (:meth:`LookupEngine.invalidate`, called by
:class:`service.coherence.ChangeWatcher` within ``settings.lookup_poll_seconds`` of a change
made by any process; a result posted to this process drops its entries at once), at most
``settings.lookup_cache_seconds``, and at most ``settings.lookup_cache_entries`` answers and
``settings.lookup_cache_bytes`` (estimated) in all, the least recently used going first. Every
answer that is not ``tuned`` counts one miss: misses are buffered (at most
``settings.demand_max_pending`` distinct ones; more are dropped and counted) and written by a
background thread every ``DEMAND_FLUSH_SECONDS`` (once the app has started; before that,
synchronously), so the lookup path never waits for a write; no read flushes (a read writes nothing).
Each write keeps the demand table within ``settings.demand_max_rows`` rows
(``repository.trim_demand``: the least missed go).

A request's error is its own: when the lookups coalesced into one round fail, each is resolved
again alone, so only the requests whose problem fails get the error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from autotuner import Device, Problem, Strategy, StrategyError
from autotuner.answer import Answer
from autotuner.rule import EXACT_SOURCES, exact_source
from autotuner.snapshot import evidence
from db import Database, StorageError, WinnerRecord
from db import repository as repo
from service.bounded import BoundedDict, estimate
from service.costmodel_hook import ModelFn, as_answer, model_answer
from service.field_types import ParseMemo
from service.metrics import Metrics
from service.nearest import NearestIndex
from service.pacing import Pacer
from service.schemas import Lookup

log = logging.getLogger("service.lookups")

DEMAND_FLUSH_SECONDS = 0.5
DEMAND_MAX_ROWS = 100_000  # the defaults of the settings of the same names
DEMAND_MAX_PENDING = 10_000
NEIGHBORS = 5
CACHE_ENTRIES = 200_000
CACHE_BYTES = 256 * 2**20
INLINE_MAX = 64  # problems of a coalesced round whose exact matches SQLite reads on the event loop
ANSWER_OVERHEAD = 1536  # bytes of a cached answer besides its JSON (the Lookup object, keys)


def answer_of(w: WinnerRecord, dkey: str, pkey: str, source: str, strategy: Strategy | None = None,
              distance: float | None = None, neighbor_key: str | None = None) -> Answer:
    """The answer a stored winner gives (problem `pkey` on device `dkey`): its own (`tuned`,
    `estimated`), or a neighbour's (`nearest`: `strategy`, the winner's as valid for the problem
    asked about, at `distance`, the neighbour `neighbor_key`). The one conversion of a winner."""
    ev = evidence(w)
    return Answer(strategy=strategy if strategy is not None else Strategy.from_dict(w.strategy), source=source,
                  speedup=ev["speedup"], confidence=ev["confidence"], record_id=ev["record_id"],
                  measured_at=ev["measured_at"], problem_key=pkey, device_key=dkey, distance=distance,
                  neighbor_key=neighbor_key, trials=ev["trials"], traffic_speedup=ev["traffic_speedup"])


_WIRE = tuple(k for k in Lookup.model_fields if k not in ("strategy", "strategy_key"))


def lookup_of(answer: Answer) -> Lookup:
    """The wire form of `answer` (the ``Lookup`` schema: an Answer's fields of the same names, its
    strategy as JSON with its key; not its ``origin``, which the client sets)."""
    return Lookup.model_validate({"strategy": answer.strategy.to_dict(), "strategy_key": answer.strategy.key,
                                  **{k: getattr(answer, k) for k in _WIRE}})


def _tuned(w: WinnerRecord, dkey: str, pkey: str, estimated: bool = False) -> Lookup:
    """The problem's own winner: `tuned`, or `estimated` for a compile-only device's."""
    return lookup_of(answer_of(w, dkey, pkey, exact_source(estimated)))


def _default(dkey: str, pkey: str) -> Lookup:
    return lookup_of(Answer.baseline(pkey, dkey))


def applicable(problem: Problem, strategy: dict[str, Any]) -> Strategy | None:
    """The strategy if it can run ``problem`` (what ``autotuner.decompose.space`` would offer), else None."""
    try:
        s = Strategy.from_dict(strategy)
    except (StrategyError, TypeError):
        return None
    if s.is_baseline:
        return s
    from autotuner.decompose import check_valid  # imports JAX; warmed up at startup

    try:
        check_valid(problem, s)
    except StrategyError:
        return None
    return s


class DemandRecorder:
    """Buffers lookup misses and writes them with ``repository.record_miss``."""

    def __init__(self, database: Database, interval: float = DEMAND_FLUSH_SECONDS, *,
                 max_rows: int = DEMAND_MAX_ROWS, max_pending: int = DEMAND_MAX_PENDING) -> None:
        self.database = database
        self.interval = interval
        self.max_rows = max_rows
        self.max_pending = max_pending
        self.dropped = 0  # misses not counted: the buffer was full
        self._pending: dict[tuple[str, str], list[Any]] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add(self, device: Device, dkey: str, misses: dict[str, tuple[Problem, int]]) -> None:
        """Count misses of ``{problem_key: (problem, count)}`` on one device."""
        with self._lock:
            for pkey, (problem, count) in misses.items():
                entry = self._pending.get((dkey, pkey))
                if entry is not None:
                    entry[0] += count
                elif len(self._pending) < self.max_pending:
                    self._pending[(dkey, pkey)] = [count, device, problem]
                else:
                    self.dropped += count
        if not self.running:
            self.flush()

    def flush(self) -> int:
        """Write every pending miss; returns how many were written."""
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                dropped, self.dropped = self.dropped, 0
            if dropped:
                log.warning("dropped %d lookup misses: more than %d distinct ones waited to be "
                            "written (AUTOTUNER_DEMAND_MAX_PENDING)", dropped, self.max_pending)
            if not pending:
                return 0
            try:
                with self.database.session() as s:  # one upsert per (device, problem)
                    repo.record_misses(s, [(dkey, device.to_dict(), pkey, problem.canonical(), count)
                                           for (dkey, pkey), (count, device, problem)
                                           in sorted(pending.items())])
                    repo.trim_demand(s, self.max_rows)
            except ValueError as e:  # invalid values never become valid: drop them
                log.warning("dropped %d lookup misses the database refused: %s",
                            sum(v[0] for v in pending.values()), e)
                return 0
            except StorageError as e:
                log.warning("could not record %d lookup misses (kept for the next try): %s",
                            sum(v[0] for v in pending.values()), e)
                with self._lock:
                    for k, (count, device, problem) in pending.items():
                        if k in self._pending or len(self._pending) < self.max_pending:
                            entry = self._pending.setdefault(k, [0, device, problem])
                            entry[0] += count
                        else:
                            self.dropped += count
                return 0
            return sum(v[0] for v in pending.values())

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="autotuner-demand", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the thread must survive anything
                log.exception("demand flush failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.flush()


Resolved = tuple[Lookup, bool]  # an answer, and whether it is provisional (not to be cached)


class _Coalescer:
    """The uncached single lookups of concurrent requests, answered together (the DataLoader
    pattern).

    A request's problem joins the pending set; one drain task at a time takes everything
    pending and resolves it with ``resolve`` (:meth:`LookupEngine._round`: exact matches in one
    read transaction, the rest from the nearest index and the model together), and hands each
    request its answer. While that runs the event loop keeps parsing requests, whose problems
    make up the next round: under load the batches grow by themselves, at low load a lookup
    waits for nothing but its own query.
    """

    def __init__(self, resolve: Any) -> None:
        self._resolve = resolve
        self._pending: dict[str, tuple[Device, dict[str, tuple[Problem, list[asyncio.Future[Resolved]]]]]] = {}
        self._draining = False

    async def get(self, device: Device, dkey: str, pkey: str, problem: Problem) -> Resolved:
        fut: asyncio.Future[Resolved] = asyncio.get_running_loop().create_future()
        waiters = self._pending.setdefault(dkey, (device, {}))[1]
        waiters.setdefault(pkey, (problem, []))[1].append(fut)
        if not self._draining:
            self._draining = True
            asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._pending:
                pending, self._pending = self._pending, {}
                for dkey, (device, waiters) in pending.items():
                    await self._answer(device, dkey, waiters)
        finally:
            self._draining = False

    async def _answer(self, device: Device, dkey: str,
                      waiters: dict[str, tuple[Problem, list[asyncio.Future[Resolved]]]]) -> None:
        provisional: set[str] = set()
        try:
            found = await self._resolve(device, dkey, {k: p for k, (p, _) in waiters.items()}, provisional)
        except Exception as e:  # noqa: BLE001 - handed to the waiters of the problem that failed
            if len(waiters) > 1:  # which one? each alone: the others are answered
                for pkey, waiter in waiters.items():
                    await self._answer(device, dkey, {pkey: waiter})
                return
            for _, futs in waiters.values():
                for f in futs:
                    if not f.done():
                        f.set_exception(e)
            return
        for pkey, (_, futs) in waiters.items():
            for f in futs:
                if not f.done():
                    f.set_result((found[pkey], pkey in provisional))


# A cached answer: its expiry, source and JSON - strings, bytes and a float only, so that the
# garbage collector does not track it (a cache of Lookup objects made every full collection
# traverse several objects per answer: 100-400 ms pauses in a serving process, its lookups' p99)
Entry = tuple[float, str, bytes]
Answered = tuple[str, bytes]  # an answer's source and JSON
Keys = tuple[str, Sequence[str]]  # the device's key and the problems' keys, when known


def to_json(answer: Lookup) -> bytes:
    """The answer's JSON, as the route's response model would write it."""
    return answer.__pydantic_serializer__.to_json(answer)


class LookupEngine:
    """Answers lookups for one database (see the module docs); one per app, thread-safe."""

    def __init__(self, database: Database, metrics: Metrics, *, cache_seconds: float = 5.0,
                 nearest_max_distance: float = 2.0, model: ModelFn = model_answer,
                 model_budget_seconds: float = 2.0, demand: DemandRecorder | None = None,
                 parse_memo: ParseMemo | None = None, cache_entries: int = CACHE_ENTRIES,
                 cache_bytes: int = CACHE_BYTES, nearest_max_groups: int = 4096,
                 nearest_max_bytes: int = 256 * 2**20) -> None:
        self.database = database
        self.metrics = metrics
        self.cache_seconds = cache_seconds
        self.nearest_max_distance = nearest_max_distance
        self.model = model
        # A cost-model prediction takes milliseconds per shape: a batch of many untuned shapes
        # asks the model for as many as this budget allows per request and answers the rest
        # `default` without caching them, so a later lookup gets the model's answer.
        self.model_budget_seconds = model_budget_seconds
        self.demand = demand or DemandRecorder(database)
        self.parse_memo = parse_memo or ParseMemo()  # the keys of the problems asked about
        # answers by (device key, problem key), tuned or not (nearest/model/default, which a
        # winner stored near them can change); each entry: expiry, answer, the answer's JSON -
        # serialised once, served as is
        self._answers: BoundedDict[tuple[str, str], Entry] = BoundedDict(cache_entries, cache_bytes,
                                                                          lru=True)
        # +1 whenever answers are dropped: an answer read from the database before a drop is
        # not kept after it (it may predate the change that caused the drop)
        self._epoch = 0
        self.nearest = NearestIndex(nearest_max_distance, NEIGHBORS, database,
                                    max_groups=nearest_max_groups, max_bytes=nearest_max_bytes)
        self._coalescer = _Coalescer(self._round)
        # SQLite: a round's exact matches are read on the event loop. A point read of a local
        # WAL file never waits for a lock and takes less CPU than the hop to a worker thread and
        # back (``bench/load.py``'s single lookups at 1000/s: about half the server CPU each)
        self.inline_reads = database.engine.dialect.name == "sqlite"

    # -- cache ---------------------------------------------------------------------------------
    def _cached(self, dkey: str, pkey: str, now: float) -> Answered | None:
        hit = self._answers.get((dkey, pkey))
        if hit is None or hit[0] < now:
            return None
        return hit[1], hit[2]

    def _keep(self, dkey: str, pkey: str, answered: Answered, now: float) -> None:
        if self.cache_seconds <= 0:
            return
        source, body = answered
        self._answers.put((dkey, pkey), (now + self.cache_seconds, source, body),
                          estimate(len(body), 4, ANSWER_OVERHEAD))

    def forget(self, dkey: str, pkey: str) -> None:
        """Drop what a new winner of (device, problem) changes (see :meth:`invalidate`)."""
        self.invalidate(((dkey, pkey),))

    def invalidate(self, changes: Sequence[tuple[str, str | None]] | None) -> None:
        """Drop the answers that changed winners affect: the tuned answer of each (device,
        problem), every untuned answer of the device (a nearest or default answer may now
        have a closer neighbour), every answer of the device when the problem is None;
        everything when ``changes`` is None. Called by :class:`service.coherence.ChangeWatcher`
        (any thread)."""
        self._epoch += 1
        if changes is None:
            self._answers.clear()
            self.nearest.drop()
            return
        self.nearest.changed(changes)
        devices = {dkey for dkey, _ in changes}
        whole = {dkey for dkey, pkey in changes if pkey is None}
        exact = set(changes)
        self._answers.discard_if(lambda k, e: k[0] in devices and (
            k[0] in whole or k in exact or e[1] not in EXACT_SOURCES))

    # -- answers -------------------------------------------------------------------------------
    def _nearest(self, problem: Problem, pkey: str, dkey: str, neighbors: list[tuple[str, float]],
                 winners: dict[str, WinnerRecord]) -> Lookup | None:
        for nkey, distance in neighbors:  # within nearest_max_distance, closest first
            winner = winners.get(nkey)
            strategy = applicable(problem, winner.strategy) if winner is not None else None
            if strategy is None:
                continue
            return lookup_of(answer_of(winner, dkey, pkey, "nearest", strategy, round(distance, 6), nkey))
        return None

    def _untuned(self, device: Device, dkey: str, problem: Problem, pkey: str,
                  use_model: bool = True) -> Lookup:
        got = as_answer(self.model(problem, device)) if use_model else None
        if got is not None and applicable(problem, got.strategy.to_dict()) is not None:
            return lookup_of(Answer(got.strategy, "model", got.speedup, got.confidence, None, None, pkey, dkey))
        return _default(dkey, pkey)

    def _start(self, device: Device, problems: Sequence[Problem], known: Keys | None = None
               ) -> tuple[float, str, list[str], dict[str, Problem], dict[str, Answered], list[str]]:
        now = time.monotonic()
        if known is not None:
            dkey, keys = known[0], list(known[1])
        else:
            dkey = self.parse_memo.key(device)
            keys = [self.parse_memo.key(p) for p in problems]
        by_key: dict[str, Problem] = dict(zip(keys, problems, strict=True))
        answers: dict[str, Answered] = {}
        todo = []
        for k in by_key:
            hit = self._cached(dkey, k, now)
            if hit is not None:
                answers[k] = hit
            else:
                todo.append(k)
        return now, dkey, keys, by_key, answers, todo

    def _exact(self, device: Device, dkey: str, todo: list[str]) -> dict[str, Lookup]:
        with self.database.reader() as conn:
            winners = repo.get_winners(conn, dkey, todo)
        return {k: _tuned(w, dkey, k, device.estimated) for k, w in winners.items()}

    def _resolve(self, device: Device, dkey: str, problems: dict[str, Problem],
                 provisional: set[str]) -> dict[str, Lookup]:
        """Every answer of ``problems`` (by key) on one device, from the database (exact
        matches in one read transaction, then the nearest index and the model for the rest)."""
        found = self._exact(device, dkey, list(problems))
        rest = [k for k in problems if k not in found]
        if rest:
            found.update(self._inexact(device, dkey, problems, rest, provisional))
        return found

    async def _round(self, device: Device, dkey: str, problems: dict[str, Problem],
                     provisional: set[str]) -> dict[str, Lookup]:
        """:meth:`_resolve` for the coalescer: in a worker thread, but for SQLite (``inline_reads``)
        a round of up to ``INLINE_MAX`` problems reads its exact matches on the event loop and
        goes to a thread only for the rest (the nearest index and the model)."""
        if not self.inline_reads or len(problems) > INLINE_MAX:
            return await run_in_threadpool(self._resolve, device, dkey, problems, provisional)
        found = self._exact(device, dkey, list(problems))
        rest = [k for k in problems if k not in found]
        if rest:
            found.update(await run_in_threadpool(self._inexact, device, dkey, problems, rest, provisional))
        return found

    def _inexact(self, device: Device, dkey: str, by_key: dict[str, Problem], rest: list[str],
                 provisional: set[str]) -> dict[str, Lookup]:
        """Nearest, else model, else default; the keys answered without asking the model (its
        time budget spent) are added to `provisional`."""
        out: dict[str, Lookup] = {}
        with self.database.session(read_only=True) as s:
            # every shape's neighbours from the in-memory index, then all their winners at once
            near = self.nearest.neighbors(s, dkey, [(k, by_key[k]) for k in rest])
            wanted = list(dict.fromkeys(n for ns in near.values() for n, _ in ns))
            winners = repo.get_winners(s, dkey, wanted) if wanted else {}
        for k in rest:
            got = self._nearest(by_key[k], k, dkey, near[k], winners)
            if got is not None:
                out[k] = got
        deadline = time.monotonic() + self.model_budget_seconds
        for k in rest:
            if k not in out:
                use_model = time.monotonic() < deadline
                out[k] = self._untuned(device, dkey, by_key[k], k, use_model)
                if not use_model:
                    provisional.add(k)
        return out

    def _finish(self, device: Device, dkey: str, keys: list[str], by_key: dict[str, Problem],
                answers: dict[str, Answered], found: dict[str, Lookup], now: float,
                provisional: set[str], epoch: int) -> list[bytes]:
        keep = epoch == self._epoch  # else answers changed while these were read: keep none
        for k, answer in found.items():
            answers[k] = answered = (answer.source, to_json(answer))
            if keep and k not in provisional:
                self._keep(dkey, k, answered, now)
        sources: dict[str, int] = {}
        misses: dict[str, tuple[Problem, int]] = {}
        for k in keys:
            source = answers[k][0]
            sources[source] = sources.get(source, 0) + 1
            if source not in EXACT_SOURCES:
                misses[k] = (by_key[k], misses[k][1] + 1 if k in misses else 1)
        self.metrics.count_lookups(sources)
        if misses:
            self.demand.add(device, dkey, misses)
        return [answers[k][1] for k in keys]

    async def run_json(self, device: Device, problems: Sequence[Problem],
                       known: Keys | None = None, pacer: Pacer | None = None) -> list[bytes]:
        """The answers' JSON in the order asked; repeated problems are looked up once. Cached answers in
        the event loop; uncached single lookups coalesced (:class:`_Coalescer`), a batch's
        together (:meth:`_resolve`: exact matches in one read transaction, the others from the
        nearest index and the model), in the thread pool; with a ``pacer`` (an anonymous batch,
        :mod:`service.pacing`) the uncached ones in its slices."""
        epoch = self._epoch
        now, dkey, keys, by_key, answers, todo = self._start(device, problems, known)
        provisional: set[str] = set()
        found: dict[str, Lookup] = {}
        if len(todo) == 1:
            k = todo[0]
            found[k], late = await self._coalescer.get(device, dkey, k, by_key[k])
            if late:
                provisional.add(k)
        elif pacer is not None:
            for part in pacer.slices_of(todo):
                found.update(await pacer.run(self._resolve, device, dkey, {k: by_key[k] for k in part},
                                             provisional))
        elif todo:
            found.update(await run_in_threadpool(self._resolve, device, dkey,
                                                 {k: by_key[k] for k in todo}, provisional))
        return self._finish(device, dkey, keys, by_key, answers, found, now, provisional, epoch)
