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

import argparse
import atexit
import contextlib
import ctypes
import functools
import importlib
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .errors import AutotunerError

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["Lab", "LabError", "LabSpec", "LabWorkerError", "WorkerContext", "echo_handler",
           "run_lab_smoke"]

Topology = Literal["none", "shared", "ring"]
_TOPOLOGIES = ("none", "shared", "ring")
_RATE = re.compile(r"^\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)$", re.IGNORECASE)
_SIZE = re.compile(r"^\d+(\.\d+)?([kmg]?b?|[kmg]bit)$", re.IGNORECASE)
_TIME = re.compile(r"^\d+(\.\d+)?(s|sec|ms|msec|us|usec)$", re.IGNORECASE)
_HANDLER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_OWNED = re.compile(r"^otl(\d+)-\d+-")  # otl<owner pid>-<lab number>-<process or tmp suffix>
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
_PORT = 8476           # coordinator port inside a fresh namespace (nothing else listens there)
_LOG_TAIL = 15

# Pin each worker to one core, or leave placement to the scheduler? Measured here (2 cores,
# lab:shared:2:2gbit, all-gather of a 1024x1024 f32 shard then a matmul with a 1024x768 shard, vs
# a ppermute ring decomposition in 2 chunks; medians of 7-11 interleaved reps, ms, baseline/ring):
# pinned 54-61 / 48-51, unpinned 50-62 / 41-50 (pin switched per rep inside one lab);
# Lab(pin=True) 56-71 / 53-71, Lab(pin=False) 50-72 / 41-59 (3 labs each, alternating).
# Comm alone 31 ms. Unpinned is never slower and keeps more of the overlap, so it is the default.
PIN_DEFAULT = False


class LabError(AutotunerError, RuntimeError):
    """The lab cannot be set up here (not root, no `ip`, no netns or tbf support, bad spec)."""


class LabWorkerError(LabError):
    """A worker died or a call timed out; the lab was torn down and restarts on the next call."""


