"""`autotuner worker` against a real service (uvicorn on SQLite): it claims the jobs queued for
its device, tunes them on in-process CPU devices and uploads; stopped by SIGTERM (what
`docker stop` and a pod's deletion send) it hands the job it holds back to the queue at once
instead of leaving it running until the lease expires."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jax
import jaxlib
import pytest
from typer.testing import CliRunner

from autotuner import Device, Problem
from autotuner.cli import app
from service.testing import WRITE_HEADERS, WRITE_TOKEN, live_server, measurements, problem

# what `Device.current(topology="inproc")` gives in the worker's process of 2 CPU devices
DEVICE = Device(platform="cpu", device_kind="cpu", num_devices=2, num_processes=1, topology="inproc",
                jax_version=jax.__version__, jaxlib_version=jaxlib.__version__).to_dict()


def _wait(what: str, cond, proc: subprocess.Popen[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the worker exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.1)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """AUTOTUNER_CACHE_DIR (the scratch databases and the outboxes) in tmp_path, for this process and
    the workers it starts."""
    from autotuner.settings import get_settings

    monkeypatch.setenv("AUTOTUNER_CACHE_DIR", str(tmp_path / "cache"))
    get_settings.cache_clear()
    yield tmp_path / "cache"
    get_settings.cache_clear()


@pytest.mark.slow
def test_worker_tunes_a_job_hands_the_next_back_on_sigterm_and_fails_one_past_its_time(sqlite_template, tmp_path, cache_dir):
    from autotuner.tune import service_worker

    shutil.copyfile(sqlite_template, tmp_path / "service.db")
    with live_server(f"sqlite:///{tmp_path / 'service.db'}", env={"AUTOTUNER_WRITE_TOKENS": WRITE_TOKEN}) as url, \
            httpx.Client(base_url=url, headers=WRITE_HEADERS, trust_env=False, timeout=10) as h:
        def enqueue(p: dict, params: dict, priority: int) -> int:
            r = h.post("/v1/jobs", json={"device": DEVICE, "problem": p, "params": params, "priority": priority})
            assert r.status_code == 201, r.text
            return int(r.json()["id"])

        small = enqueue(problem(256, 128, 64, x=2), {"trials": 2, "reps": 3}, priority=1)
        # long enough that SIGTERM finds it being tuned (thousands of timed repetitions)
        large = enqueue(problem(1024, 512, 256, x=2), {"trials": 40, "reps": 500}, priority=0)
        # an earlier worker's upload that the service never got (it was down): sent before any claim
        left = problem(512, 128, 64, x=2)
        service_worker.keep(service_worker.outbox(url), "earlier-run",
                            {"device": DEVICE, "problem": left, "measurements": [
                                dict(m, run_id="earlier") for m in measurements()]})
        env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
        env.update(AUTOTUNER_WORKER_TOKEN=WRITE_TOKEN, JAX_PLATFORMS="cpu")   # the cache: cache_dir's
        proc = subprocess.Popen([sys.executable, "-m", "autotuner.cli", "worker", "--service", url,
                                 "--target", "inproc:2", "--once", "--lease", "3600"],
                                env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            job = lambda i: h.get(f"/v1/jobs/{i}").json()  # noqa: E731
            _wait("the large job claimed", lambda: job(large)["status"] == "running", proc)
            assert job(small)["status"] == "done"
            time.sleep(1.0)   # into its tuning
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 128 + signal.SIGTERM, out
        assert out.index("uploaded 2 measurement(s) an earlier run kept (earlier-run.json; 0 the service had)") \
            < out.index(f"job {small}: uploaded"), out
        assert not list(service_worker.outbox(url).iterdir())
        assert f"stopped by SIGTERM after 1 job(s); job {large}: handed back to the queue" in out, out
        assert "Traceback" not in out, out
        back = job(large)
        # queued now, not in an hour (the lease it was claimed under), and the claim not counted
        assert (back["status"], back["worker"], back["lease_expires_at"], back["attempts"]) == \
            ("queued", None, None, 0)
        # the first job's measurements reached the service: its problem has a stored winner
        for p in (problem(256, 128, 64, x=2), left):
            tuned = h.post("/v1/lookup", json={"device": DEVICE, "problem": p}).json()
            assert tuned["source"] == "tuned", tuned

        # the next worker may spend 1 s on a job: the large one runs past that (as a measurement
        # that never returns would), so it is failed and the worker exits for its supervisor
        done = subprocess.run([sys.executable, "-m", "autotuner.cli", "worker", "--service", url, "--target",
                               "inproc:2", "--once", "--lease", "6", "--job-timeout", "1"], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        assert done.returncode == service_worker.JOB_TIMEOUT_EXIT, done.stdout
        error = ("no result after 1 s (the worker's --job-timeout): a measurement that does not return cannot be "
                 "stopped, so the worker failed the job and exited")
        assert f"job {large}: failed: {error}" in " ".join(done.stdout.split()), done.stdout
        assert (job(large)["status"], job(large)["error"]) == ("failed", error)



def test_a_request_waits_for_a_service_that_is_starting_and_gives_up_after_its_time(
        sqlite_template, tmp_path, caplog):
    import threading

    from autotuner.tune import service_worker
    from service.testing import free_port, start_server, stop_server

    shutil.copyfile(sqlite_template, tmp_path / "service.db")
    port = free_port()
    started: list[subprocess.Popen[bytes]] = []
    thread = threading.Thread(target=lambda: started.append(start_server(
        f"sqlite:///{tmp_path / 'service.db'}", port=port, env={"AUTOTUNER_WRITE_TOKENS": WRITE_TOKEN})[0]))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=WRITE_HEADERS, trust_env=False, timeout=10) as h:
        with pytest.raises(httpx.ConnectError):   # nobody listens, and 1.5 s allow one more try
            service_worker.call(h, "/v1/jobs/claim", {"worker": "w"}, "claiming a job", time.monotonic() + 1.5)
        assert len([r for r in caplog.records if "trying again in 1 s" in r.getMessage()]) == 1
        caplog.clear()
        thread.start()   # the server's process cannot listen yet when the first try comes
        try:
            got = service_worker.call(h, "/v1/jobs/claim", {"worker": "w"}, "claiming a job", time.monotonic() + 120)
            assert got == {"job": None, "abandoned": []}
            assert "Connection refused; trying again in 1 s" in caplog.text
        finally:
            thread.join()
            for proc in started:
                stop_server(proc)


@pytest.mark.slow
def test_a_lookup_that_missed_is_tuned_by_a_worker_from_demand(sqlite_template, tmp_path, cache_dir):
    """The loop the service exists for: a lookup misses (default answer), the miss is counted as
    demand, a worker with --from-demand queues it, tunes it on its devices and uploads, and the
    same lookup is answered tuned; the pair is queued from demand once."""
    from autotuner.measure.targets import Target, TargetSession
    from autotuner.tune import service_worker

    shutil.copyfile(sqlite_template, tmp_path / "service.db")
    with live_server(f"sqlite:///{tmp_path / 'service.db'}", env={"AUTOTUNER_WRITE_TOKENS": WRITE_TOKEN}) as url, \
            httpx.Client(base_url=url, trust_env=False, timeout=10) as h, \
            TargetSession(Target.parse("inproc:8")) as ts:   # this process's 8 CPU devices
        body = {"device": ts.device.to_dict(), "problem": problem(256, 128, 64)}
        assert h.post("/v1/lookup", json=body).json()["source"] == "default"
        deadline = time.monotonic() + 10   # the miss reaches the demand table within 0.5 s
        while not h.get("/v1/demand").json()["items"]:
            assert time.monotonic() < deadline, "the miss was not counted"
            time.sleep(0.1)
        said: list[str] = []
        assert service_worker.work(ts, url, WRITE_TOKEN, once=True, trials=2, reps=3, from_demand=5,
                                   say=said.append) == 1
        assert said[0] == "queued 1 job(s) for problems lookups missed on this device", said
        assert h.post("/v1/lookup", json=body).json()["source"] == "tuned"
        assert service_worker.work(ts, url, WRITE_TOKEN, once=True, from_demand=5, say=said.append) == 0
        assert [j["status"] for j in h.get("/v1/jobs").json()["items"]] == ["done"]

        # a job its worker died on (claimed, never finished, its lease ran out): with one claim
        # allowed, the next worker fails it and says so instead of claiming it (and dying) again
        dead = {"device": ts.device.to_dict(), "problem": problem(64, 64, 64)}
        job = h.post("/v1/jobs", json=dead, headers=WRITE_HEADERS).json()
        assert h.post("/v1/jobs/claim", json={"worker": "dead:1", "lease_seconds": 0.2}, headers=WRITE_HEADERS).json()["job"]
        time.sleep(0.3)
        said.clear()
        assert service_worker.work(ts, url, WRITE_TOKEN, once=True, max_attempts=1, say=said.append) == 0
        assert said == [f"job {job['id']}: failed: abandoned: its worker's lease ran out before it finished (the "
                        "worker died, was killed, e.g. for memory, or hung); once the cause is fixed, queue it again: "
                        f"POST /v1/jobs/{job['id']}/retry"]
        assert h.get(f"/v1/jobs/{job['id']}").json()["status"] == "failed"

        # a job cancelled while it is tuned: the worker's next heartbeat is refused, and it stops
        # after the batch it is measuring (uploading what it has) instead of tuning on for nothing
        from autotuner.decompose.space import space

        big = problem(512, 256, 128)
        rings = [s for s in space(Problem.from_dict(big), ts.device) if s.method == "ring"]
        job = h.post("/v1/jobs", json={"device": ts.device.to_dict(), "problem": big,
                                       "params": {"trials": len(rings), "reps": 20}}, headers=WRITE_HEADERS).json()
        said.clear()
        done: list[int] = []
        worker = threading.Thread(target=lambda: done.append(service_worker.work(
            ts, url, WRITE_TOKEN, once=True, lease_s=1.5, say=said.append)))
        worker.start()
        deadline = time.monotonic() + 60
        while h.get(f"/v1/jobs/{job['id']}").json()["status"] != "running":
            assert time.monotonic() < deadline and worker.is_alive(), said
            time.sleep(0.05)
        got = h.post(f"/v1/jobs/{job['id']}/cancel", json={"reason": "wrong mesh"}, headers=WRITE_HEADERS).json()
        assert (got["status"], got["error"], got["lease_expires_at"]) == ("failed", "cancelled: wrong mesh", None)
        worker.join(timeout=300)
        assert done == [0], said   # not finished by the worker: the job was no longer its own
        assert said[1].startswith(f"job {job['id']}: no longer this worker's (heartbeat: HTTP 409"), said
        # cancelled before the first batch ended (it stops there, uploading it) or began (nothing to upload)
        last = said[2:]
        assert len(last) == 1 and (last[0] == f"job {job['id']}: stopped before anything was measured"
                                   or int(last[0].split()[3]) < len(rings)), (said, len(rings))
        assert h.get(f"/v1/jobs/{job['id']}").json()["error"] == "cancelled: wrong mesh"

        # `autotuner tune --service` (the Kubernetes tune jobs): tunes into its scratch database and
        # uploads through the same outbox, empty after
        problems = tmp_path / "problems.json"
        problems.write_text(json.dumps([problem(128, 64, 64)]))
        r = CliRunner().invoke(app, ["tune", "--service", url, "--target", "inproc:8", "--problems", str(problems),
                                     "--trials", "2", "--reps", "3", "--precision", "0", "--json"],
                               env={"AUTOTUNER_SERVICE_TOKEN": WRITE_TOKEN})
        assert r.exit_code == 0, r.output
        row = json.loads(r.stdout)
        assert row["uploaded"] >= row["trials"] == 2, row   # the trials and the reference beside them
        tuned = h.post("/v1/lookup", json={"device": ts.device.to_dict(), "problem": problem(128, 64, 64)}).json()
        assert tuned["source"] == "tuned"
        assert not list(service_worker.outbox(url).iterdir())
