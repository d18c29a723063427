"""Tuning against a service: upload results, and the job-claiming worker loop.

A tuning run that reports to a service still tunes into a local scratch database (the Optuna
study and our measurements, so a killed run resumes), then uploads this run's measurements with
`POST /v1/results`, where the winner is recomputed. The worker claims jobs with a lease
(`POST /v1/jobs/claim`), keeps the lease alive while it tunes, and finishes the job done or
failed; a worker that dies loses its lease and the job returns to the queue when the lease
expires. A worker that is stopped (SIGTERM from `docker stop` or a pod's deletion, or Ctrl-C)
hands its job back at once (`POST /v1/jobs/{id}/release`) and raises :class:`Stopped`.

The worker rides out a service that restarts: a request that finds it unreachable or answering
"not now" (429, 502-504) is tried again for up to a lease. A job's upload is kept in a file
(:func:`outbox`, beside the scratch database) until the service has stored it, so measurements taken
are never lost to an outage or a kill: the next start sends what an earlier one left. Sending an
upload twice stores it once (the service skips a run's measurements it has).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from autotuner.device import Device
from autotuner.errors import ServiceError
from autotuner.problem import Problem, problem_from_dict

log = logging.getLogger(__name__)


class Refused(ServiceError):
    """The service answered an error status (``status``)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _check(r: httpx.Response, what: str) -> Any:
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail")
        except ValueError:
            detail = r.text[:500]
        raise Refused(f"{what}: HTTP {r.status_code}: {detail}", r.status_code)
    return r.json()


def _scratch_name(service: str) -> str:
    return "scratch-" + "".join(c if c.isalnum() else "_" for c in service)[:80]


def scratch_db_url(service: str) -> str:
    """A local SQLite file per service URL for studies and measurements before upload."""
    from autotuner.settings import get_settings

    root = get_settings().cache_dir
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / (_scratch_name(service) + '.db')}"


def outbox(service: str) -> Path:
    """The folder of the uploads to ``service`` (the worker's and `tune --service`'s) that it
    has not yet stored: one JSON body per run and problem, removed once stored (``*.refused``
    where the service refused the body)."""
    from autotuner.settings import get_settings

    return get_settings().cache_dir / (_scratch_name(service) + "-outbox")


def pending_note(service: str) -> str:
    """``"; N upload(s) kept in FOLDER, sent at the next start"`` where the outbox holds any."""
    folder = outbox(service)
    n = len(list(folder.glob("*.json"))) if folder.is_dir() else 0
    return (f"; {n} upload(s) kept in {folder}, sent by the next `autotuner worker` or `autotuner tune --service` "
            "for this service") if n else ""


TRANSIENT = (429, 502, 503, 504)
WAIT_S = 300.0   # how long `tune --service` waits for a service that restarts (the worker: its lease)


class Unavailable(ServiceError):
    """The service answered "not now" (:data:`TRANSIENT`) until the time allowed ran out."""


def call(http: httpx.Client, path: str, body: dict[str, Any], what: str, until: float) -> Any:
    """POST ``body`` to ``path``; while the service is unreachable or answers "not now"
    (:data:`TRANSIENT`) try again after 1, 2, 4 ... 30 s, until the monotonic time ``until``,
    then raise the last error (httpx's, or :class:`Unavailable`); an error status other than those
    at once (:class:`Refused`)."""
    wait = 1.0
    while True:
        try:
            r = http.post(path, json=body)
            if r.status_code not in TRANSIENT:
                return _check(r, what)
            last: Exception = Unavailable(f"{what}: HTTP {r.status_code} (the service is busy or restarting)")
        except (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError) as e:   # not a bad URL
            last = e
        if time.monotonic() + wait > until:
            raise last
        log.warning("%s: %s; trying again in %.0f s", what, last, wait)
        time.sleep(wait)
        wait = min(2 * wait, 30.0)


def keep(folder: Path, name: str, body: dict[str, Any]) -> Path:
    """Write an upload's body to ``folder/name.json`` before it is sent (durable:
    `files.write_atomic`)."""
    from autotuner.files import write_atomic

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    write_atomic(path, json.dumps(body))
    return path


