"""`autotuner lab run TARGET -- CMD ...`: run any command once per lab process, in the lab's
namespaces and links, with the environment a multi-host JAX program reads, as on N hosts.

Every process gets ``JAX_COORDINATOR_ADDRESS`` (process 0's namespace, reachable from all),
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (for ``jax.distributed.initialize``, which reads only
the first by itself), one CPU device, gloo CPU collectives and the repository on
``PYTHONPATH``. Output is streamed line by line, prefixed ``[p<i>] ``. When a process fails,
the others get SIGTERM and,
after a grace period, SIGKILL; SIGINT/SIGTERM/SIGHUP of the runner stop every process the same
way. The namespaces are removed in every case (a SIGKILLed runner's, by the next lab).

``service``: a URL on this host (e.g. ``http://127.0.0.1:8000``) the processes should reach.
Each namespace gets a listening socket on its own loopback, created inside the namespace by a
short helper and handed back over a Unix socket; the runner relays its connections to the
service from the host side. So the service may listen on 127.0.0.1, nothing routes out of the
lab, and each process finds the relay's URL in ``AUTOTUNER_SERVICE_URL``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

from autotuner.lab.launcher import _LAB_NUMBER, _child_setup, _describe, _free_port
from autotuner.lab.net import Net
from autotuner.lab.spec import COORDINATOR_PORT, REPO_ROOT, LabError, LabSpec

GRACE_S = 10.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_HELPER = """if True:  # inside one namespace: a listening socket on its loopback, sent to the runner
    import socket, sys
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(64)
    socket.send_fds(socket.socket(fileno=int(sys.argv[1])), [b"l"], [s.fileno()])
