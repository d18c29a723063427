"""Measuring: where programs run (targets), the harness that compiles, checks and times them in
interleaved sessions (the only code that times anything), and the statistics of a session."""

from __future__ import annotations

from autotuner.measure.local import LocalRunner
from autotuner.measure.session import Candidate, Runner, SessionResult, run_session
from autotuner.measure.stats import Summary, bound, efficiency, ratio_ci

__all__ = ["Candidate", "LocalRunner", "Runner", "SessionResult", "Summary", "bound", "efficiency",
           "ratio_ci", "run_session"]
