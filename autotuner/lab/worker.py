"""The worker side: one JAX process of the lab, running handlers in lockstep with the others."""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotuner.lab.spec import LabSpec

if TYPE_CHECKING:
    from jax.sharding import Mesh

# ----------------------------------------------------------------------------- worker side


@dataclass
class WorkerContext:
    """What a handler gets: who it is, plus helpers that work across all processes."""

    process_id: int
    num_processes: int
    spec: LabSpec | None  # None outside a lab (a multi-process `local` tune)
    seq: int = 0
    client: Any = field(default=None, repr=False)
    state: dict[str, Any] = field(default_factory=dict, repr=False)  # a handler's own, per process
    _count: int = field(default=0, repr=False)

    def _key(self, kind: str) -> str:
        self._count += 1  # same sequence on every process because handlers run in lockstep
        return f"lab/{kind}/{self.seq}/{self._count}"

    def barrier(self, name: str, timeout: float = 3600.0) -> None:
        """Wait until every process reaches the barrier of this name."""
        self.client.wait_at_barrier(f"{self._key('b')}/{name}", int(timeout * 1000))

    def gather_json(self, obj: Any, timeout: float = 3600.0) -> list[Any] | None:
        """Process 0 gets every process's JSON-able ``obj`` in process order; others get None."""
        prefix = self._key("g")
        self.client.key_value_set(f"{prefix}/{self.process_id}", json.dumps(obj))
        if self.process_id != 0:
            return None
        got = [json.loads(self.client.blocking_key_value_get(f"{prefix}/{i}", int(timeout * 1000)))
               for i in range(self.num_processes)]
        self.client.key_value_delete(f"{prefix}/")
        return got

    def mesh(self, axis_names: str | Sequence[str] = "x",
             shape: int | Sequence[int] | None = None) -> Mesh:
        """A Mesh over every process's device, in process-id order (1-D by default)."""
        import jax
        import numpy as np

        names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        dims = (len(devices),) if shape is None else (
            (shape,) if isinstance(shape, int) else tuple(shape))
        if len(dims) != len(names) or int(np.prod(dims)) != len(devices):
            raise ValueError(f"mesh shape {dims} for axes {names} does not fit {len(devices)} devices")
        return jax.sharding.Mesh(np.array(devices, dtype=object).reshape(dims), names)


def _wait_key(client: Any, key: str) -> str:
    while True:
        try:
            return str(client.blocking_key_value_get(key, 30_000))
        except Exception as e:  # noqa: BLE001 - jax raises JaxRuntimeError
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def _collect(ctx: WorkerContext, box: dict[str, Any], reply: Any, grace: float = 5.0) -> None:
    """Process 0: wait for every process's status of this request, then send the one reply."""
    prefix, first_error, fatal = f"lab/st/{ctx.seq}/", 0.0, False
    while True:
        status = {int(k.rsplit("/", 1)[1]): json.loads(v)
                  for k, v in ctx.client.key_value_dir_get(prefix)}
        errors = {i: s["error"] for i, s in sorted(status.items()) if "error" in s}
        if len(status) == ctx.num_processes:
            break
        if errors:  # the others are probably stuck in a collective that the failed one left
            first_error = first_error or time.monotonic()
            if time.monotonic() - first_error > grace:
                fatal = True
                break
        time.sleep(0.05)
    if errors:
        missing = sorted(set(range(ctx.num_processes)) - set(status))
        result: dict[str, Any] = {
            "error": "; ".join(f"process {i}: {m}" for i, m in errors.items())
            + (f" (processes {missing} never finished; restarting the lab)" if fatal else ""),
            "errors": {str(i): m for i, m in errors.items()}}
    else:
        result = box["result"]
        ctx.client.key_value_delete(prefix)
        ctx.client.key_value_delete(f"lab/req/{ctx.seq}")
    reply.write(json.dumps({"seq": box["seq"], "result": result, "fatal": fatal}) + "\n")
    reply.flush()


def serve_one(ctx: WorkerContext, handler: Any, seq: int, envelope: dict[str, Any],
              box: dict[str, Any]) -> None:
    """Run request ``seq`` on this process and publish its status (``lab/st/{seq}/{id}``);
    process 0's result goes into ``box["result"]`` for ``_collect``."""
    ctx.seq, ctx._count = seq, 0
    try:
        result = handler(envelope["request"], ctx)
        if ctx.process_id == 0:
            if not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, expected a dict")
            json.dumps(result)  # fail here, as an error reply, if it is not JSON-able
        box["result"], status = result, {"ok": True}
    except Exception as e:  # noqa: BLE001 - every handler failure becomes an error reply
        traceback.print_exc()
        status = {"error": f"{type(e).__name__}: {e}"}
    ctx.client.key_value_set(f"lab/st/{seq}/{ctx.process_id}", json.dumps(status))


def follow(ctx: WorkerContext, handler: Any, first: int = 1) -> None:
    """A process other than 0: run every request process 0 publishes (``lab/req/{seq}``), in
    lockstep with it, until it publishes a shutdown. Raises when the KV store is gone (the
    coordinator, on process 0, died)."""
    for seq in itertools.count(first):
        envelope = json.loads(_wait_key(ctx.client, f"lab/req/{seq}"))
        if envelope.get("kind") == "shutdown":
            return
        serve_one(ctx, handler, seq, envelope, {})


