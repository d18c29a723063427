"""`autotuner worker`: claim tuning jobs for this target's device from a service, tune them,
upload the results (`autotuner.tune.service_worker`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotuner.cli.common import TOKEN_FILE_HELP, app, check_service_url, err, fail, say, token_of


@app.command()
def worker(
    ctx: typer.Context,
    service: Annotated[str, typer.Option(help="the service URL, e.g. http://autotuner:8000")],
    token: Annotated[str | None, typer.Option(envvar="AUTOTUNER_WORKER_TOKEN", help="a write token of the "
                                              "service (better: the environment variable, or --token-file)")] = None,
    token_file: Annotated[Path | None, typer.Option(help=TOKEN_FILE_HELP)] = None,
    target: Annotated[str | None, typer.Option(help="inproc:N, lab:TOPOLOGY:N:RATE or local")] = None,
    once: Annotated[bool, typer.Option(help="stop when no job is left instead of polling")] = False,
    poll: Annotated[float, typer.Option(min=0.1, help="seconds between claims when the queue is empty")] = 10.0,
    lease: Annotated[float, typer.Option(min=5, help="job lease in seconds, renewed while tuning")] = 300.0,
    trials: Annotated[int, typer.Option(min=1, help="default trial budget per job")] = 24,
    reps: Annotated[int, typer.Option(min=3)] = 7,
    from_demand: Annotated[int, typer.Option(min=0, max=1000, help="when the queue is empty, queue jobs for up to "
                                             "N problems that lookups missed on this device and that have no "
                                             "winner (GET /v1/demand)")] = 0,
    max_attempts: Annotated[int, typer.Option(min=1, help="claim a job at most this many times: one whose "
                                              "lease ran out after its last claim (each worker died on it, "
                                              "e.g. killed for memory, or hung) is failed")] = 3,
    job_timeout: Annotated[float, typer.Option(min=0, help="seconds a job may run (or twice its own search "
                                             "time, if longer); past it the job is failed and the worker exits "
                                             "with code 124 for its supervisor to restart (0: no limit)")] = 3600.0,
) -> None:
    """Claim tuning jobs for this target's device from the service, tune them, upload results.

    With --from-demand N, a queue with nothing for this device is filled from what lookups missed
    on it (each problem once: one whose job failed is not queued again on its own).

    A job whose worker dies on it (a problem that kills its process) returns to the queue when
    its lease runs out; after --max-attempts claims it is failed instead, so it cannot take down
    one worker per lease forever. A job still running after --job-timeout (a collective that never
    completes, a device that hangs) is failed, and the worker exits with code 124: nothing else
    can stop a measurement that does not return.

    Stopped by SIGTERM (docker stop, a pod deleted) or Ctrl-C, the worker hands the job it holds
    back to the queue at once and exits 128 + the signal's number (143, 130); killed outright,
    its job returns to the queue when the lease expires.

    A service that restarts is waited for, up to a lease. Each job's upload is kept in a file
    until the service has stored it, and a worker that starts sends what an earlier one could
    not (stored once, however often sent)."""
    import httpx

    from autotuner.errors import ServiceError
    from autotuner.measure.targets import Target, TargetError, TargetSession, default_target
    from autotuner.tune.service_worker import Stopped, pending_note, work

    token = token_of(ctx, token, token_file)
    if not token:
        fail("a worker needs a write token of the service: set AUTOTUNER_WORKER_TOKEN, or give --token-file "
             "FILE (or --token)")
    check_service_url(service)
    try:
        tgt = Target.parse(target or default_target())
        with TargetSession(tgt, log=say) as ts:
            err.print(f"worker on {ts.device.label} ({ts.device.key[:8]}), service {service}", highlight=False)
            n = work(ts, service, token, once=once, poll_s=poll, lease_s=lease, trials=trials, reps=reps,
                     from_demand=from_demand, max_attempts=max_attempts,
                     job_timeout_s=job_timeout, say=say)
    except Stopped as e:   # SIGTERM (docker stop, a pod deleted) or Ctrl-C: the held job handed back
        err.print(str(e) + pending_note(service), highlight=False, style="bold red")
        raise typer.Exit(128 + e.signum) from None
    except TargetError as e:
        fail(str(e))
    except ServiceError as e:
        fail(str(e) + pending_note(service))
    except httpx.HTTPError as e:
        fail(f"cannot reach {service}: {e}" + pending_note(service))
    err.print(f"{n} job(s) done")
