"""`Answer`: which strategy to use for one problem on one device, and the evidence behind it.

One type from the service to the plan: the service builds its lookup response from one
(``service.lookups``: the pydantic ``Lookup`` is only the wire schema), the client returns one
(``autotuner.runtime.client``), ``collective_einsum`` and the pass keep one per problem in their
decision table (``autotuner.runtime.collective``), and a `PlanRow` carries the one it was chosen
from. Its JSON (`Answer.to_json`, read back, checked, by `Answer.from_json`) is a lookup's and the
client's disk cache lines'; a snapshot entry carries the same fields in the same form
(:mod:`autotuner.snapshot`). Imports nothing but the Strategy, the measurement's split rule
and the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from autotuner.measurement import overlap_speedup
from autotuner.strategy import Strategy

__all__ = ["KEY_RE", "Answer", "time_json", "time_of"]

KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")  # a device or problem key: may name a cache file
# the types of an answer's optional fields (null or absent: unknown; confidence: of each bound)
_TYPES: dict[str, tuple[type, ...]] = {"source": (str,), "origin": (str,), "neighbor_key": (str,),
                                      "measured_at": (str,), "record_id": (int,), "trials": (int,),
                                      "speedup": (int, float), "distance": (int, float),
                                      "traffic_speedup": (int, float), "confidence": (int, float)}


def time_json(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


def time_of(text: str | None) -> datetime | None:
    """A `time_json` (or the service's ``...Z``) as a datetime."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


@dataclass(frozen=True, slots=True)
class Answer:
    """The strategy to use for one problem on one device (see the service's ``Lookup``, its wire
    schema); its JSON carries a snapshot entry's fields in their form (:mod:`autotuner.snapshot`).

    ``source``: tuned | estimated | nearest | model | default (the service's), or in-job where a
    measurement in this job found it. ``origin``: who answered this process: service | memory |
    disk | snapshot | fallback (the client's), process0 (another process of a job decided),
    unconfigured | no-kv-store | error (no lookup was made: the baseline), in-job. ``device_key``
    is "" where no device is known (an answer made without a client). ``traffic_speedup``: the
    measured winner's speedup split by its serial control (reference / control, what decomposing
    saves with nothing overlapped; `overlap_speedup` the rest), None where it was not split."""

    strategy: Strategy
    source: str
    speedup: float | None
    confidence: tuple[float, float] | None
    record_id: int | None
    measured_at: datetime | None
    problem_key: str
    device_key: str
    origin: str = "service"
    distance: float | None = None
    neighbor_key: str | None = None
    trials: int | None = None
    traffic_speedup: float | None = None

    @property
    def overlap_speedup(self) -> float | None:
        """What overlap adds to the speedup (`autotuner.measurement.overlap_speedup`)."""
        return overlap_speedup(self.speedup, self.traffic_speedup)

    @classmethod
    def from_json(cls, d: dict[str, Any], origin: str, *, keyed: bool = True) -> Answer:
        """The answer :meth:`to_json`'s form describes. Raises ValueError (StrategyError for the
        strategy) for anything else: not an object, a key that is not :data:`KEY_RE` (with
        ``keyed=False``: any string, for an answer that names no file), a field of the wrong
        type, a number that is not finite, ``measured_at`` not an ISO time."""
        d = _checked(d, keyed)
        speedup, distance, conf, traffic = d.get("speedup"), d.get("distance"), d.get("confidence"), d.get("traffic_speedup")
        return cls(strategy=Strategy.from_dict(d["strategy"]), source=d.get("source") or "tuned",
                   speedup=None if speedup is None else float(speedup),
                   confidence=(float(conf[0]), float(conf[1])) if conf else None,
                   record_id=d.get("record_id"), measured_at=time_of(d.get("measured_at")),
                   problem_key=d["problem_key"], device_key=d["device_key"],
                   origin=d.get("origin") or origin, distance=None if distance is None else float(distance),
                   neighbor_key=d.get("neighbor_key"), trials=d.get("trials"),
                   traffic_speedup=None if traffic is None else float(traffic))

    def to_json(self) -> dict[str, Any]:
        """Every field but ``origin`` (where it came from is the reader's to say)."""
        return {"strategy": self.strategy.to_dict(), "source": self.source, "speedup": self.speedup,
                "confidence": list(self.confidence) if self.confidence else None,
                "record_id": self.record_id, "measured_at": time_json(self.measured_at),
                "problem_key": self.problem_key, "device_key": self.device_key,
                "distance": self.distance, "neighbor_key": self.neighbor_key, "trials": self.trials,
                "traffic_speedup": self.traffic_speedup, "overlap_speedup": self.overlap_speedup}

    @classmethod
    def baseline(cls, problem_key: str, device_key: str) -> Answer:
        """The client's answer when nothing is known: the baseline, ``default``, from ``fallback``."""
        return cls(strategy=Strategy.baseline(), source="default", speedup=1.0, confidence=None,
                   record_id=None, measured_at=None, problem_key=problem_key, device_key=device_key,
                   origin="fallback")


def _checked(d: Any, keyed: bool = True) -> dict[str, Any]:
    """``d`` if it is an answer's JSON (see :meth:`Answer.from_json`), else ValueError."""
    if not isinstance(d, dict) or "strategy" not in d:
        raise ValueError(f"a lookup answer is an object with a strategy, not {type(d).__name__}")
    for name in ("problem_key", "device_key"):
        if not isinstance(d.get(name), str) or (keyed and not KEY_RE.fullmatch(d[name])):
            raise ValueError(f"{name} {str(d.get(name))[:60]!r} is not a key (1-128 of A-Za-z0-9_-)")
    conf = d.get("confidence")
    if conf is not None and not (isinstance(conf, list) and len(conf) in (0, 2)):
        raise ValueError(f"confidence {str(conf)[:40]!r} is not [lo, hi]")
    for name, value in [*((k, d.get(k)) for k in _TYPES if k != "confidence"),
                        *(("confidence", v) for v in conf or [])]:
        types = _TYPES[name]  # a number: finite, and a float (not 1e400, nor 10**400)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)
                                  or (float in types and not abs(value) < 1e300)):
            what = "a finite number" if float in types else f"a {types[0].__name__}"
            raise ValueError(f"{name}: {type(value).__name__} {str(value)[:40]!r} is not {what}")
    time_of(d.get("measured_at"))  # ValueError unless ISO
    return d
