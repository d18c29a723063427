"""Measuring: where programs run (targets), the harness that compiles, checks and times them in
interleaved sessions (the only code that times anything), and the statistics of a session."""

from __future__ import annotations

from autotuner.measure.adaptive import Precision
from autotuner.measure.local import LocalRunner
from autotuner.measure.session import AA_KEY, Candidate, Runner, SessionResult, run_session
from autotuner.measure.stats import Summary, aa_ok, aa_width, bound, efficiency, halfwidth, ratio_ci

__all__ = ["AA_KEY", "Candidate", "LocalRunner", "Precision", "Runner", "SessionResult", "Summary",
           "aa_ok", "aa_width", "bound", "efficiency", "halfwidth", "ratio_ci", "run_session"]
