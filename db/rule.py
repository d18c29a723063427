"""The winner rule: which measured strategy a (device, problem) should use. Pure; no I/O.

Rule (:func:`choose_winner`):

1. Per ``strategy_key`` only the latest measurement counts (latest ``created_at``, then
   highest ``id``): a strategy whose latest attempt failed is out, even if it once ran.
2. The baseline (``strategy["method"] == "baseline"``) is the default winner.
3. A decomposed strategy beats it only if the lower bound of its speedup confidence interval
   (``ratio_lo``, ratio = baseline time / its time) is above 1.0: noise never wins.
4. Among those, the highest median speedup (``ratio``) wins (ties: higher ``ratio_lo``, then
   the earlier measurement).
5. No winner (``None``) if nothing qualifies and the baseline has no successful latest
   measurement: there is no evidence to serve.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from db.records import MeasurementRecord, WinnerChoice

__all__ = ["BASELINE", "MIN_SPEEDUP_LO", "choose_winner", "is_baseline"]

BASELINE = "baseline"
MIN_SPEEDUP_LO = 1.0


def is_baseline(m: MeasurementRecord) -> bool:
    return m.method == BASELINE


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _latest_key(m: MeasurementRecord) -> tuple[object, int]:
    return (m.created_at, m.id)


def choose_winner(measurements: Iterable[MeasurementRecord]) -> WinnerChoice | None:
    """Apply the rule above to every measurement of one (device, problem)."""
    all_ms = list(measurements)
    latest: dict[str, MeasurementRecord] = {}
    for m in sorted(all_ms, key=_latest_key):
        latest[m.strategy_key] = m
    evidence = tuple(sorted(m.id for m in latest.values()))
    ok = [m for m in latest.values() if m.status == "ok"]

    baselines = [m for m in ok if is_baseline(m)]
    baseline = max(baselines, key=_latest_key) if baselines else None
    baseline_s = baseline.median_s if baseline is not None else None

    candidates = [
        m
        for m in ok
        if not is_baseline(m)
        and _finite(m.ratio)
        and _finite(m.ratio_lo)
        and m.ratio_lo is not None
        and m.ratio_lo > MIN_SPEEDUP_LO
    ]
    if candidates:
        best = max(candidates, key=lambda m: (m.ratio, m.ratio_lo, -m.id))
        assert best.ratio is not None
        return _choice(best, best.ratio, best.ratio_lo, best.ratio_hi, baseline_s, evidence,
                       len(all_ms))
    if baseline is None:
        return None
    return _choice(baseline, 1.0, None, None, baseline_s, evidence, len(all_ms))


def _choice(m: MeasurementRecord, speedup: float, lo: float | None, hi: float | None,
            baseline_s: float | None, evidence: tuple[int, ...], trials: int) -> WinnerChoice:
    return WinnerChoice(strategy=dict(m.strategy), strategy_key=m.strategy_key, method=m.method,
                        speedup=speedup, speedup_lo=lo, speedup_hi=hi, baseline_s=baseline_s,
                        winner_s=m.median_s, measurement_id=m.id, measurement_ids=evidence,
                        trials=trials)
