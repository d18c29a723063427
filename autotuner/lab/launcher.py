"""The parent side: `Lab` starts the workers in their namespaces, relays calls, tears down."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import itertools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from autotuner.lab.net import Net
from autotuner.lab.spec import (
    COORDINATOR_PORT,
    HANDLER_FORM,
    LOG_TAIL,
    REPO_ROOT,
    LabError,
    LabSpec,
    LabWorkerError,
)

_LIVE: weakref.WeakSet[Lab] = weakref.WeakSet()
_LAB_NUMBER = itertools.count()
_HOOKED = {"atexit": False, "signals": False}  # process-wide hooks, set by the first start
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
    """When a lab starts (importing this module changes nothing): once per process, close every
    lab at exit; once from the main thread (the only one that may set signal handlers), close
    them on SIGINT/SIGTERM before the previous handler runs."""
    if not _HOOKED["atexit"]:
        _HOOKED["atexit"] = True
        atexit.register(_close_all)
    if not _HOOKED["signals"] and threading.current_thread() is threading.main_thread():
        _HOOKED["signals"] = True
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, functools.partial(_on_signal, signal.getsignal(sig)))


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
        if not HANDLER_FORM.match(handler):
            raise LabError(f"handler must be 'module:function', got {handler!r}")
        self.spec, self.handler, self.start_timeout = spec, handler, start_timeout
        self._env, self._log = dict(env or {}), log or (lambda message: None)
        number = next(_LAB_NUMBER)
        self._base, self._short = f"otl{os.getpid()}-{number}", f"otl{os.getpid() % 10000}"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._net: Net | None = None
        self._tmp: str | None = None
        self._reply: int | None = None
        self._buf = b""
        self._seq = 0
        self._lock = threading.RLock()
        self.starts = 0          # how many times the workers were started: a caller whose handler
        #                          state lives in them sees a restart as this number changing
        self.last_death = ""     # why the workers were last torn down (a death, a timeout), if they were

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
            if self._procs:   # a worker died since the last call: it starts afresh, say why
                self.last_death = f"{self._dead()} between calls"
            self._teardown()
            _install_hooks()
            _LIVE.add(self)
            t0 = time.monotonic()
            try:
                self._net = Net.create(self.spec, self._base, self._short)
                self._spawn()
                self._wait_reply(0, self.start_timeout, "start")
            except BaseException:
                self._teardown()
                raise
            self.starts += 1
            self._log(f"lab {self.spec.label} n={self.spec.n} ready in {time.monotonic() - t0:.1f}s")
            threading.Thread(target=self._watch, args=(self._procs,), daemon=True).start()

    def _watch(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """Between calls, tear the whole lab down as soon as any worker dies."""
        while self._procs is procs:
            time.sleep(0.5)
            if self._procs is procs and self._dead() and self._lock.acquire(blocking=False):
                try:
                    if self._procs is procs:
                        self.last_death = f"{self._dead()} while idle"
                        self._log(f"lab {self.spec.label}: {self.last_death}; torn down")
                        self._teardown()
                finally:
                    self._lock.release()

    def call(self, request: dict, timeout: float, *, fresh: bool = True) -> dict:
        """Run the handler on every process; return process 0's result (or ``{"error": ...}``).
        A lab that is down or lost a worker since the last call starts afresh for it; with
        ``fresh=False`` (a request that needs what earlier calls left in the workers) that is
        a LabWorkerError instead, which names the death, and the next call starts afresh."""
        with self._lock:
            starts = self.starts
            self.start()  # (re)starts the lab if it is down or a worker died
            if not fresh and self.starts != starts and starts:
                raise LabWorkerError(f"lab {self.spec.label} n={self.spec.n}: {self.last_death or 'it was down'}; "
                                     "it started afresh, without what the earlier calls left in it")
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
                   PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p))
        port = COORDINATOR_PORT if net.namespaces else _free_port()
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
        self.last_death = message
        tails = []
        for i in range(len(self._procs)):
            with contextlib.suppress(OSError, TypeError):
                text = Path(self._tmp or "", f"process{i}.log").read_text(errors="replace")
                lines = [ln for ln in text.splitlines() if ln.strip()][-LOG_TAIL:]
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
    with Lab(spec, "autotuner.lab.worker:echo_handler", start_timeout=timeout, log=log) as lab:
        t1 = time.monotonic()
        result = lab.call({"mib": 4, "reps": 5}, timeout)
        t2 = time.monotonic()
    return {"label": spec.label, "spec": asdict(spec), "start_s": t1 - t0, "call_s": t2 - t1,
            "total_s": time.monotonic() - t0, "result": result}