@dataclass(frozen=True)
class LabSpec:
    topology: Topology
    n: int
    rate: str = "2gbit"
    burst: str = "1mb"  # small against the messages: a 4mb bucket let 4 MiB shards pass unshaped
    latency: str = "100ms"
    pin: bool = PIN_DEFAULT

    def __post_init__(self) -> None:
        if self.topology not in _TOPOLOGIES:
            raise LabError(f"lab topology must be one of {_TOPOLOGIES}, got {self.topology!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= 8:
            raise LabError(f"lab process count must be an integer in 1..8, got {self.n!r}")
        for name, pattern, example in (("rate", _RATE, "2gbit"), ("burst", _SIZE, "1mb"),
                                       ("latency", _TIME, "100ms")):
            value = getattr(self, name)
            if not isinstance(value, str) or not pattern.match(value):
                raise LabError(f"lab {name} must look like {example!r}, got {value!r}")

    @classmethod
    def parse(cls, target: str) -> LabSpec:
        """Parse ``lab:TOPOLOGY:N[:RATE]``, e.g. ``lab:shared:2:2gbit`` or ``lab:none:2``."""
        parts = target.strip().split(":")
        if parts[0] != "lab" or len(parts) not in (3, 4):
            raise LabError(f"bad lab target {target!r}: expected lab:TOPOLOGY:N[:RATE], e.g. "
                           "lab:shared:2:2gbit, lab:ring:4:1gbit or lab:none:2")
        if not parts[2].isdigit():
            raise LabError(f"bad lab target {target!r}: process count {parts[2]!r} is not a number")
        rate = {"rate": parts[3]} if len(parts) == 4 else {}
        return cls(parts[1], int(parts[2]), **rate)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        """Topology label for the device fingerprint: ``lab-shared-2gbit``, ``lab-none``."""
        return "lab-none" if self.topology == "none" else f"lab-{self.topology}-{self.rate.lower()}"


# ----------------------------------------------------------------------------- worker side


@dataclass
class WorkerContext:
    """What a handler gets: who it is, plus helpers that work across all processes."""

    process_id: int
    num_processes: int
    spec: LabSpec
    seq: int = 0
    client: Any = field(default=None, repr=False)
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


def _worker_main(argv: Sequence[str]) -> None:
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
    for seq in itertools.count(1):
        if reply is not None:
            line = sys.stdin.readline() or json.dumps({"kind": "shutdown"})
            ctx.client.key_value_set(f"lab/req/{seq}", line)
        else:
            line = _wait_key(ctx.client, f"lab/req/{seq}")
        envelope = json.loads(line)
        if envelope.get("kind") == "shutdown":
            break
        ctx.seq, ctx._count, box = seq, 0, {"seq": envelope.get("seq")}  # the parent's number
        collector = None
        if reply is not None:
            collector = threading.Thread(target=_collect, args=(ctx, box, reply), daemon=True)
            collector.start()
        try:
            result = handler(envelope["request"], ctx)
            if args.id == 0:
                if not isinstance(result, dict):
                    raise TypeError(f"handler returned {type(result).__name__}, expected a dict")
                json.dumps(result)  # fail here, as an error reply, if it is not JSON-able
            box["result"], status = result, {"ok": True}
        except Exception as e:  # noqa: BLE001 - every handler failure becomes an error reply
            traceback.print_exc()
            status = {"error": f"{type(e).__name__}: {e}"}
        ctx.client.key_value_set(f"lab/st/{seq}/{args.id}", json.dumps(status))
        if collector is not None:
            collector.join()
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


# ----------------------------------------------------------------------------- parent side


def _run(*cmd: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise LabError(f"`{cmd[0]}` not found; the lab needs iproute2 (ip, tc)") from e
    if done.returncode != 0:
        hint = " (does this kernel have the tbf qdisc?)" if " tbf " in f" {' '.join(cmd)} " else ""
        raise LabError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}{hint}")
    return done.stdout


def _delete_namespace(ns: str) -> None:
    with contextlib.suppress(LabError):
        for pid in _run("ip", "netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(LabError):
        _run("ip", "netns", "delete", ns)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _reap_leftovers(netns: bool) -> None:
    """Remove what labs of dead (e.g. SIGKILLed) parents left: log dirs, namespaces, /etc/netns."""
    def dead(name: str) -> bool:
        return (m := _OWNED.match(name)) is not None and not Path(f"/proc/{m.group(1)}").exists()

    tmp = tempfile.gettempdir()
    for name in filter(dead, os.listdir(tmp)):
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    if not netns:
        return
    names = {line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()}
    with contextlib.suppress(OSError):
        names.update(os.listdir("/etc/netns"))
    for ns in sorted(filter(dead, names)):
        _delete_namespace(ns)


@dataclass
class _Net:
    """The namespaces of one lab; ``exec_prefix(i)`` runs a command in process i's namespace."""

    namespaces: list[str]
    addresses: list[str]

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i]] if self.namespaces else []

    def destroy(self) -> None:
        for ns in self.namespaces:
            _delete_namespace(ns)

    @classmethod
    def create(cls, spec: LabSpec, base: str, short: str) -> _Net:
        if spec.topology == "none":
            _reap_leftovers(netns=False)
            return cls([], ["127.0.0.1"] * spec.n)
        if os.geteuid() != 0:
            raise LabError(f"topology {spec.topology!r} needs root for network namespaces "
                           f"(running as uid {os.geteuid()}); use lab:none:{spec.n} instead")
        for tool in ("ip", "tc", "sysctl"):
            if shutil.which(tool) is None:
                raise LabError(f"topology {spec.topology!r} needs `{tool}`, which is not on PATH")
        _reap_leftovers(netns=True)
        count = 1 if spec.topology == "shared" else spec.n
        net = cls([f"{base}-{i}" for i in range(count)], [])
        try:
            net._build(spec, short)
        except BaseException:
            net.destroy()
            raise
        return net

    def _build(self, spec: LabSpec, short: str) -> None:
        tbf = ("root", "tbf", "rate", spec.rate, "burst", spec.burst, "latency", spec.latency)
        ring = spec.topology == "ring"
        self.addresses = ([f"10.213.0.{i + 1}" for i in range(spec.n)] if ring
                          else ["127.0.0.1"] * spec.n)
        for i, ns in enumerate(self.namespaces):
            try:
                _run("ip", "netns", "add", ns)
            except LabError as e:
                raise LabError(f"cannot create a network namespace (needs `ip netns`): {e}") from e
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(
                f"127.0.0.1 localhost\n{self.addresses[i]} {socket.gethostname()}\n")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if not ring:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", *tbf)
                continue
            _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/32", "dev", "lo")
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1",
                 "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")
        n = spec.n if ring else 1
        links = [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)] if n > 2 else []
        peer: dict[tuple[int, int], str] = {}  # (i, j): j's address on the i-j link
        for k, (a, b) in enumerate(links):
            ends = {a: (b, f"10.213.1.{4 * k + 1}"), b: (a, f"10.213.1.{4 * k + 2}")}
            _run("ip", "-n", self.namespaces[a], "link", "add", f"{short}v{b}", "type", "veth",
                 "peer", "name", f"{short}v{a}", "netns", self.namespaces[b])
            for me, (other, addr) in ends.items():
                ns, dev = self.namespaces[me], f"{short}v{other}"
                _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *tbf)
                peer[(other, me)] = addr
        for i in range(n):
            for dst in range(n):
                if dst != i:  # the shorter way round; ties go clockwise
                    hop = (i + 1) % n if (dst - i) % n <= n // 2 else (i - 1) % n
                    _run("ip", "-n", self.namespaces[i], "route", "add", f"{self.addresses[dst]}/32",
                         "via", peer[(i, hop)], "dev", f"{short}v{hop}", "src", self.addresses[i])


