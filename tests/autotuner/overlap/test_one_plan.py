"""One plan on every rank (issue 39): a real 2-process job (jax.distributed on loopback, gloo, one
CPU device each) whose processes see different things ends with both running the same program
(their digests equal) or both plain jit, within the test's bound, and with plain jit's result.

- `client0`: only process 0 has a client (an offline snapshot with a confident ring winner and
  in-program evidence for the step, as `tune-model` stores it); before the plan was agreed,
  process 0 took the evidence and process 1 waited for a per-problem decision process 0 never
  published (the job hung).
- `dead1`: process 1's client is a service that does not answer (a closed port).
- `fail1`: process 1's analysis raises: it runs plain jit, and so must process 0.
- `tunefail1`: in-job tuning (`tune="missing"`), and process 1's measurement raises: process 0,
  waiting for it, gives up within the budget; both end in-job tuning, naming process 1's error.
- `trunc1`: JAX's persistent cache on, each process its own; the texts the pass keeps beside it
  are written by a first preparation, then process 1's are cut in half (a crash mid-write, a
  full disk): it reads them as a miss and analyses again, and the job still runs one plan.
- `store0`: in-job tuning, and process 0 raises storing the answer it measured (its client's
  upload): the others, which waited up to an hour for that answer, hear of it and end tuning too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.testing import free_port
from tests.autotuner import two_processes

WORKER = """
    import time
    mode, tmp, BUDGET = sys.argv[3], sys.argv[4], 20.0
    from autotuner import Device, Strategy
    from autotuner.overlap import overlap
    from autotuner.runtime.client import Client

    def f(x, y):
        x = jax.reshard(x, NamedSharding(mesh, P(None, None)))
        return jnp.einsum("ij,jk->ik", x, y, out_sharding=NamedSharding(mesh, P(None, None)))

    client, tune = None, {}
    base = overlap(f, strategy="baseline").plan(a, b)   # every process prepares the same programs
    key, dkey = base[0].key, Device.current().key
    if mode in ("tunefail1", "store0"):   # in-job tuning: process 0's client knows nothing yet
        from autotuner.overlap import injob
        injob.REPS, injob.MAX_CANDIDATES = 3, 2
        tune = {"tune": "missing", "tune_budget_s": BUDGET}
        if pid == 0:
            path = f"{tmp}/snapshot.json"
            with open(path, "w") as fh:
                json.dump({"format": "autotuner-snapshot", "version": 1, "entries": []}, fh)
            client = Client(offline=path, device=Device.current())
            if mode == "store0":
                def refuse(*a, **k):
                    raise OSError("injected: process 0 cannot store the answer")
                client.upload = refuse
        elif mode == "tunefail1":
            from autotuner.measure.local import LocalRunner
            def broken(self, problem):
                raise RuntimeError("injected: process 1's measurement fails")
            LocalRunner.begin = broken
    elif pid == 0:   # a snapshot naming a confident ring winner for the pair, and step evidence for it
        ring = Strategy("ring", "uni", 1, "full", "loop", True)
        doc = {"format": "autotuner-snapshot", "version": 1, "entries": [
            {"problem_key": key, "device_key": dkey, "strategy": ring.to_dict(), "speedup": 1.3,
             "confidence": [1.2, 1.4], "record_id": 1, "measured_at": None, "trials": 10}],
            "evidence": [{"device_key": dkey, "program_key": base.program, "problem_key": key,
                          "strategy": ring.to_dict(), "previous": {"method": "baseline"}, "speedup": 1.2,
                          "confidence": [1.1, 1.3]}]}
        path = f"{tmp}/snapshot.json"
        with open(path, "w") as fh:
            json.dump(doc, fh)
        client = Client(offline=path)
    elif mode == "dead1":
        client = Client(sys.argv[5], timeout=2.0)
    elif mode == "fail1":
        import autotuner.hlo.compile as hc
        def broken(*a, **k):
            raise RuntimeError("injected: this rank's analysis fails")
        hc.partitioned_texts = broken
    truncated = 0
    if mode == "trunc1":
        import glob, os
        jax.config.update("jax_compilation_cache_dir", f"{tmp}/cache{pid}")
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        overlap(f, memory=None, client=client).plan(a, b)   # keeps its texts beside the cache
        kept = glob.glob(f"{tmp}/cache{pid}/autotuner-partitioned/*")
        assert kept, "nothing kept"
        for path in kept if pid == 1 else []:
            with open(path, "r+b") as fh:
                fh.truncate(os.path.getsize(path) // 2)
            truncated += 1
    t0 = time.perf_counter()
    ov = overlap(f, memory=None, client=client, **tune)
    plan = ov.plan(a, b)
    seconds = time.perf_counter() - t0
    result = np.asarray(ov(a, b).addressable_shards[0].data)
    with open(f"{tmp}/out{pid}.json", "w") as fh:
        json.dump({"rows": [[r.strategy.key, r.applied, r.source] for r in plan], "notes": plan.notes, "why": [r.note for r in plan],
                   "error": float(np.abs(result - A @ B).max()), "seconds": seconds, "truncated": truncated}, fh)
    jax.distributed.shutdown()
"""


def _job(tmp_path: Path, mode: str) -> tuple[dict, dict]:   # type: ignore[type-arg]
    dead = f"http://127.0.0.1:{free_port()}"
    two_processes.run(tmp_path, WORKER, lambda pid: [mode, str(tmp_path), dead], timeout=240)   # a hang fails here
    r0, r1 = (json.loads((tmp_path / f"out{pid}.json").read_text()) for pid in (0, 1))
    assert r0["error"] < 1e-5 and r1["error"] < 1e-5, (r0, r1)   # plain jit's result
    return r0, r1


def _digest(r: dict) -> str | None:   # type: ignore[type-arg]
    return next((n.split("digest ")[1].rstrip(")") for n in r["notes"] if "run one plan (digest" in n), None)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["client0", "dead1", "trunc1"])
def test_process_0s_plan_runs_on_every_process(tmp_path: Path, mode: str) -> None:
    r0, r1 = _job(tmp_path, mode)
    assert r1["truncated"] > 0 if mode == "trunc1" else r1["truncated"] == 0
    assert r0["rows"] == [["ring-uni-c1-ufull-loop-send", True, "in-program"]], r0
    assert [r[:2] for r in r1["rows"]] == [r[:2] for r in r0["rows"]], (r0, r1)
    assert _digest(r0) is not None and _digest(r0) == _digest(r1), (r0["notes"], r1["notes"])


@pytest.mark.slow
def test_one_rank_failing_sends_every_rank_to_plain_jit(tmp_path: Path) -> None:
    r0, r1 = _job(tmp_path, "fail1")
    assert not any(applied for _k, applied, _s in r0["rows"] + r1["rows"]), (r0, r1)
    assert any("do not run one plan" in n and "process 1 runs plain" in n for n in r0["notes"]), r0["notes"]


BUDGET_S = 20.0   # the workers' tune_budget_s: no process waits for another longer than this


@pytest.mark.slow
@pytest.mark.parametrize("mode,cause", [("tunefail1", "on process 1: the measurement failed (RuntimeError: injected"),
                                        ("store0", "process 0 could not store the answer (OSError: injected")])
def test_a_failure_in_in_job_tuning_ends_it_on_every_process(tmp_path: Path, mode: str, cause: str) -> None:
    """One process fails while tuning in the job: every process ends in-job tuning within the
    budget, saying which process failed and why, and runs one plan (equal digests) with plain jit's
    result; before, process 0 waited at a device barrier for a process that never came (a hang),
    or the others waited an hour for the answer process 0 never published."""
    r0, r1 = _job(tmp_path, mode)
    for r in (r0, r1):
        assert any(cause in w for w in r["why"]), r["why"]
        assert not any(s == "in-job" for _k, _a, s in r["rows"]), r["rows"]
        assert r["seconds"] < 3 * BUDGET_S + 60, r["seconds"]   # waits bounded by the budget
    assert _digest(r0) is not None and _digest(r0) == _digest(r1), (r0["notes"], r1["notes"])
