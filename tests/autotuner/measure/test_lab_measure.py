"""The harness on the lab: a session across processes, and a worker killed in the middle of one."""

from __future__ import annotations

import os
import signal
import time

import pytest

from autotuner import Problem, space
from autotuner.lab import LabSpec
from autotuner.measure import run_session
from autotuner.measure.lab_target import LabRunner, open_lab
from autotuner.testing import netns_reason

pytestmark = [pytest.mark.lab, pytest.mark.slow]

P2 = {"equation": "sd,df->sf", "lhs": {"shape": [256, 128], "spec": ["x", None]},
      "rhs": {"shape": [128, 128], "spec": [None, "x"]}, "out_spec": [None, "x"],
      "dtype": "float32", "mesh": {"x": 2}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", ["lab:none:2", "lab:shared:2:2gbit"])
def test_session_across_processes(target):
    if "shared" in target and netns_reason():
        pytest.skip(netns_reason())
    p = Problem.from_dict(P2)
    strategies = space(p)[:4]
    with open_lab(LabSpec.parse(target)) as lab:
        runner = LabRunner(lab)
        device = runner.device()
        assert device.num_processes == 2 and device.num_devices == 2
        assert device.topology == LabSpec.parse(target).label
        s = run_session(runner, p, strategies, reps=4)
    for c in [s.baseline, *s.candidates]:
        assert c.status == "ok", c.reason
        assert c.n == 4 and c.ratio is not None and c.compile_s > 0
    assert s.comm_s > 0 and s.comp_s > 0 and s.bound_s > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seen", [False, True], ids=["at-once", "once-seen"])
def test_killed_worker_fails_one_candidate_and_the_session_goes_on(seen):
    """A worker killed between two programs fails the next one timed, whether the call to time it
    meets the dying worker (`at-once`, most often) or the lab saw the death first and starts afresh
    for that call (`once-seen`: the kill waited for; the path a loaded machine takes): the lab is
    restarted with what had compiled, and the other candidates are timed to the end."""
    p = Problem.from_dict(P2)
    strategies = space(p)[:4]
    with open_lab(LabSpec.parse("lab:none:2")) as lab:
        runner = LabRunner(lab, time_timeout=60)

        def on_rep(r: int, _n: int) -> None:
            if r == 1:  # after the first repetition: the next program timed is candidate 1
                os.kill(lab.pids[1], signal.SIGKILL)
                while seen and lab.running:
                    time.sleep(0.01)

        s = run_session(runner, p, strategies, reps=4, on_rep=on_rep)
    failed = [c for c in s.candidates if c.status == "failed"]
    assert len(failed) == 1 and failed[0].key == strategies[1].key
    assert "while timing" in failed[0].reason and "process 1" in failed[0].reason
    assert s.baseline.status == "ok"
    for c in s.candidates:
        if c.status == "ok":
            assert c.n >= 3 and c.ratio is not None   # recompiled on the fresh lab, timing went on
