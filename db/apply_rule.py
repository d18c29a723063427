"""The winner rule applied to stored measurements: `autotuner.rule` decides (the one definition,
shared with the training job's in-job answers); this module reads the records for it. Pure.

Per ``strategy_key`` only the latest measurement of the strongest source that measured it counts
(latest ``created_at``, then highest ``id``; a tuning run's over a training job's in-job one): a
strategy whose latest such attempt failed is out, even if it once ran. The reference
(``baseline``, or ``plain`` on TPU: `autotuner.rule.reference_method`) is the default winner;
another strategy replaces it as `autotuner.rule.choose` says. A winner's ``baseline_s`` is the
reference's median in the winner's own session (``ratio * median_s``), so ``speedup`` is always
``baseline_s / winner_s``: a row never shows a speedup above 1 with the winner slower; its
``serial_s``/``traffic_speedup`` are the same measurement's (the split of that speedup). No winner (``None``) when nothing
qualifies and the reference has no successful latest measurement: there is no evidence to serve.
"""

from __future__ import annotations

from collections.abc import Iterable

from autotuner.rule import Evidence, choose, source_rank, unresolved
from db.records import MeasurementRecord, WinnerChoice

__all__ = ["BASELINE", "choose_winner", "is_baseline", "why_unresolved"]

BASELINE = "baseline"


def is_baseline(m: MeasurementRecord) -> bool:
    return m.method == BASELINE


def _latest_key(m: MeasurementRecord) -> tuple[object, int]:
    return (m.created_at, m.id)


def _latest_ok(all_ms: list[MeasurementRecord]) -> tuple[dict[str, MeasurementRecord], list[MeasurementRecord]]:
    """The latest measurement of each strategy from the strongest source that measured it
    (`autotuner.rule.MEASUREMENT_SOURCES`: an in-job run neither replaces nor fails a strategy a
    tuning run measured), and the successful ones among them by id."""
    latest: dict[str, MeasurementRecord] = {}
    for m in sorted(all_ms, key=_latest_key):
        held = latest.get(m.strategy_key)
        if held is None or source_rank(m.source) <= source_rank(held.source):
            latest[m.strategy_key] = m
    return latest, sorted((m for m in latest.values() if m.status == "ok"), key=lambda m: m.id)


def _evidence(ok: list[MeasurementRecord]) -> list[Evidence]:
    return [Evidence(m.method, m.ratio, m.ratio_lo, m.ratio_hi, m.aa_width, m.strategy_key, m.source, m.n)
            for m in ok]


def why_unresolved(measurements: Iterable[MeasurementRecord], reference: str = BASELINE) -> str | None:
    """Why the latest measurements of one (device, problem) do not decide (`autotuner.rule.unresolved`),
    None where they do."""
    return unresolved(_evidence(_latest_ok(list(measurements))[1]), reference)


def choose_winner(measurements: Iterable[MeasurementRecord], reference: str = BASELINE) -> WinnerChoice | None:
    """Apply the rule to every measurement of one (device, problem); `reference` is the device's
    reference method (`autotuner.rule.reference_method` of its platform)."""
    all_ms = list(measurements)
    latest, ok = _latest_ok(all_ms)
    evidence = tuple(sorted(m.id for m in latest.values()))
    refs = [m for m in ok if m.method == reference]
    ref = max(refs, key=_latest_key) if refs else None
    ref_s = ref.median_s if ref is not None else None
    won = choose(_evidence(ok), reference)
    if won is not None:
        best = ok[won]
        assert best.ratio is not None
        # the reference's time in the winner's own session (ratio = its median / the winner's, over
        # the same paired repetitions), not the latest reference record's, which may be another
        # session's: the row's speedup is then exactly baseline_s / winner_s
        paired_s = best.ratio * best.median_s if best.median_s is not None else ref_s
        return _choice(best, best.ratio, best.ratio_lo, best.ratio_hi, paired_s, evidence, len(all_ms))
    if ref is None:
        return None
    return _choice(ref, 1.0, None, None, ref_s, evidence, len(all_ms))


def _choice(m: MeasurementRecord, speedup: float, lo: float | None, hi: float | None,
            baseline_s: float | None, evidence: tuple[int, ...], trials: int) -> WinnerChoice:
    return WinnerChoice(strategy=dict(m.strategy), strategy_key=m.strategy_key, method=m.method,
                        speedup=speedup, speedup_lo=lo, speedup_hi=hi, baseline_s=baseline_s,
                        winner_s=m.median_s, measurement_id=m.id, measurement_ids=evidence,
                        trials=trials, serial_s=m.serial_s, traffic_speedup=m.traffic_speedup)