def send_run(http: httpx.Client, service: str, database: Any, device: Device, problem: Problem, run_id: str,
             until: float, name: str | None = None) -> dict[str, Any]:
    """Send this run's measurements of (device, problem) from the scratch database, kept in
    :func:`outbox` until the service has stored them; returns the service's answer."""
    from autotuner.results import results_body

    items = run_items(database, device, problem, run_id)
    if not items:
        raise ServiceError("nothing to upload: no measurements were taken")
    path = keep(outbox(service), f"{run_id}-{problem.key[:16]}", results_body(device, problem, items, name))
    return send_kept(http, path, until)


BAD_BODY = (400, 413, 422)
LOST = "lost"   # `_tune_job`'s status for a job the service no longer holds for this worker
JOB_TIMEOUT_EXIT = 124   # a job ran past the worker's --job-timeout: failed, and the process ends


def send_kept(http: httpx.Client, path: Path, until: float) -> dict[str, Any]:
    """POST a kept upload; remove its file once the service has stored it. One whose body the
    service refuses (:data:`BAD_BODY`) is renamed ``*.refused`` and the error raised; for any
    other error (unreachable, busy, a token refused) the file stays, for the next try."""
    try:
        try:
            body = json.loads(path.read_text())
        except ValueError as e:   # not what keep() wrote (edited, or a disk's fault): set aside
            raise Refused(f"{path.name} is not an upload body: {e}", 400) from None
        res = call(http, "/v1/results", body, "uploading results", until)
    except Refused as e:
        if e.status in BAD_BODY:
            with contextlib.suppress(FileNotFoundError):   # another worker of this cache folder did
                path.rename(path.with_suffix(".refused"))
        raise
    path.unlink(missing_ok=True)
    return res  # type: ignore[no-any-return]


def send_pending(http: httpx.Client, folder: Path, until: float, say: Any) -> None:
    """Send what an earlier run kept and could not send."""
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            res = send_kept(http, path, until)
        except FileNotFoundError:   # sent meanwhile by another worker that shares the folder
            continue
        except Refused as e:
            if e.status not in BAD_BODY:
                raise
            say(f"{path.name}: refused, kept as {path.with_suffix('.refused')}: {e}")
            continue
        say(f"uploaded {res['recorded']} measurement(s) an earlier run kept ({path.name}; "
            f"{res.get('repeated', 0)} the service had)")


def run_items(database: Any, device: Device, problem: Problem, run_id: str) -> list[dict[str, Any]]:
    """This run's measurements of (device, problem) from the scratch database, as upload items,
    and the newest earlier one of each strategy this run did not measure: the scratch database's
    study resumes, so a strategy an earlier run on this machine measured is not measured again, and
    that run may never have reached the service (it crashed before uploading, or the service lost
    it). One the service has is counted as repeated, not stored twice. None if this run has none."""
    from db import repository as repo
    from db.records import measurement_input

    with database.session(read_only=True) as s:
        dev, prob = repo.get_device_by_key(s, device.key), repo.get_problem_by_key(s, problem.key)
        if dev is None or prob is None:
            return []
        ms = repo.list_measurements(s, prob.id, dev.id)
    mine = [m for m in ms if m.run_id == run_id]
    if not mine:
        return []
    keys = {m.strategy_key for m in mine}
    earlier = {m.strategy_key: m for m in ms if m.run_id != run_id and m.strategy_key not in keys}   # oldest first
    return [measurement_input(m) for m in [*mine, *earlier.values()]]


def http_client(service: str, token: str | None, timeout: float = 30.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=service.rstrip("/"), headers=headers, timeout=timeout)


