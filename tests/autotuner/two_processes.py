"""The 2-process JAX job the multi-process tests run (tests/autotuner/runtime/test_client.py,
overlap/test_in_job.py, overlap/test_one_plan.py): jax.distributed on loopback, gloo, one CPU
device per process, and one program's arguments, `a` [16, 8] rows over the 2-way axis `x` and `b`
[8, 12] replicated (`A @ B` is the plain result)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from autotuner.testing import outputs_of
from service.testing import free_port

PROLOGUE = textwrap.dedent("""
    import json, sys
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
    A = (np.arange(16 * 8, dtype=np.float32).reshape(16, 8) % 7) / 7
    B = (np.arange(8 * 12, dtype=np.float32).reshape(8, 12) % 5) / 5
    a = jax.make_array_from_callback(A.shape, NamedSharding(mesh, P("x", None)), lambda i: A[i])
    b = jax.make_array_from_callback(B.shape, NamedSharding(mesh, P(None, None)), lambda i: B[i])
""")
ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, body: str, args: Callable[[int], list[str]], timeout: float) -> list[str]:
    """`PROLOGUE` then `body` as both processes of one job (argv: pid, port, then `args(pid)`),
    no service configured from the environment; their outputs, after asserting both exited 0.
    A process alive after `timeout` seconds kills both and fails the test (a hang)."""
    script = tmp_path / "worker.py"
    script.write_text(PROLOGUE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNER_SERVICE")}
    env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(pid), str(port), *args(pid)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for pid in (0, 1)]
    outputs = outputs_of(procs, timeout=timeout)
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(outputs)
    return outputs
