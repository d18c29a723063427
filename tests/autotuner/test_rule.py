"""The one winner rule (`autotuner.rule`), as the database, the service and in-job answers use it."""

from __future__ import annotations

from autotuner.rule import MIN_SPEEDUP_LO, Evidence, choose, reference_method


def ev(method: str, ratio: float | None, lo: float | None = None, hi: float | None = None) -> Evidence:
    return Evidence(method, ratio, lo if lo is not None else ratio, hi if hi is not None else ratio)


def test_the_reference_is_plain_on_tpu_and_the_baseline_elsewhere():
    assert reference_method("tpu") == "plain"
    assert [reference_method(p) for p in ("cpu", "gpu", None)] == ["baseline"] * 3
    assert MIN_SPEEDUP_LO == 1.0


def test_noise_never_wins_and_the_best_ratio_does():
    assert choose([ev("baseline", 1.0), ev("ring", 1.3, 0.95, 1.6)], "baseline") is None
    got = choose([ev("baseline", 1.0), ev("ring", 1.2, 1.05), ev("ring", 1.4, 1.01), ev("ring", 1.4, 1.1)], "baseline")
    assert got == 3                                   # the highest ratio, its lower end breaking the tie
    assert choose([ev("ring", 1.4, 1.1), ev("ring", 1.4, 1.1)], "baseline") == 0   # then the earlier


def test_a_winner_clears_plain_where_plain_was_measured_beside_the_baseline():
    # plain measured 1.2x the baseline: a ring whose interval starts at 1.1 does not beat it
    assert choose([ev("plain", 1.2, 0.9, 1.5), ev("ring", 1.3, 1.1)], "baseline") is None
    assert choose([ev("plain", 1.2, 0.9, 1.5), ev("ring", 1.3, 1.21)], "baseline") == 1
    # plain itself may win over the baseline (leave the pair to the compiler), by the reference's floor
    assert choose([ev("plain", 1.2, 1.05), ev("ring", 1.15, 1.1)], "baseline") == 0


def test_on_tpu_plain_is_the_reference_and_estimates_win_when_faster_at_all():
    assert choose([ev("plain", 1.0), ev("baseline", 1.5), ev("ring", 1.2)], "plain") == 1   # the hand gather wins
    assert choose([ev("plain", 1.0), ev("ring", 0.97), ev("baseline", 0.99)], "plain") is None
    # a failed ratio (None, nan) is never a winner
    assert choose([ev("ring", None), ev("ring", float("nan"), 1.2)], "plain") is None


def test_the_threshold_and_the_rule_are_defined_once():
    """Only autotuner/rule.py defines the threshold or compares a lower end with a literal 1.0; the
    database's rule and the in-job answer call `choose` (db.apply_rule no longer exports a threshold)."""
    import re
    from pathlib import Path

    import db.apply_rule

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for pkg in ("autotuner", "db", "service"):
        for path in (root / pkg).rglob("*.py"):
            text = path.read_text()
            if path.name == "rule.py" and pkg == "autotuner":
                continue
            if re.search(r"MIN_SPEEDUP_LO\s*=|(lo|ratio_lo|\[0\])\s*>\s*1\.0\b", text):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
    assert not hasattr(db.apply_rule, "MIN_SPEEDUP_LO")
    assert "choose(" in Path(db.apply_rule.__file__).read_text()
    assert "choose(" in (root / "autotuner" / "runtime" / "answers.py").read_text()


def test_a_serial_control_never_wins_and_its_strategy_round_trips():
    """`serial` (a ring decomposed but not overlapped) is measured beside the ring to split its
    speedup; it is never a winner, however fast, and it names its ring."""
    from autotuner.strategy import Strategy

    assert choose([Evidence("baseline", 1.0, None, None), Evidence("serial", 1.6, 1.5, 1.7)], "baseline") is None
    assert choose([Evidence("serial", 1.6, 1.5, 1.7), Evidence("ring", 1.2, 1.1, 1.3)], "baseline") == 1
    ring = Strategy("ring", "bidi", 2, 1, "after", False)
    control = ring.serial()
    assert control.key == "serial-bidi-c2-u1-after-comp" and control.is_control and not control.rewrites
    assert Strategy.from_dict(control.to_dict()) == control and control.ring() == ring


def test_weaker_evidence_replaces_a_stronger_winner_only_with_an_interval_that_says_it_is_better():
    tuned = Evidence("ring", 1.3, 1.2, 1.4, label="tuned ring", source="tuned", n=15)
    in_job = Evidence("ring", 1.6, 1.1, 2.1, label="in-job ring", source="in-job", n=3)
    assert choose([tuned, in_job], "baseline") == 0          # faster on its point, not by its interval
    clear = in_job._replace(lo=1.45)                          # its lower end above the tuned one's upper
    assert choose([tuned, clear], "baseline") == 1
    # narrower evidence of the same source: under half the repetitions
    few = Evidence("ring", 1.5, 1.25, 1.8, source="tuned", n=5)
    assert choose([tuned, few], "baseline") == 0
    assert choose([tuned, few._replace(n=8)], "baseline") == 1
    # a stored measurement without a source counts as tuned; the strongest qualifying always wins
    assert choose([tuned._replace(source=None), in_job], "baseline") == 0
    assert choose([in_job], "baseline") == 0
    # weaker evidence that does not qualify at all does not block a stronger one
    assert choose([Evidence("ring", 0.9, 0.8, 1.0, source="in-job", n=3), tuned], "baseline") == 1
