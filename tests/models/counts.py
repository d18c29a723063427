"""What an extraction found, in the terms the real-model tests count by hand."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .meshes import SEQ


def skip_kind(why: str) -> str:
    """A short name for the reason a pair was skipped (the reason itself when it is not a known one)."""
    if "all-reduce result is used whole" in why:
        return "all-reduce used whole"
    if "is sharded over data in both operands" in why:
        return "contracting batch sharded over data"
    if "is sharded over model in both operands" in why:
        return "contracting dimension sharded over model"
    return why


def summary(report: Any) -> dict[str, Any]:
    """pairs seen in the partitioned HLO, pairs mapped to Problems (occurrences), distinct Problems,
    occurrences per pattern, skipped pairs per reason."""
    return {
        "pairs": report.pairs,
        "occurrences": sum(c for _, c in report.problems),
        "distinct": len(report.problems),
        "patterns": dict(sorted(_by_label(report).items())),
        "skipped": dict(sorted(Counter(skip_kind(w) for _, w in report.skipped).items())),
    }


def _by_label(report: Any) -> Counter[str]:
    out: Counter[str] = Counter()
    for p, c in report.problems:
        out[p.pattern.label] += c
    return out


def sequence_collectives(report: Any) -> list[str]:
    """Problems whose collective is not over `model` along a sequence-sized dimension (should be none
    with sequence parallelism: every gather and scatter moves the sequence)."""
    bad = []
    for p, _ in report.problems:
        pat = p.pattern
        sizes = p.members[0].sizes if hasattr(p, "members") else p.sizes   # a grouped gather: its first dot
        if pat.axis != "model" or sizes[pat.letter] != SEQ:
            bad.append(f"{p.describe()}: {pat.label} of {pat.letter!r} over {pat.axis}")
    return bad


def problem_dims(report: Any) -> set[int]:
    """Every dimension size of the report's problems (a grouped problem's members' too)."""
    members = [m for p, _ in report.problems for m in getattr(p, "members", (p,))]
    return {d for m in members for d in m.lhs.shape + m.rhs.shape}
