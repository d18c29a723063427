"""`autotuner lab run TARGET -- CMD`: a user's multi-host JAX script runs unchanged, one process
per lab host, inside the lab's namespaces; a failure stops the rest; nothing is left behind."""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotuner.lab.spec import owner_exited
from autotuner.testing import netns_reason

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[3]


needs_netns = pytest.mark.skipif(bool(netns_reason()), reason=netns_reason() or "-")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _left_behind(before: set[str]) -> set[str]:
    """The lab namespaces made since `before` whose owner has exited: what a finished lab left
    (another test's lab, running beside this one under pytest-xdist, is alive)."""
    return {ns for ns in _namespaces() - before if owner_exited(ns)}


def lab_run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "AUTOTUNER_"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "autotuner.cli", "lab", "run", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


# What a user writes for N hosts; nothing in it knows about the lab.
SCRIPT = """if True:
    import os, urllib.request
    import jax, numpy as np
    from jax.experimental import multihost_utils
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                               int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"]))
    me = jax.process_index()
    got = multihost_utils.process_allgather(np.array([10 * me + 1])).ravel().tolist()
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    total = jax.jit(lambda a: a.sum(), out_shardings=jax.NamedSharding(mesh, jax.P()))(
        multihost_utils.host_local_array_to_global_array(np.array([me + 1.0]), mesh, jax.P("x")))
    service = urllib.request.urlopen(os.environ["AUTOTUNER_SERVICE_URL"] + "/ping", timeout=10).read()
    print(f"id={me} n={jax.process_count()} devices={jax.device_count()} gathered={got} "
          f"sum={float(total)} netns={os.stat('/proc/self/ns/net').st_ino} "
          f"service={service.decode()}", flush=True)
"""


class _Ping(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = f"pong{self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@needs_netns
@pytest.mark.timeout(180)
def test_a_multihost_jax_script_runs_unchanged_on_the_lab() -> None:
    """Two processes in the shaped namespace join one job and run real cross-process collectives;
    a service that listens only on the host's 127.0.0.1 is reachable from inside the lab."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ping)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    before = _namespaces()
    try:
        r = lab_run(["--service", f"http://127.0.0.1:{server.server_address[1]}",
                     "lab:shared:2:2gbit", "--", sys.executable, "-c", SCRIPT])
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {ln[:5]: ln for ln in r.stdout.splitlines() if " id=" in ln}
    assert set(lines) == {"[p0] ", "[p1] "}, r.stdout
    host = os.stat("/proc/self/ns/net").st_ino
    netns = set()
    for i in range(2):
        m = re.fullmatch(rf"\[p{i}\] id={i} n=2 devices=2 gathered=\[1, 11\] sum=3\.0 "
                         r"netns=(\d+) service=pong/ping", lines[f"[p{i}] "])
        assert m, lines[f"[p{i}] "]
        netns.add(int(m.group(1)))
    assert len(netns) == 1 and host not in netns  # both in the lab's one (shared) namespace
    assert all(ln.startswith(("[p0] ", "[p1] ")) for ln in r.stderr.splitlines() if ln.strip()), r.stderr
    assert not _left_behind(before)


FAIL = """if True:
    import os, signal, sys, time
    if os.environ["JAX_PROCESS_ID"] == "1":
        time.sleep(0.5)
        print("giving up", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *a: print("ignoring SIGTERM", flush=True))
    print("sleeping", flush=True)
    time.sleep(600)
"""


@needs_netns
@pytest.mark.timeout(120)
def test_a_failing_process_stops_the_others_and_the_lab() -> None:
    """Process 1 exits 3; process 0 ignores SIGTERM, so it is killed after the grace period."""
    before = _namespaces()
    t0 = time.monotonic()
    r = lab_run(["--grace", "2", "lab:ring:2:1gbit", "--", sys.executable, "-c", FAIL], timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 3, r.stdout + r.stderr
    assert "[p0] sleeping" in r.stdout and "[p1] giving up" in r.stdout
    assert "[p0] ignoring SIGTERM" in r.stdout  # it got SIGTERM first ...
    assert took < 30  # ... then SIGKILL, not its 600 s sleep
    assert re.search(r"process 1 \(pid \d+\) exited with code 3; stopped the other 1", r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    assert not _left_behind(before)


@pytest.mark.timeout(120)
def test_usage_errors_are_one_line_and_the_smoke_command_still_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from autotuner.cli import app

    runner = CliRunner()
    with monkeypatch.context() as m:
        m.setattr(os, "geteuid", lambda: 1000)
        r = runner.invoke(app, ["lab", "run", "lab:shared:2", "--", "true"])
    assert r.exit_code == 2 and "needs root" in r.output and "lab:none:2" in r.output, r.output
    for args, needle in [(["lab:mesh:2", "--", "true"], "topology must be one of"),
                         (["lab:none:2"], "no command to run"),
                         (["lab:none:2", "--", "no-such-command-here"], "command not found"),
                         (["lab:none:2", "--service", "nonsense", "--", "true"], "--service must be")]:
        r = runner.invoke(app, ["lab", "run", *args])
        assert r.exit_code == 2, (args, r.output)
        assert needle in r.output and "Traceback" not in r.output, r.output
    r = runner.invoke(app, ["lab", "--target", "lab:none:2"])  # no subcommand: the smoke
    assert r.exit_code == 0, r.output
    assert '"label": "lab-none"' in r.output and '"ok": true' in r.output