def lead_one(ctx: WorkerContext, handler: Any, seq: int, line: str, reply: Any) -> bool:
    """Process 0: publish request ``line`` (a JSON envelope; empty: shutdown) as number ``seq``
    for the others, run it here too, and write the one merged reply line to ``reply`` (see
    `_collect`). False when it was the shutdown."""
    line = line or json.dumps({"kind": "shutdown"})
    ctx.client.key_value_set(f"lab/req/{seq}", line)
    envelope = json.loads(line)
    if envelope.get("kind") == "shutdown":
        return False
    box = {"seq": envelope.get("seq")}  # the requester's number
    ctx.seq, ctx._count = seq, 0  # before the collector reads it
    collector = threading.Thread(target=_collect, args=(ctx, box, reply), daemon=True)
    collector.start()
    serve_one(ctx, handler, seq, envelope, box)
    collector.join()
    return True


def worker_main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m autotuner.lab worker")
    for name in ("--id", "--n", "--init-timeout"):
        p.add_argument(name, type=int, required=True)
    for name in ("--coordinator", "--handler", "--spec"):
        p.add_argument(name, required=True)
    p.add_argument("--reply-fd", type=int)
    args = p.parse_args(argv)
    module, _, func = args.handler.partition(":")
    handler = getattr(importlib.import_module(module), func)
    import jax
    from jax._src import distributed

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        args.coordinator, args.n, args.id, initialization_timeout=args.init_timeout,
        coordinator_bind_address=args.coordinator if args.id == 0 else None)
    ctx = WorkerContext(args.id, args.n, LabSpec(**json.loads(args.spec)),
                        client=distributed.global_state.client)
    devices = jax.devices()  # initialises the CPU backend (gloo rendezvous) on every process
    ctx.client.wait_at_barrier("lab/ready", args.init_timeout * 1000)
    reply = os.fdopen(args.reply_fd, "w") if args.id == 0 else None
    if reply is not None:
        reply.write(json.dumps({"seq": 0, "devices": [str(d) for d in devices]}) + "\n")
        reply.flush()
    if reply is None:
        follow(ctx, handler)
    else:
        for seq in itertools.count(1):
            if not lead_one(ctx, handler, seq, sys.stdin.readline(), reply):
                break
    jax.distributed.shutdown()


def echo_handler(request: dict, ctx: WorkerContext) -> dict:
    """Prove collectives run across processes: psum and all-gather of the process ids over a
    1-D mesh of all devices, then a timed ring ppermute of ``mib`` MiB per process.

    Request keys (all optional): ``mib`` (2), ``reps`` (3), ``sleep`` (seconds, before any
    collective), ``raise`` (message to raise) with ``raise_on`` (process ids, default all)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, me = ctx.num_processes, ctx.process_id
    time.sleep(float(request.get("sleep", 0)))
    if "raise" in request and me in request.get("raise_on", range(n)):
        raise RuntimeError(str(request["raise"]))
    mesh = ctx.mesh("x")
    sharding = NamedSharding(mesh, P("x"))
    ids = jax.make_array_from_process_local_data(sharding, np.array([me], np.int32))
    reduce = jax.jit(jax.shard_map(
        lambda x: (jax.lax.psum(x, "x"), jax.lax.all_gather(x, "x", tiled=True)),
        mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"))))  # each shard: the whole gather
    total, gathered = (np.asarray(a.addressable_data(0)) for a in reduce(ids))

    nbytes = int(float(request.get("mib", 2)) * 2**20) // 4 * 4
    payload = jax.make_array_from_process_local_data(
        sharding, np.full((nbytes // 4,), me, np.float32))
    shift = jax.jit(jax.shard_map(
        lambda x: jax.lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)]),
        mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    got = np.asarray(shift(payload).addressable_data(0))  # also the warm-up
    times = []
    for _ in range(int(request.get("reps", 3))):
        t0 = time.perf_counter()
        shift(payload).block_until_ready()
        times.append(time.perf_counter() - t0)
    info = {"process_id": me, "process_index": jax.process_index(),
            "device": str(jax.local_devices()[0]), "pid": os.getpid(),
            "address": socket.gethostbyname(socket.gethostname()),
            "cpus": sorted(os.sched_getaffinity(0)), "psum": int(total[0]),
            "all_gather": gathered.tolist(), "ppermute_ok": bool((got == (me - 1) % n).all()),
            "ppermute_s": statistics.median(times)}
    infos = ctx.gather_json(info)
    if infos is None:
        return {}
    seconds = statistics.median(i["ppermute_s"] for i in infos)
    return {"label": ctx.spec.label, "num_processes": n, "psum": info["psum"],
            "all_gather": info["all_gather"],
            "ok": all(i["psum"] == n * (n - 1) // 2 and i["all_gather"] == list(range(n))
                      and i["ppermute_ok"] for i in infos),
            "ppermute": {"bytes": nbytes, "seconds": seconds, "gbit_s": nbytes * 8 / seconds / 1e9},
            "processes": infos}
