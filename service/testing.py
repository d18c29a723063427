"""For tests and benchmarks: example request bodies, a real uvicorn server in a subprocess
(127.0.0.1 only), and :func:`coherence_probe_app`, the service with its polls of changed
winners driven by the caller."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent

# Tokens the tests configure (never use them anywhere else).
WRITE_TOKEN = "write-token-for-tests"
READ_TOKEN = "read-token-for-tests"
WRITE_HEADERS = {"Authorization": f"Bearer {WRITE_TOKEN}"}
READ_HEADERS = {"Authorization": f"Bearer {READ_TOKEN}"}

DEVICE: dict[str, Any] = {"platform": "cpu", "device_kind": "cpu", "num_devices": 8,
                          "num_processes": 1, "topology": "inproc", "jax_version": "0.10.2",
                          "jaxlib_version": "0.10.2"}
RING: dict[str, Any] = {"method": "ring", "direction": "uni", "chunks": 1, "unroll": "full",
                        "fuse": "loop", "send_first": True}


def problem(m: int = 2048, k: int = 1024, n: int = 512, *, dtype: str = "float32", x: int = 8,
            kind: str = "ag") -> dict[str, Any]:
    """An all-gather of lhs rows (``"ag"``) or a reduce-scatter of the output (``"rs"``), as
    Problem JSON."""
    if kind == "rs":
        return {"equation": "mk,kn->mn", "lhs": {"shape": [m, k], "spec": [None, "x"]},
                "rhs": {"shape": [k, n], "spec": ["x", None]}, "out_spec": ["x", None],
                "dtype": dtype, "mesh": {"x": x}}
    return {"equation": "mk,kn->mn", "lhs": {"shape": [m, k], "spec": ["x", None]},
            "rhs": {"shape": [k, n], "spec": [None, None]}, "out_spec": [None, None],
            "dtype": dtype, "mesh": {"x": x}}


def measurements(ratio: float = 1.25, strategy: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``POST /v1/results`` items: a baseline and a strategy ``ratio`` times faster (CI +-0.05)."""
    base = 1e-3
    return [
        {"strategy": {"method": "baseline"}, "status": "ok", "samples": [base] * 7,
         "median_s": base, "n": 7},
        {"strategy": strategy or RING, "status": "ok", "samples": [base / ratio] * 7,
         "median_s": base / ratio, "n": 7, "ratio": ratio, "ratio_lo": ratio - 0.05,
         "ratio_hi": ratio + 0.05},
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def start_server(db_url: str, *, port: int | None = None, workers: int = 1,
                 env: dict[str, str] | None = None, timeout: float = 60.0,
                 quiet: bool = True, app: str = "service.app:app",
                 factory: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``uvicorn service.app:app`` (or another ``app``; ``factory``: a function that
    returns the app) on 127.0.0.1 against ``db_url``; wait until ``/healthz`` answers 200.
    Returns the process and the base URL."""
    port = port or free_port()
    full_env = {**os.environ, "AUTOTUNER_DB_URL": db_url, "JAX_PLATFORMS": "cpu", **(env or {})}
    cmd = [sys.executable, "-m", "uvicorn", app, "--host", HOST, "--port", str(port),
           "--workers", str(workers), "--no-access-log", "--log-level", "warning",
           *(["--factory"] if factory else [])]
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(cmd, env=full_env, cwd=ROOT, start_new_session=True, stdout=out, stderr=out)
    url = f"http://{HOST}:{port}"
    wait_healthy(proc, url, timeout)
    return proc, url


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float = 60.0) -> None:
    """Wait until the server ``proc`` answers 200 at ``url/healthz``; if it exits first or
    ``timeout`` seconds pass, stop it and raise RuntimeError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"the server did not become healthy within {timeout:g} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (graceful: misses are flushed), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def live_server(db_url: str, **kwargs: object) -> Iterator[str]:
    """``with live_server(url) as base_url: ...``"""
    proc, url = start_server(db_url, **kwargs)  # type: ignore[arg-type]
    try:
        yield url
    finally:
        stop_server(proc)


def coherence_probe_app() -> Any:
    """The service (configured from the environment) whose watcher of changed winners
    (:mod:`service.coherence`) polls once at startup and then only when asked, plus two
    routes that show and drive it in the worker that serves the request:

    - ``GET /_test/coherence``: ``{"pid", "polls", "generation"}``;
    - ``POST /_test/coherence/poll``: one poll now; the same, plus ``"changes"`` (what
      :meth:`ChangeWatcher.poll` returned).

    ``start_server(url, app="service.testing:coherence_probe_app", factory=True)``; so a test
    counts the polls each uvicorn worker needs before it serves a new winner, instead of
    timing it (tests/service/test_coherence.py). Never for production."""
    from service.app import create_app

    app = create_app()
    watcher = app.state.autotuner.watcher
    watcher.start = watcher.poll  # the first poll (as start() does), and no background thread

    def info() -> dict[str, Any]:
        return {"pid": str(os.getpid()), "polls": watcher.polls, "generation": watcher.generation}

    def show() -> dict[str, Any]:
        return info()

    def poll() -> dict[str, Any]:
        changes = watcher.poll()
        return {**info(), "changes": changes}

    app.add_api_route("/_test/coherence", show, methods=["GET"], include_in_schema=False)
    app.add_api_route("/_test/coherence/poll", poll, methods=["POST"], include_in_schema=False)
    return app