_LIVE: weakref.WeakSet[Lab] = weakref.WeakSet()
_LAB_NUMBER = itertools.count()
_HOOKED = False
_PR_SET_PDEATHSIG = 1


def _close_all() -> None:
    for lab in list(_LIVE):
        lab._teardown()


def _on_signal(previous: Any, signum: int, frame: Any) -> None:
    _close_all()
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    """Once: close every lab at exit, and on SIGINT/SIGTERM before the previous handler runs."""
    global _HOOKED
    if _HOOKED or threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; try again from there
    _HOOKED = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, functools.partial(_on_signal, signal.getsignal(sig)))


atexit.register(_close_all)


def _child_setup(prctl: Any, cpu: int | None) -> None:
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the parent, even on SIGKILL
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _describe(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


class Lab:
    """A running emulated mesh: ``with Lab(spec, "pkg.mod:handler") as lab: lab.call(req, 60)``."""

    def __init__(self, spec: LabSpec, handler: str, *, env: dict[str, str] | None = None,
                 start_timeout: float = 120.0, log: Callable[[str], None] | None = None) -> None:
        """``handler``: "module:function" importable in the workers; ``env``: added to the
        workers' environment (JAX_PLATFORMS=cpu and one XLA host device are always forced)."""
        if not _HANDLER.match(handler):
            raise LabError(f"handler must be 'module:function', got {handler!r}")
        self.spec, self.handler, self.start_timeout = spec, handler, start_timeout
        self._env, self._log = dict(env or {}), log or (lambda message: None)
        number = next(_LAB_NUMBER)
        self._base, self._short = f"otl{os.getpid()}-{number}", f"otl{os.getpid() % 10000}"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._net: _Net | None = None
        self._tmp: str | None = None
        self._reply: int | None = None
        self._buf = b""
        self._seq = 0
        self._lock = threading.RLock()

    @property
    def name(self) -> str:
        """Prefix of this lab's namespaces (``otl<pid>-<k>``), the same across restarts."""
        return self._base

    @property
    def namespaces(self) -> list[str]:
        return list(self._net.namespaces) if self._net else []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Create the links, spawn the workers and wait until all of them are ready."""
        with self._lock:
            if self.running:
                return
            self._teardown()
            _install_hooks()
            _LIVE.add(self)
            t0 = time.monotonic()
            try:
                self._net = _Net.create(self.spec, self._base, self._short)
                self._spawn()
                self._wait_reply(0, self.start_timeout, "start")
            except BaseException:
                self._teardown()
                raise
            self._log(f"lab {self.spec.label} n={self.spec.n} ready in {time.monotonic() - t0:.1f}s")
            threading.Thread(target=self._watch, args=(self._procs,), daemon=True).start()

    def _watch(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """Between calls, tear the whole lab down as soon as any worker dies."""
        while self._procs is procs:
            time.sleep(0.5)
            if self._procs is procs and self._dead() and self._lock.acquire(blocking=False):
                try:
                    if self._procs is procs:
                        self._log(f"lab {self.spec.label}: {self._dead()} while idle; torn down")
                        self._teardown()
                finally:
                    self._lock.release()

    def call(self, request: dict, timeout: float) -> dict:
        """Run the handler on every process; return process 0's result (or ``{"error": ...}``)."""
        with self._lock:
            self.start()  # (re)starts the lab if it is down or a worker died
            self._seq += 1
            assert self._procs[0].stdin is not None
            try:
                self._procs[0].stdin.write(json.dumps(
                    {"seq": self._seq, "kind": "call", "request": request}).encode() + b"\n")
                self._procs[0].stdin.flush()
            except OSError as e:
                raise self._fail(f"call {self._seq}: cannot write to process 0 ({e})") from e
            reply = self._wait_reply(self._seq, timeout, f"call {self._seq}")
            if reply.get("fatal"):
                self._log(f"lab: {reply['result'].get('error')}")
                self._teardown()
            return dict(reply["result"])

    def close(self) -> None:
        """Stop the workers (cleanly if they are alive) and remove every namespace. Idempotent."""
        with self._lock:
            if self.running and self._procs[0].stdin is not None:
                with contextlib.suppress(OSError):
                    self._procs[0].stdin.write(b'{"kind": "shutdown"}\n')
                    self._procs[0].stdin.close()
                deadline = time.monotonic() + 10
                for p in self._procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(max(0.1, deadline - time.monotonic()))
            self._teardown()
            _LIVE.discard(self)

    def _spawn(self) -> None:
        assert self._net is not None
        spec, net = self.spec, self._net
        self._tmp = tempfile.mkdtemp(prefix=f"{self._base}-")
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        env.update(self._env)
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                   XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=1"]),
                   PYTHONPATH=os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p))
        port = _PORT if net.namespaces else _free_port()
        cpus = sorted(os.sched_getaffinity(0))
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        read_end, write_end = os.pipe()
        self._reply, self._buf = read_end, b""
        try:
            for i in range(spec.n):
                cmd = [*net.exec_prefix(i if spec.topology == "ring" else 0), sys.executable,
                       "-m", "autotuner.lab", "worker", "--id", str(i), "--n", str(spec.n),
                       "--coordinator", f"{net.addresses[0]}:{port}", "--handler", self.handler,
                       "--spec", json.dumps(asdict(spec)),
                       "--init-timeout", str(max(1, int(self.start_timeout)))]
                with open(os.path.join(self._tmp, f"process{i}.log"), "wb") as logfile:
                    self._procs.append(subprocess.Popen(
                        [*cmd, "--reply-fd", str(write_end)] if i == 0 else cmd,
                        stdin=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                        stdout=logfile, stderr=subprocess.STDOUT, env=env,
                        pass_fds=(write_end,) if i == 0 else (), start_new_session=True,
                        preexec_fn=functools.partial(
                            _child_setup, prctl, cpus[i % len(cpus)] if spec.pin else None)))
        finally:
            os.close(write_end)

    def _wait_reply(self, seq: int, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                message = json.loads(line)
                if message.get("seq") == seq:
                    return dict(message)
            dead = self._dead()
            if dead:
                raise self._fail(f"{what}: {dead}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"{what} timed out after {timeout:g}s")
            if self._reply is None:
                raise self._fail(f"{what}: the lab was closed")
            try:
                ready, _, _ = select.select([self._reply], [], [], min(left, 0.05))
                chunk = os.read(self._reply, 1 << 16) if ready else b""
            except (OSError, ValueError) as e:
                raise self._fail(f"{what}: the lab was closed ({e})") from e
            if ready and not chunk:  # process 0 closed its reply pipe: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._procs[0].wait(2)
                raise self._fail(f"{what}: {self._dead() or 'process 0 closed its reply pipe'}")
            self._buf += chunk

    def _dead(self) -> str:
        for i, p in enumerate(self._procs):
            rc = p.poll()
            if rc is not None:
                return f"process {i} (pid {p.pid}) {_describe(rc)}"
        return ""

    def _fail(self, message: str) -> LabWorkerError:
        """Tear the lab down and build the error, with the end of each worker's log."""
        tails = []
        for i in range(len(self._procs)):
            with contextlib.suppress(OSError, TypeError):
                text = Path(self._tmp or "", f"process{i}.log").read_text(errors="replace")
                lines = [ln for ln in text.splitlines() if ln.strip()][-_LOG_TAIL:]
                tails.append(f"--- process {i} log (last {len(lines)} lines) ---\n" + "\n".join(lines))
        self._teardown()
        self._log(f"lab {self.spec.label} n={self.spec.n}: {message}; torn down")
        return LabWorkerError(f"lab {self.spec.label} n={self.spec.n}: {message}\n" + "\n".join(tails))

    def _teardown(self) -> None:
        procs, self._procs = self._procs, []
        net, self._net = self._net, None
        for p in procs:
            if p.poll() is None:  # alive, so its pid (= its process group) is still ours
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()
        if self._reply is not None:
            with contextlib.suppress(OSError):
                os.close(self._reply)
            self._reply = None
        if net is not None:
            net.destroy()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def run_lab_smoke(spec: LabSpec | str, *, timeout: float = 120.0,
                  log: Callable[[str], None] | None = None) -> dict:
    """Start a lab, run :func:`echo_handler` once, stop it; the result and the timings."""
    spec = LabSpec.parse(spec) if isinstance(spec, str) else spec
    t0 = time.monotonic()
    with Lab(spec, "autotuner.lab:echo_handler", start_timeout=timeout, log=log) as lab:
        t1 = time.monotonic()
        result = lab.call({"mib": 4, "reps": 5}, timeout)
        t2 = time.monotonic()
    return {"label": spec.label, "spec": asdict(spec), "start_s": t1 - t0, "call_s": t2 - t1,
            "total_s": time.monotonic() - t0, "result": result}


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"]:
        sys.exit("usage: python -m autotuner.lab worker ... (started by autotuner.lab.Lab)")
    from autotuner.lab import _worker_main as main  # the importable module, not __main__

    main(sys.argv[2:])
