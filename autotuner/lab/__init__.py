"""The emulated multi-host CPU mesh ("lab"): N JAX processes, one CPU device each, joined by
``jax.distributed`` with gloo collectives, on 127.0.0.1 (``none``), in one namespace with a
``tbf``-shaped loopback (``shared``), or one namespace each with a shaped veth pair per ring
neighbour link (``ring``: each direction of each link has its own bandwidth).

The parent writes JSON requests to process 0's stdin and reads replies from a dedicated pipe;
process 0 relays each request through the distributed key-value store, every process runs
``handler(request, ctx)`` in lockstep, and process 0 replies once all have reported ok/error.
Workers die with the thread that started them (``PR_SET_PDEATHSIG``): use a long-lived one.
"""

from __future__ import annotations

from autotuner.lab.launcher import Lab, run_lab_smoke
from autotuner.lab.run import RunResult, lab_env, run_on_lab
from autotuner.lab.spec import LabError, LabSpec, LabWorkerError
from autotuner.lab.worker import WorkerContext, echo_handler

__all__ = ["Lab", "LabError", "LabSpec", "LabWorkerError", "RunResult", "WorkerContext",
           "echo_handler", "lab_env", "run_lab_smoke", "run_on_lab"]
