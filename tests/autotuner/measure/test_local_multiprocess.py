"""Multi-process `--target local`: the same `autotuner tune` once per lab host (under
`autotuner lab run`); process 0 searches and stores, process 1 measures in lockstep with it."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autotuner.testing import netns_reason

pytestmark = [pytest.mark.lab, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
PROBLEM = {"equation": "sd,df->sf", "lhs": {"shape": [256, 128], "spec": ["x", None]},
           "rhs": {"shape": [128, 128], "spec": [None, "x"]}, "out_spec": [None, "x"],
           "dtype": "float32", "mesh": {"x": 2}}




needs_netns = pytest.mark.skipif(bool(netns_reason()), reason=netns_reason() or "-")


def _command(tmp: Path, *extra: str) -> list[str]:
    problems = tmp / "p.json"
    problems.write_text(json.dumps([PROBLEM]))
    return [sys.executable, "-m", "autotuner.cli", "lab", "run", "lab:shared:2:2gbit", "--",
            sys.executable, "-m", "autotuner.cli", "tune", "--target", "local",
            "--problems", str(problems), "--db", f"sqlite:///{tmp / 't.db'}", "--json", *extra]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "AUTOTUNER_"))}
    env["PYTHONPATH"] = str(REPO)
    return env


def _rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


def _json_lines(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if ln.split("] ", 1)[-1].startswith("{")]


@needs_netns
@pytest.mark.timeout(300)
def test_tune_on_two_processes_stores_one_winner_from_process_0(tmp_path: Path) -> None:
    r = subprocess.run(_command(tmp_path, "--trials", "2", "--reps", "3"), env=_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _json_lines(r.stdout)
    assert len(lines) == 1 and lines[0].startswith("[p0] {"), r.stdout
    row = json.loads(lines[0][5:])
    assert row["error"] is None and row["winner"] is not None
    assert row["device"]["num_processes"] == 2 and row["device"]["num_devices"] == 2
    assert "tuned" in r.stderr and "[p1] " not in "".join(  # process 1 prints no table
        ln for ln in r.stderr.splitlines() if "tuned" in ln or "speedup" in ln)
    db = tmp_path / "t.db"
    devices = _rows(db, "select id, num_processes, num_devices from devices")
    assert [(n, d) for _i, n, d in devices] == [(2, 2)]
    assert len(_rows(db, "select * from winners")) == 1


def _pid_of_process_1(marker: str) -> int | None:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tune" in cmd and any(marker.encode() in a for a in cmd) and b"JAX_PROCESS_ID=1" in env:
            return int(d.name)
    return None


@needs_netns
@pytest.mark.timeout(400)
def test_a_killed_process_stops_the_run_and_a_rerun_completes(tmp_path: Path) -> None:
    """Process 1 is SIGKILLed while the problem's session is timing: the run stops non-zero with
    one line, nothing of that session is stored, and the same command then completes."""
    cmd = _command(tmp_path, "--trials", "2", "--reps", "400", "--precision", "0", "--no-aa")
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert p.stderr is not None
        for ln in p.stderr:
            err.append(ln)
            if "strategies" in ln:
                started.set()

    outs: list[str] = []

    def read_out() -> None:   # stdout on its own thread: the stderr reader owns that pipe
        assert p.stdout is not None
        outs.extend(p.stdout)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out_reader = threading.Thread(target=read_out, daemon=True)
    out_reader.start()
    assert started.wait(180), "".join(err)
    time.sleep(2.0)  # compiling, then timing
    pid = _pid_of_process_1(str(tmp_path))
    assert pid is not None
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    p.wait(timeout=90)
    took = time.monotonic() - t0
    reader.join(10)
    out_reader.join(10)
    for pipe in (p.stdout, p.stderr):
        if pipe is not None:
            pipe.close()
    out = "".join(outs)
    text = out + "".join(err)
    assert p.returncode != 0 and took < 60, text[-3000:]
    # process 0 says so itself (its collective with process 1 broke), or `lab run` does
    assert re.search(r"error: the multi-process run failed: .*processes \[1\] never finished; stopping "
                     r"the job|process 1 \(pid \d+\) was killed by SIGKILL; stopped the other 1", text), text[-3000:]
    assert not _json_lines(out), out
    db = tmp_path / "t.db"
    assert _rows(db, "select count(*) from measurements") == [(0,)]  # nothing of the session
    assert _rows(db, "select count(*) from winners") == [(0,)]

    r = subprocess.run(_command(tmp_path, "--trials", "2", "--reps", "3"), env=_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(_json_lines(r.stdout)) == 1
    assert len(_rows(db, "select * from winners")) == 1
