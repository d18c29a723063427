"""Multi-process `local`: `autotuner tune --target local` started once per host, as a JAX
multi-host job is, measuring on the global mesh of every process's devices.

Process 0 leads: it runs the tuner as a single process does and, for every measurement request
(the lab's protocol, `autotuner.measure.lab_target.handle`), publishes the request in the
`jax.distributed` key-value store and runs it itself; the other processes only follow
(`autotuner.lab.worker.follow`), running the same request in lockstep, until process 0 publishes
the shutdown. A process that dies takes the job down: the coordination service notices the
missing heartbeats and stops every other process; a process whose request failed while the
others are stuck in a collective with it makes process 0 stop the job with one line.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotuner.errors import AutotunerError

HEARTBEAT_S = 30  # a process silent this long is dead: the job stops


class MultiProcessError(AutotunerError, RuntimeError):
    pass


@dataclass(frozen=True)
class Job:
    coordinator: str
    num_processes: int
    process_id: int


def job_from(coordinator: str | None, num_processes: int | None, process_id: int | None,
             env: dict[str, str] | None = None) -> Job | None:
    """The multi-process job to join: the options, else ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (what `autotuner lab run` sets) when
    ``JAX_NUM_PROCESSES`` > 1; None for a single process."""
    env = dict(os.environ) if env is None else env
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if any(given):
        if not all(given):
            raise MultiProcessError("a multi-process run needs --coordinator HOST:PORT, "
                                    "--num-processes N and --process-id I together")
        job = Job(str(coordinator), int(num_processes or 0), int(process_id or 0))
    else:
        try:
            n = int(env.get("JAX_NUM_PROCESSES") or 1)
        except ValueError:
            raise MultiProcessError(f"JAX_NUM_PROCESSES={env['JAX_NUM_PROCESSES']!r} is not a number") from None
        if n <= 1:
            return None
        addr, pid = env.get("JAX_COORDINATOR_ADDRESS"), env.get("JAX_PROCESS_ID")
        if not addr or pid is None or not pid.isdigit():
            raise MultiProcessError(f"JAX_NUM_PROCESSES={n} needs JAX_COORDINATOR_ADDRESS and "
                                    "JAX_PROCESS_ID too")
        job = Job(addr, n, int(pid))
    if job.num_processes < 1 or not 0 <= job.process_id < job.num_processes:
        raise MultiProcessError(f"process id {job.process_id} is not in 0..{job.num_processes - 1}")
    if job.num_processes == 1:
        return None
    return job


def join(job: Job, init_timeout: int = 300) -> Any:
    """Join the job (`jax.distributed.initialize`, before anything else initialises JAX) and
    return this process's `WorkerContext` once every process is up."""
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            raise MultiProcessError("JAX is already initialised; a multi-process run must join first")
    import jax
    from jax._src import distributed

    from autotuner.lab.worker import WorkerContext

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives
    jax.distributed.initialize(job.coordinator, job.num_processes, job.process_id,
                               initialization_timeout=init_timeout,
                               heartbeat_timeout_seconds=HEARTBEAT_S)
    ctx = WorkerContext(job.process_id, job.num_processes, None,
                        client=distributed.global_state.client)
    jax.devices()  # the backend (and its collectives' rendezvous) on every process
    ctx.client.wait_at_barrier("local/ready", init_timeout * 1000)
    return ctx


class _Reply:
    """`_collect`'s reply sink: keeps the line; a fatal one (a process failed while the others
    are stuck in a collective with it) stops this process, and with it the job."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.lines = say, []

    def write(self, line: str) -> None:
        msg = json.loads(line)
        if msg.get("fatal"):
            why = " ".join(str(msg["result"]["error"]).split()).replace("restarting the lab", "stopping the job")
            sys.stdout.flush()
            sys.stderr.write(f"error: the multi-process run failed: {why}\n")  # one line, unwrapped
            sys.stderr.flush()
            os._exit(1)  # the others lose the coordinator and stop too
        self.lines.append(msg)

    def flush(self) -> None:
        pass


class Leader:
    """Process 0's side, in place of a `Lab` for `LabRunner`: ``call`` runs one request on every
    process in lockstep and returns the merged reply; ``close`` sends the others home."""

    def __init__(self, ctx: Any, handler: Callable[[dict, Any], dict] | None = None,
                 say: Callable[[str], None] | None = None):
        if handler is None:
            from autotuner.measure.lab_target import handle as handler
        self.ctx, self.handler, self.seq = ctx, handler, 0
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.closed = False

    def call(self, request: dict[str, Any], timeout: float | None = None, *, fresh: bool = True) -> dict[str, Any]:
        """(`fresh` as `Lab.call` has it; a job never starts afresh: a death stops it, `_Reply`.)"""
        from autotuner.lab.worker import lead_one

        self.seq += 1
        reply = _Reply(self.say)
        lead_one(self.ctx, self.handler, self.seq, json.dumps({"seq": self.seq, "request": request}), reply)
        return dict(reply.lines[-1]["result"])

    def close(self) -> None:
        if self.closed:
            return
        from autotuner.lab.worker import lead_one

        self.closed = True
        self.seq += 1
        lead_one(self.ctx, self.handler, self.seq, "", None)
        shutdown()


def shutdown() -> None:
    import jax

    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass


def follow(ctx: Any) -> None:
    """Process 1.. of a multi-process tune: measure what process 0 asks, until it says stop."""
    from autotuner.lab.worker import follow as follow_requests
    from autotuner.measure.lab_target import handle

    try:
        follow_requests(ctx, handle)
    except Exception as e:  # noqa: BLE001 - jax raises its runtime errors
        raise MultiProcessError(f"process {ctx.process_id}: lost process 0 (the leader): "
                                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    shutdown()