"""


@dataclass
class RunResult:
    """How a `lab run` ended: ``code`` (0 when every process exited 0) and one line saying why."""

    code: int
    message: str = ""


def lab_env(spec: LabSpec, process_id: int, coordinator: str,
            base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of lab process ``process_id``: ``base`` (default: ours, without proxies,
    which must not see the coordinator) plus what a multi-host JAX program on the lab needs."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.lower().endswith("_proxy")}
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=1"]),
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
               JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(spec.n),
               JAX_PROCESS_ID=str(process_id),
               PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p))
    return env


def _resolve(command: str, env: dict[str, str]) -> str:
    found = shutil.which(command, path=env.get("PATH", os.defpath))
    if found is None:
        raise LabError(f"command not found: {command!r}" if os.sep not in command
                       else f"not an executable file: {command!r}")
    return found


class _Relay:
    """Listening sockets inside the lab's namespaces whose connections go to ``url``'s host:port."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if not parts.scheme or not parts.hostname:
            raise LabError(f"--service must be a URL like http://127.0.0.1:8000, got {url!r}")
        try:
            port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        except ValueError as e:
            raise LabError(f"--service {url!r}: {e}") from e
        if port is None:
            raise LabError(f"--service {url!r} has no port")
        self.url, self.target, self._parts = url, (parts.hostname, port), parts
        self._listeners: list[socket.socket] = []
        self._closed = False

    def open(self, prefix: list[str]) -> str:
        """A relay inside the namespace of ``prefix``; the service's URL as seen from there."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with mine, theirs:
            try:
                done = subprocess.run(
                    [*prefix, sys.executable, "-c", _HELPER, str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise LabError(f"cannot open the service relay in the lab: {e}") from e
            if done.returncode != 0:
                raise LabError("cannot open the service relay in the lab: "
                               f"{done.stderr.strip().splitlines()[-1:] or done.returncode}")
            _, fds, _, _ = socket.recv_fds(mine, 16, 1)
        listener = socket.socket(fileno=fds[0])
        self._listeners.append(listener)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        port = listener.getsockname()[1]
        userinfo = self._parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
        return urlunsplit(self._parts._replace(netloc=netloc))

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._closed = True
        for listener in self._listeners:
            with contextlib.suppress(OSError):
                listener.close()


def _pump(pipe: IO[bytes], out: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    with pipe:
        for line in iter(pipe.readline, b""):
            with lock:
                with contextlib.suppress(OSError, ValueError):
                    out.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
                    out.flush()


def _signal_all(procs: list[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
    for p in procs:
        if p.poll() is None:  # alive, so its pid (= its process group) is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)


def run_on_lab(spec: LabSpec | str, command: list[str], *, service: str | None = None,
               grace: float = GRACE_S, stdout: IO[bytes] | None = None,
               stderr: IO[bytes] | None = None,
               log: Callable[[str], None] | None = None) -> RunResult:
    """Run ``command`` once per process of the lab ``spec``; every namespace is gone on return.

    Raises :class:`LabError` when it cannot start (bad target, no command, command not found,
    no root for namespaces); anything after that is in the result."""
    spec = LabSpec.parse(spec) if isinstance(spec, str) else spec
    if not command:
        raise LabError("no command to run: autotuner lab run TARGET -- CMD [ARGS...]")
    out = stdout or sys.stdout.buffer
    errout = stderr or sys.stderr.buffer
    say = log or (lambda message: None)
    executable = _resolve(command[0], dict(os.environ))
    relay = _Relay(service) if service else None
    number = next(_LAB_NUMBER)
    base, short = f"otl{os.getpid()}-{number}", f"otl{os.getpid() % 10000}"

    stop: list[int] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # e.g. SIGHUP under nohup stays ignored
                previous[sig] = signal.signal(sig, lambda signum, frame: stop.append(signum))

    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    net: Net | None = None
    try:
        net = Net.create(spec, base, short)
        if stop:
            return RunResult(128 + stop[0], f"interrupted by {signal.Signals(stop[0]).name} "
                                            "before the processes started")
        port = COORDINATOR_PORT if net.namespaces else _free_port()
        coordinator = f"{net.addresses[0]}:{port}"
        cpus = sorted(os.sched_getaffinity(0))
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        lock = threading.Lock()
        urls: dict[int, str] = {}
        for i in range(spec.n):
            where = i if spec.topology == "ring" else 0
            env = lab_env(spec, i, coordinator)
            if relay is not None:
                if where not in urls:
                    urls[where] = relay.open(net.exec_prefix(where)) if net.namespaces else relay.url
                env["AUTOTUNER_SERVICE_URL"] = urls[where]
            p = subprocess.Popen(
                [*net.exec_prefix(where), executable, *command[1:]], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
                preexec_fn=functools.partial(
                    _child_setup, prctl, cpus[i % len(cpus)] if spec.pin else None))
            procs.append(p)
            for pipe, sink in ((p.stdout, out), (p.stderr, errout)):
                assert pipe is not None
                t = threading.Thread(target=_pump, args=(pipe, sink, f"[p{i}] ".encode(), lock),
                                     daemon=True)
                t.start()
                pumps.append(t)
        say(f"lab run: {spec.n} process(es) on {spec.label}, coordinator {coordinator}")
        return _supervise(procs, stop, grace)
    finally:
        _signal_all(procs, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        if net is not None:
            net.destroy()  # also kills whatever the commands left running in the namespaces
        if relay is not None:
            relay.close()
        for t in pumps:  # a child's child may hold a pipe open: don't wait for it forever
            t.join(2)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(procs: list[subprocess.Popen[bytes]], stop: list[int], grace: float) -> RunResult:
    """Wait for every process; stop the rest when one fails or the runner is signalled."""
    failed: tuple[int, int] | None = None
    term_at: float | None = None
    killed = False
    while True:
        codes = [p.poll() for p in procs]
        if all(rc is not None for rc in codes):
            break
        if failed is None and not stop:
            failed = next(((i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)), None)
        if (failed or stop) and term_at is None:
            term_at = time.monotonic()
            _signal_all(procs, signal.SIGTERM)
        if term_at is not None and not killed and (
                time.monotonic() - term_at > grace or len(stop) > 1):  # a second Ctrl-C: now
            killed = True
            _signal_all(procs, signal.SIGKILL)
        time.sleep(0.05)
    others = len(procs) - 1
    if stop and failed is None:
        name = signal.Signals(stop[0]).name
        return RunResult(128 + stop[0], f"interrupted by {name}; stopped all {len(procs)} "
                                        "process(es) and removed the lab")
    if failed is None:
        failed = next(((i, rc) for i, rc in enumerate(codes) if rc != 0), None)
    if failed is None:
        return RunResult(0)
    i, rc = failed
    code = rc if rc > 0 else 128 + -rc
    stopped = f"; stopped the other {others}" if others else ""
    return RunResult(code, f"process {i} (pid {procs[i].pid}) {_describe(rc)}{stopped}")
