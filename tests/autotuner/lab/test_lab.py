"""The emulated mesh: real multi-process collectives over shaped links, and cleanup in every case."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import pytest

from autotuner.lab import Lab, LabError, LabSpec, LabWorkerError
from autotuner.testing import netns_reason

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[3]
ECHO = "autotuner.lab:echo_handler"


needs_netns = pytest.mark.skipif(bool(netns_reason()), reason=netns_reason() or "-")


def _worker_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state != "Z" and b"autotuner.lab" in cmdline


def _wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if _worker_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def assert_clean(prefix: str, pids: list[int]) -> None:
    """Nothing of the lab named `prefix` is left: namespaces, links, /etc/netns dirs, workers."""
    assert _wait_gone(pids) == [], "worker processes left behind"
    if os.geteuid() == 0 and shutil.which("ip"):
        assert _namespaces(prefix) == []
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert "otl" not in links, links
    etc = Path("/etc/netns")
    assert not etc.exists() or not [d for d in os.listdir(etc) if d.startswith(prefix)]


def check_echo(result: dict, spec: LabSpec) -> None:
    n = spec.n
    assert "error" not in result, result.get("error")
    assert result["ok"] is True
    assert result["psum"] == n * (n - 1) // 2 and result["all_gather"] == list(range(n))
    procs = result["processes"]
    assert [p["process_id"] for p in procs] == [p["process_index"] for p in procs] == list(range(n))
    assert len({p["pid"] for p in procs}) == n  # n separate OS processes
    for p in procs:
        assert p["psum"] == result["psum"] and p["all_gather"] == list(range(n))
        assert p["ppermute_ok"] is True


def test_spec_parse_and_label() -> None:
    assert LabSpec.parse("lab:shared:2:2gbit") == LabSpec("shared", 2, rate="2gbit")
    assert LabSpec.parse("lab:ring:4:1gbit").label == "lab-ring-1gbit"
    assert LabSpec.parse("lab:shared:2").label == "lab-shared-2gbit"
    assert LabSpec.parse("lab:none:2").label == "lab-none"
    for bad, needle in [("lab:mesh:2", "topology"), ("lab:ring:9", "1..8"), ("lab:ring:x", "number"),
                        ("ring:2", "expected lab:"), ("lab:ring:2:fast", "rate"),
                        ("lab:ring:2:1gbit:extra", "expected lab:")]:
        with pytest.raises(LabError, match=needle):
            LabSpec.parse(bad)
    with pytest.raises(LabError, match="module:function"):
        Lab(LabSpec("none", 1), "no_colon")


@needs_netns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["lab:shared:2:2gbit", "lab:shared:4:2gbit",
                                    "lab:ring:2:1gbit", "lab:ring:4:1gbit"])
def test_echo_over_shaped_links(target: str) -> None:
    spec = LabSpec.parse(target)
    with Lab(spec, ECHO) as lab:
        prefix, pids, namespaces = lab.name, lab.pids, lab.namespaces
        assert len(namespaces) == (spec.n if spec.topology == "ring" else 1)
        qdiscs = [subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show"],
                                 capture_output=True, text=True).stdout for ns in namespaces]
        routes = [subprocess.run(["ip", "-n", ns, "route", "show"], capture_output=True,
                                 text=True).stdout for ns in namespaces]
        result = lab.call({"mib": 4, "reps": 3}, timeout=60)
    check_echo(result, spec)
    shaped = 1 if spec.topology == "shared" or spec.n == 2 else 2  # lo, or one per neighbour
    assert [q.count("qdisc tbf") for q in qdiscs] == [shaped] * len(namespaces), qdiscs
    assert not any("default" in r for r in routes)  # nothing routes out of the lab
    addresses = [p["address"] for p in result["processes"]]
    if spec.topology == "ring":
        assert addresses == [f"10.213.0.{i + 1}" for i in range(spec.n)]
        assert all(r.count("via") == spec.n - 1 for r in routes)
    else:
        assert addresses == ["127.0.0.1"] * spec.n
    rate = float(spec.rate[:-4])  # "2gbit" -> 2.0
    assert 0 < result["ppermute"]["gbit_s"] < 1.5 * rate  # the link is shaped
    assert_clean(prefix, pids)


@needs_netns
@pytest.mark.timeout(120)
def test_worker_killed_mid_call_restarts_fresh() -> None:
    with Lab(LabSpec("shared", 2), ECHO) as lab:
        first = lab.pids
        killer = threading.Timer(1.5, os.kill, (first[1], signal.SIGKILL))
        killer.start()
        # process 0 sleeps an hour, far past the call's timeout: a call that waited for its
        # reply, or for the timeout, would fail "timed out after 60s"; only one that watches
        # its workers while it waits reports the death
        with pytest.raises(LabWorkerError, match=r"process 1 \(pid \d+\) was killed by SIGKILL"):
            lab.call({"sleep": 3600}, timeout=60)
        killer.join()
        assert lab.pids == [] and not lab.running
        assert_clean(lab.name, first)
        check_echo(lab.call({}, timeout=60), lab.spec)  # transparently a fresh lab
        assert set(lab.pids).isdisjoint(first)
        second = lab.pids
        os.kill(second[0], signal.SIGKILL)  # a death between calls takes the whole lab down too
        assert _wait_gone(second) == []
        deadline = time.monotonic() + 10
        while _namespaces(lab.name) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert_clean(lab.name, second)
        # a call that needs what earlier calls left in the workers is told, not served afresh
        with pytest.raises(LabWorkerError, match=r"process 0 \(pid \d+\) was killed by SIGKILL while idle; it started afresh"):
            lab.call({}, timeout=60, fresh=False)
        check_echo(lab.call({}, timeout=60, fresh=False), lab.spec)   # the lab it started for that call
        third = lab.pids
    assert_clean(lab.name, third)


@needs_netns
@pytest.mark.timeout(120)
def test_call_timeout_tears_down_then_recovers() -> None:
    with Lab(LabSpec("shared", 2), ECHO) as lab:
        first = lab.pids
        with pytest.raises(LabWorkerError, match="timed out after 2s"):
            lab.call({"sleep": 60}, timeout=2)
        assert_clean(lab.name, first)
        check_echo(lab.call({}, timeout=60), lab.spec)
        second = lab.pids
    assert_clean(lab.name, second)


@pytest.mark.timeout(120)
def test_handler_exception_is_an_error_reply() -> None:
    with Lab(LabSpec("none", 2), ECHO) as lab:
        pids = lab.pids
        reply = lab.call({"raise": "boom"}, timeout=60)
        assert "RuntimeError: boom" in reply["error"] and set(reply["errors"]) == {"0", "1"}
        check_echo(lab.call({}, timeout=60), lab.spec)
        assert lab.pids == pids  # the same lab went on
        # only process 1 fails: process 0 is left inside a collective, so the lab is restarted
        reply = lab.call({"raise": "half", "raise_on": [1]}, timeout=60)
        assert reply["error"].startswith("process 1: RuntimeError: half")
        assert "never finished" in reply["error"]
        check_echo(lab.call({}, timeout=60), lab.spec)
        assert set(lab.pids).isdisjoint(pids)


@pytest.mark.timeout(60)
def test_bad_handler_fails_start_with_the_traceback() -> None:
    lab = Lab(LabSpec("none", 2), "no_such_module_here:handler", start_timeout=30)
    with pytest.raises(LabWorkerError, match="(?s)exited with code 1.*ModuleNotFoundError"):
        lab.start()
    lab.close()
    lab.close()  # idempotent


def _unprivileged() -> list[str] | None:
    if os.geteuid() != 0:
        return []
    for user, group in (("nobody", "nogroup"), ("nobody", "nobody")):
        try:
            pwd.getpwnam(user)
            subprocess.run(["getent", "group", group], check=True, capture_output=True)
        except (KeyError, subprocess.CalledProcessError, FileNotFoundError):
            continue
        if shutil.which("setpriv"):
            return ["setpriv", f"--reuid={user}", f"--regid={group}", "--clear-groups"]
    return None


def _interpreter_for(prefix: list[str], env: dict[str, str]) -> str | None:
    """A Python that the unprivileged user can run *and re-execute* (the lab spawns workers with
    sys.executable). The venv's may point into /root (mode 700); a system Python of the same
    version with the venv's site-packages on PYTHONPATH does then."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    probe = ("import subprocess, sys; "
             "sys.exit(subprocess.run([sys.executable, '-c', 'import jax, autotuner.lab']).returncode)")
    for candidate in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if os.access(candidate, os.X_OK) and subprocess.run(
                [*prefix, candidate, "-c", probe], env=env, cwd="/tmp", capture_output=True,
                timeout=60).returncode == 0:
            return candidate
    return None


