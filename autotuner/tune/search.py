"""The Optuna driver: one study per (device, problem), stored beside our database.

Each round asks the study for a small batch of strategies and measures them in ONE session with
the baseline (repetitions interleaved), so every candidate's score is its speedup over a baseline
measured at the same time. Measurements go to our database as they finish (the winner is
recomputed in the same transaction); the study only steers the search. A killed worker's study
resumes: its unfinished trials are failed once their lease expires and their strategies are
queued again, and finished ones are never measured again — by this worker or any other on the
same PostgreSQL-backed study.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotuner.device import Device
from autotuner.measure import Candidate, Precision, run_session
from autotuner.problem import Problem
from autotuner.strategy import Strategy, reference

log = logging.getLogger(__name__)

KNOBS = ("direction", "chunks", "unroll", "fuse", "send_first")


@dataclass
class TuneResult:
    winner: Any            # db WinnerRecord or None
    trials: int            # strategies measured by this call
    failed: int
    bound_s: float | None
    studied: int           # distinct strategies measured in the study so far (all workers)
    aa_width: float | None = None  # the A/A width of the session that measured the winner
    aa_ci: tuple[float | None, float | None] | None = None  # that session's A/A ratio CI
    candidates: list[Candidate] = field(default_factory=list)  # every one this call measured, the reference first


def study_name(device: Device, problem: Problem) -> str:
    return f"{device.key}:{problem.key}"


def params_of(s: Strategy) -> dict[str, Any]:
    d = s.to_dict()
    return {k: d[k] for k in KNOBS}


def strategy_of(params: dict[str, Any]) -> Strategy:
    return Strategy("ring", **{k: params[k] for k in KNOBS})


def open_study(database: Any, db_url: str, device: Device, problem: Problem, *, seed: int | None = None) -> Any:
    import optuna

    from db import ensure_optuna_schema, optuna_storage_url
    from db import repository as repo

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ensure_optuna_schema(db_url)
    # Optuna creates its tables (and studies) without guarding against a concurrent creator:
    # workers starting together take turns.
    with database.session() as s:
        repo.named_lock(s, "optuna-storage")
        storage = optuna.storages.RDBStorage(optuna_storage_url(db_url),
                                             engine_kwargs={"pool_pre_ping": True})
        return _create_study(storage, device, problem, seed)


def _create_study(storage: Any, device: Device, problem: Problem, seed: int | None) -> Any:
    import optuna

    sampler = optuna.samplers.TPESampler(multivariate=True, constant_liar=True, n_startup_trials=6,
                                         seed=seed)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=3)
    return optuna.create_study(study_name=study_name(device, problem), storage=storage, sampler=sampler,
                               pruner=pruner, direction="maximize", load_if_exists=True)


def _measured_keys(study: Any) -> dict[str, int]:
    """strategy key -> trial number, for trials that finished or are being measured."""
    import optuna

    ts = optuna.trial.TrialState
    out: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False, states=(ts.COMPLETE, ts.RUNNING, ts.PRUNED, ts.FAIL)):
        key = t.user_attrs.get("strategy_key")
        if not key or not t.user_attrs.get("measured", True):
            continue
        if t.state == ts.FAIL and "reason" not in t.user_attrs:
            continue  # failed before its measurement finished (a dead worker): to be measured again
        if key not in out or t.number < out[key]:
            out[key] = t.number
    return out


def _dead_here(worker: str) -> bool:
    """A worker of this host whose process is gone: its lease need not run out."""
    host, _, pid = worker.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _reclaim_stale(study: Any, now: float, stored: dict[str, tuple[str, float | None]] | None = None) -> int:
    """Close RUNNING trials whose lease expired (a killed worker). A trial whose measurement the
    worker stored before it died (`stored`: strategy key -> (status, ratio) in the database) is
    told its ratio, so it is not measured twice; the others fail and their strategies are queued
    again."""
    import optuna

    stored = stored or {}
    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        lease = t.user_attrs.get("lease_until")
        expired = lease is not None and (lease < now or _dead_here(t.user_attrs.get("worker", "")))
        key = t.user_attrs.get("strategy_key")
        if not (expired and key):
            continue
        status, ratio = stored.get(key, (None, None))
        try:
            if status == "ok" and ratio is not None and not math.isnan(ratio):
                study.tell(t.number, ratio)   # measured and stored, only not told: keep it
                continue
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        except (RuntimeError, ValueError):  # another worker got there first
            continue
        study.enqueue_trial(dict(t.params), skip_if_exists=False)
        n += 1
    return n


def _stored_results(database: Any, device: Device, problem: Problem) -> dict[str, tuple[str, float | None]]:
    """strategy key -> (status, ratio) of the newest stored measurement of each strategy."""
    from db import repository as repo

    with database.session(read_only=True) as s:
        dev, prob = repo.get_device_by_key(s, device.key), repo.get_problem_by_key(s, problem.key)
        if dev is None or prob is None:
            return {}
        return {m.strategy_key: (m.status, m.ratio) for m in repo.list_measurements(s, prob.id, dev.id)}


def warm_start(study: Any, database: Any, device: Device, problem: Problem, valid: set[str],
               limit: int = 3) -> int:
    """Enqueue the winners of the nearest tuned problems (same pattern, dtype, mesh size)."""
    from db import repository as repo

    f = problem.features()
    with database.session(read_only=True) as s:
        near = repo.nearest_winners(s, device.key, pattern=problem.pattern.label, dtype=problem.dtype,
                                    mesh_size=problem.axis_size, m=f["m"], n=f["n"], k=f["k"], b=f["b"],
                                    limit=limit, exclude_key=problem.key)
    n = 0
    for w, _p, _dist in near:
        st = Strategy.from_dict(dict(w.strategy))
        if not st.is_baseline and st.key in valid:
            study.enqueue_trial(params_of(st), skip_if_exists=True)
            n += 1
    return n


def _ask(study: Any, valid: set[str], worker: str, lease_s: float) -> tuple[Any, Strategy | None]:
    """Ask for a trial; claim its strategy unless it is invalid here or already claimed."""
    import optuna

    t = study.ask()
    params = {"direction": t.suggest_categorical("direction", ["uni", "bidi"]),
              "chunks": t.suggest_categorical("chunks", [1, 2, 4]),
              "unroll": t.suggest_categorical("unroll", [1, 2, "full"]),
              "fuse": t.suggest_categorical("fuse", ["loop", "after"]),
              "send_first": t.suggest_categorical("send_first", [True, False])}
    s = strategy_of(params)
    if s.key not in valid:  # not in this problem's space: never built, never measured
        t.set_user_attr("measured", False)
        study.tell(t, state=optuna.trial.TrialState.FAIL)
        return t, None
    first = _measured_keys(study).get(s.key)
    if first is not None:  # measured, or being measured, by this or another worker
        t.set_user_attr("measured", False)
        study.tell(t, state=optuna.trial.TrialState.PRUNED)
        return t, None
    # the lease and the worker before the key: a trial that names a strategy always has a lease,
    # so a worker killed between these writes leaves a trial that `_reclaim_stale` can expire
    # (written the other way round, such a trial counted as measured for ever: one strategy short)
    t.set_user_attr("lease_until", time.time() + lease_s)
    t.set_user_attr("worker", worker)
    t.set_user_attr("strategy_key", s.key)
    return t, s


def tune_problem(ts: Any, database: Any, problem: Problem, *, trials: int = 24, seconds: float | None = None,
                 reps: int = 7, batch: int = 5, run_id: str | None = None, progress: Any = None,
                 name: str = "", seed: int | None = None, db_url: str | None = None,
                 order: Callable[[list[Strategy]], list[Strategy]] | None = None,
                 use_model: bool = True, aa: bool = True,
                 precision: Precision | None = None, stop: Callable[[], bool] | None = None) -> TuneResult:
    """Tune one problem on an open target session `ts`; results into `database`.

    `trials` bounds the strategies measured in the study (by all its workers together), `seconds`
    this call's wall time. When the space is no larger than the budget, every strategy is queued
    (a grid); otherwise TPE proposes, starting from the nearest tuned problems' winners.
    `order` (e.g. the cost model's ranking) queues the likely winners first; without one, and
    unless `use_model` is False, the cost model's order is used when the device has a
    calibration in `database` (`autotuner calibrate`).
    `stop`: asked before each batch; True ends the search there (a worker whose job is no longer
    its own). `aa` and `precision` are `run_session`'s: every batch has an A/A twin by default; with a
    `Precision` (as `autotuner tune` passes) each batch repeats until its leader's CI is that
    narrow or the budget ends, without one exactly `reps` repetitions are made.
    """
    import optuna

    from autotuner.decompose.space import space
    from autotuner.settings import get_settings
    from autotuner.tune import store
    from db import repository as repo

    t0 = time.monotonic()
    if getattr(ts, "estimates", False):   # a compile-only target (the worker's too): one estimate a candidate
        from autotuner.measure.aot import ESTIMATE_SESSION

        reps, aa, precision = ESTIMATE_SESSION["reps"], ESTIMATE_SESSION["aa"], ESTIMATE_SESSION["precision"]
    lease_s = get_settings().trial_lease_seconds  # a RUNNING trial untouched this long: dead worker
    url = db_url or str(database.url)
    device = ts.device
    # The study's knobs describe ring strategies; the other methods (plain, the baseline where
    # plain is the reference, xla_windowed on GPU/TPU) are few and not knobs: they are measured
    # beside the first batch of every call, so every table has them side by side with the rings.
    every = space(problem, device)
    ref = reference(device.platform)
    extras = [s for s in every if s.method != "ring" and s != ref]
    cands = [s for s in every if s.method == "ring"]
    valid = {s.key for s in cands}
    study = open_study(database, url, device, problem, seed=seed)
    _reclaim_stale(study, time.time(), _stored_results(database, device, problem))
    if order is None and use_model and len(cands) > trials:
        from autotuner.costmodel import order_for

        order = order_for(database, device, problem)
    if len(cands) <= trials:
        for s in cands:
            study.enqueue_trial(params_of(s), skip_if_exists=True)
    else:
        if order is not None:
            for s in [s for s in order(cands) if s.method == "ring"][: max(2, trials // 3)]:
                study.enqueue_trial(params_of(s), skip_if_exists=True)
        warm_start(study, database, device, problem, valid)
    budget = min(trials, len(cands))
    worker = f"{socket.gethostname()}:{os.getpid()}"
    measured = failed = 0
    bound_s = None
    aa_by_key: dict[str, tuple[float | None, tuple[float | None, float | None] | None]] = {}
    task = progress.add_task(f"{name}: tuning", total=budget) if progress is not None else None
    seen: list[Candidate] = []
    while True:
        if seconds is not None and time.monotonic() - t0 >= seconds or stop is not None and stop():
            break
        done = _measured_keys(study)
        if len(done) >= budget and not extras:
            break
        picked: list[tuple[Any, Strategy]] = []
        asks = 0
        misses = 0
        while len(picked) < min(batch, budget - len(done)) and asks < 20 * batch:
            asks += 1
            if misses >= 3:
                # the sampler keeps proposing invalid or measured strategies: queue a fresh one
                fresh = [s for s in cands if s.key not in _measured_keys(study) and s not in [q for _, q in picked]]
                if not fresh:
                    break
                study.enqueue_trial(params_of(fresh[(asks * 7919) % len(fresh)]))
                misses = 0
            # ask + duplicate check + claim under one lock, so two workers never claim one strategy
            with database.session() as s:
                repo.named_lock(s, f"study:{study.study_name}")
                if len(_measured_keys(study)) >= budget:  # other workers claimed the rest
                    break
                t, s_ = _ask(study, valid, worker, lease_s)
                if s_ is not None and any(s_ == q for _, q in picked):
                    t.set_user_attr("measured", False)
                    study.tell(t, state=optuna.trial.TrialState.PRUNED)
                    s_ = None
            if s_ is not None:
                picked.append((t, s_))
            else:
                misses += 1
        if not picked and not extras:
            if asks >= 20 * batch:
                log.info("%s: the sampler keeps proposing measured strategies; stopping", name)
            break
        by_index = {i + 1: t for i, (t, _s) in enumerate(picked)}

        def prune(i: int, c: Candidate, base: Candidate, r: int, by_index: dict = by_index,
                  lease_s: float = lease_s) -> bool:
            t = by_index.get(i)  # None: one of the extras, not a trial of the study
            if t is None or not c.samples or not base.samples:
                return False
            ratio = float(sorted(base.samples)[len(base.samples) // 2] / sorted(c.samples)[len(c.samples) // 2])
            t.report(ratio, r)
            t.set_user_attr("lease_until", time.time() + lease_s)
            return bool(t.should_prune()) and ratio < 1.0

        session = run_session(ts.runner(problem), problem, [ref] + [s for _, s in picked] + extras, reps=reps,
                              prune=prune, parts=bound_s is None, aa=aa, precision=precision, reference=ref)
        extras = []
        seen.extend(([] if seen else [session.baseline]) + session.candidates)
        twin = session.aa
        aa_of = (session.aa_width, (twin.ratio_lo, twin.ratio_hi) if twin is not None else None)
        aa_by_key.update({c.key: aa_of for c in [session.baseline, *session.candidates]})
        bound_s = session.bound_s if session.bound_s is not None else bound_s
        store.save(database, device, problem, store.session_items(session, run_id), name=name or None)
        for (t, _s), c in zip(picked, session.candidates[: len(picked)], strict=True):
            measured += 1
            if c.status != "ok" or c.ratio is None or math.isnan(c.ratio):
                failed += c.status != "ok"
                t.set_user_attr("reason", (c.reason or "no ratio")[:500])
                study.tell(t, state=optuna.trial.TrialState.FAIL)
            elif c.pruned:
                study.tell(t, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(t, c.ratio)
        if task is not None:
            progress.update(task, completed=min(budget, len(_measured_keys(study))))
        if session.baseline.status != "ok":
            break  # nothing can be checked or timed against a baseline that does not run
    with database.session(read_only=True) as s:
        winner = repo.get_winner(s, device.key, problem.key)
    if winner is not None and winner.method == "ring" and measured:
        # the winner beside the reference and its serial control, in one more session: its speedup
        # split into traffic and overlap from the same samples (stored like any measurement; the
        # winner is read again, as this is now its latest measurement)
        ring = Strategy.from_dict(winner.strategy)
        session = run_session(ts.runner(problem), problem, [ref, ring, ring.serial()], reps=reps, parts=False,
                              aa=False, precision=precision, reference=ref)   # the search's batches had the A/A
        seen.extend(session.candidates)
        store.save(database, device, problem, store.session_items(session, run_id), name=name or None)
        with database.session(read_only=True) as s:
            winner = repo.get_winner(s, device.key, problem.key)
    aa_w, aa_ci = aa_by_key.get(winner.strategy_key, (None, None)) if winner is not None else (None, None)
    return TuneResult(winner, measured, failed, bound_s, len(_measured_keys(study)), aa_w, aa_ci, seen)