class _Heartbeat:
    """Renews a job's lease every third of it until stopped. Past ``deadline_s`` (None: never) it
    fails the job and ends the process (`JOB_TIMEOUT_EXIT`): a measurement that does not return (a
    collective that never completes, a device that hangs) cannot be stopped from Python, and the
    renewed lease would otherwise hold the job, and the worker's devices, for ever."""

    def __init__(self, http: httpx.Client, job_id: int, worker: str, lease_s: float,
                 deadline_s: float | None = None, say: Any = print):
        self.http, self.job_id, self.worker, self.lease_s = http, job_id, worker, lease_s
        self.deadline_s, self.say = deadline_s, say
        self.stop = threading.Event()
        self.lost = threading.Event()   # the service refused the lease: the job is no longer this worker's
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        end = time.monotonic() + (math.inf if self.deadline_s is None else self.deadline_s)
        while not self.stop.wait(min(self.lease_s / 3, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end:
                self._give_up()
            try:
                _check(self.http.post(f"/v1/jobs/{self.job_id}/heartbeat",
                                      json={"worker": self.worker, "lease_seconds": self.lease_s}),
                       "heartbeat")
            except Refused as e:
                if e.status != 409 or self.lost.is_set():
                    log.warning("job %s: heartbeat failed: %s", self.job_id, e)
                    continue
                # cancelled, or failed or re-claimed after a lease that ran out: tuning on is wasted
                self.lost.set()
                self.say(f"job {self.job_id}: no longer this worker's ({e}); stopping after the batch being measured")
            except (httpx.HTTPError, ServiceError) as e:
                log.warning("job %s: heartbeat failed: %s", self.job_id, e)

    def _give_up(self) -> None:
        error = (f"no result after {self.deadline_s:g} s (the worker's --job-timeout): a measurement that "
                 "does not return cannot be stopped, so the worker failed the job and exited")
        try:
            _check(self.http.post(f"/v1/jobs/{self.job_id}/finish", timeout=10.0,
                                  json={"worker": self.worker, "status": "failed", "error": error}),
                   "failing the job")
            outcome = error
        except (httpx.HTTPError, ServiceError) as e:
            outcome = f"{error}; the service was not told ({e}): the job returns to the queue when its lease runs out"
        self.say(f"job {self.job_id}: failed: {outcome}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(JOB_TIMEOUT_EXIT)

    def __enter__(self) -> _Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class Stopped(Exception):
    """The worker was stopped by a signal: ``done`` jobs finished, ``job`` the one it held (or
    None) and ``outcome`` what became of it."""

    def __init__(self, signum: int, done: int, job: int | None, outcome: str):
        self.signum, self.done, self.job, self.outcome = signum, done, job, outcome
        name = signal.Signals(signum).name
        held = f"; job {job}: {outcome}" if job is not None else "; no job was held"
        super().__init__(f"stopped by {name} after {done} job(s){held}")


@contextlib.contextmanager
def _term_interrupts() -> Iterator[list[int]]:
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does, once (a second one
    ends the process as before); yields the list the signal's number is put in. Off the main
    thread, or where SIGTERM is ignored, nothing changes."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield got
        return

    def on_term(signum: int, frame: Any) -> None:
        got.append(signum)
        signal.signal(signal.SIGTERM, previous)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield got
    finally:
        if not got:
            signal.signal(signal.SIGTERM, previous)


def release(http: httpx.Client, job_id: int, worker: str) -> str:
    """Hand a held job back to the queue; says what became of it (never raises)."""
    try:
        _check(http.post(f"/v1/jobs/{job_id}/release", json={"worker": worker}, timeout=10.0),
               "releasing the job")
        return "handed back to the queue"
    except (httpx.HTTPError, ServiceError, KeyboardInterrupt) as e:
        why = "interrupted again" if isinstance(e, KeyboardInterrupt) else str(e)
        return f"not handed back ({why}); it returns to the queue when its lease expires"


def job_deadline(job_timeout_s: float | None, seconds: float | None) -> float | None:
    """How long a job may run: ``job_timeout_s`` (None or 0: no limit), or twice its own search
    time budget (``seconds``) where that is longer."""
    if not job_timeout_s:
        return None
    return max(float(job_timeout_s), 2.0 * float(seconds or 0))


def _tune_job(ts: Any, http: httpx.Client, service: str, database: Any, job: dict[str, Any], worker: str,
              lease_s: float, defaults: dict[str, Any], say: Any,
              job_timeout_s: float | None = None) -> tuple[str, str | None]:
    """Tune one claimed job under a renewed lease and upload it through the outbox; returns the
    job's final (status, error), or `LOST` for a job the service no longer holds for this worker
    (cancelled, or failed or re-claimed after its lease ran out): tuning stops after the batch being
    measured and what was measured is uploaded. A service gone for longer than a lease raises (the
    upload stays kept); anything else fails the job alone."""
    import uuid

    from autotuner.tune.search import tune_problem

    problem = problem_from_dict(job["problem"])
    params = {**defaults, **(job.get("params") or {})}
    say(f"job {job['id']}: {problem.describe()}")
    try:
        ts.check(problem)
        run_id = uuid.uuid4().hex[:12]
        deadline = job_deadline(job_timeout_s, params["seconds"])
        with _Heartbeat(http, job["id"], worker, lease_s, deadline, say) as beat:
            tune_problem(ts, database, problem, trials=int(params["trials"]), seconds=params["seconds"],
                         reps=int(params["reps"]), run_id=run_id, name=f"job {job['id']}", stop=beat.lost.is_set)
            if beat.lost.is_set() and not run_items(database, ts.device, problem, run_id):
                say(f"job {job['id']}: stopped before anything was measured")
                return LOST, None
            res = send_run(http, service, database, ts.device, problem, run_id, time.monotonic() + lease_s)
    except (httpx.TransportError, Unavailable):
        raise
    except Exception as e:  # noqa: BLE001 - the job fails, the worker goes on
        error = f"{type(e).__name__}: {e}"[:5000]
        say(f"job {job['id']}: failed: {error}")
        return "failed", error
    w = res.get("winner") or {}
    had = f" ({res['repeated']} more the service had)" if res.get("repeated") else ""
    say(f"job {job['id']}: uploaded {res['recorded']} measurements{had}; winner "
        f"{(w.get('strategy') or {}).get('method', '-')} x{w.get('speedup', float('nan')):.3f}")
    return (LOST if beat.lost.is_set() else "done"), None


def work(ts: Any, service: str, token: str, *, once: bool = False, poll_s: float = 10.0,
         lease_s: float = 300.0, trials: int = 24, seconds: float | None = None, reps: int = 7,
         from_demand: int = 0, max_attempts: int | None = 3, job_timeout_s: float | None = None,
         say: Any = print) -> int:
    """Claim and tune jobs for this target's device until none is left (once) or forever; with
    ``from_demand`` N, an empty queue is filled with jobs for up to N problems lookups missed on
    this device (`POST /v1/jobs/from-demand`). A job is claimed at most ``max_attempts`` times: the
    service fails one whose lease ran out after its last claim (None: no limit). A job still
    running after ``job_timeout_s`` (`job_deadline`) is failed and the process exits
    (`JOB_TIMEOUT_EXIT`).
    Returns the number of jobs finished; raises :class:`Stopped` on SIGINT/SIGTERM, after
    handing the job it holds back to the queue. A service unreachable for longer than a lease
    raises httpx's error (what was measured stays in :func:`outbox`)."""
    from db import Database

    worker = f"{socket.gethostname()}:{os.getpid()}"
    database = Database(scratch_db_url(service))
    database.upgrade()
    defaults = {"trials": trials, "seconds": seconds, "reps": reps}
    claim = {"worker": worker, "lease_seconds": lease_s, "device_key": ts.device.key, "max_attempts": max_attempts}
    done, held = 0, None

    def post(path: str, body: dict[str, Any], what: str) -> Any:
        return call(http, path, body, what, time.monotonic() + lease_s)

    def claimed() -> Any:
        got = post("/v1/jobs/claim", claim, "claiming a job")
        for j in got.get("abandoned") or ():
            say(f"job {j['id']}: failed: {j['error']}")
        return got["job"]

    with http_client(service, token) as http, _term_interrupts() as signals:
        try:
            while True:
                send_pending(http, outbox(service), time.monotonic() + lease_s, say)
                job = claimed()
                if job is None and from_demand:
                    new = post("/v1/jobs/from-demand", {"device_key": ts.device.key, "limit": from_demand},
                               "queueing what lookups missed")["items"]
                    if new:
                        say(f"queued {len(new)} job(s) for problems lookups missed on this device")
                        job = claimed()
                if job is None:
                    if once:
                        return done
                    time.sleep(poll_s)
                    continue
                held = job["id"]
                status, error = _tune_job(ts, http, service, database, job, worker, lease_s, defaults, say,
                                          job_timeout_s)
                if status == LOST:   # not this worker's to finish
                    held = None
                    continue
                try:
                    post(f"/v1/jobs/{held}/finish", {"worker": worker, "status": status, "error": error},
                         "finishing the job")
                except Refused as e:   # its lease ran out and another worker has it, or it was finished
                    say(f"job {held}: not finished here: {e}")
                held = None
                done += 1
        except KeyboardInterrupt:
            outcome = release(http, held, worker) if held is not None else ""
            raise Stopped(signals[0] if signals else signal.SIGINT, done, held, outcome) from None