@pytest.mark.timeout(120)
def test_none_topology_as_unprivileged_user() -> None:
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("no unprivileged user (nobody) or no setpriv to switch to it")
    site = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{site}", "HOME": "/tmp"}
    python = _interpreter_for(prefix, env)
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} that {prefix or 'this user'} can execute")
    code = """if True:
        import json, os
        from autotuner.lab import Lab, LabError, LabSpec, run_lab_smoke
        out = run_lab_smoke("lab:none:2")
        try:
            Lab(LabSpec("shared", 2), "autotuner.lab:echo_handler").start()
        except LabError as e:
            out["shared_error"] = str(e)
        out["uid"] = os.getuid()
        print(json.dumps(out))
    """
    done = subprocess.run([*prefix, python, "-c", code], capture_output=True, text=True,
                          env=env, cwd="/tmp", timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["uid"] != 0
    check_echo(out["result"], LabSpec("none", 2))
    assert "needs root" in out["shared_error"] and "lab:none:2" in out["shared_error"]


CHILD = """if True:
    import json, time
    from autotuner.lab import Lab, LabSpec
    lab = Lab(LabSpec("shared", 2), "autotuner.lab:echo_handler")
    lab.start()
    print(json.dumps({"name": lab.name, "pids": lab.pids}), flush=True)
    time.sleep(300)
"""


def _child_with_lab() -> tuple[subprocess.Popen[str], dict]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, "the child lab did not start"
    return child, json.loads(line)


@needs_netns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_parent_signal_cleans_up(sig: signal.Signals) -> None:
    child, info = _child_with_lab()
    with child:
        assert _namespaces(info["name"])
        child.send_signal(sig)
        assert child.wait(30) != 0
    assert_clean(info["name"], info["pids"])


@needs_netns
@pytest.mark.timeout(120)
def test_leftovers_of_a_killed_parent_are_removed() -> None:
    child, info = _child_with_lab()
    with child:
        child.kill()
    assert _wait_gone(info["pids"]) == []  # PR_SET_PDEATHSIG took the workers down with it
    assert _namespaces(info["name"])  # a SIGKILLed parent cannot clean up ...
    with Lab(LabSpec("shared", 1), ECHO) as lab:  # ... the next lab does
        lab.start()
        assert _namespaces(info["name"]) == []
        assert not Path(f"/etc/netns/{info['name']}-0").exists()
        assert not list(Path(tempfile.gettempdir()).glob(f"{info['name']}-*"))  # its log dir
