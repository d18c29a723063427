"""What the compile-time client knows: :class:`LookupResult` (an answer, and its JSON, checked:
what does not parse raises ValueError) and the on-disk cache of answers (``DiskCache``).

A key names a file only if it matches :data:`KEY_RE` (a device or problem key is 32 hex digits).
A cache file with a line that does not parse (a torn write, non-UTF-8 bytes, another program's
text) is set aside, renamed ``NAME.corrupt-TIME-PID``, and rewritten from its good lines.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from autotuner import rule, snapshot
from autotuner.device import estimated_topology
from autotuner.files import write_atomic
from autotuner.strategy import Strategy, StrategyError

__all__ = ["KEY_RE", "DiskCache", "LookupResult"]

log = logging.getLogger("autotuner.runtime.client")  # the client's: the disk cache is part of it

KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")  # a device or problem key: may name a cache file
# the types of an answer's optional fields (null or absent: unknown; confidence: of each bound)
_TYPES: dict[str, tuple[type, ...]] = {"source": (str,), "origin": (str,), "neighbor_key": (str,),
                                      "measured_at": (str,), "record_id": (int,), "trials": (int,),
                                      "speedup": (int, float), "distance": (int, float),
                                      "confidence": (int, float)}


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The strategy to use for one problem on one device (see the service's ``Lookup``); its
    JSON carries a snapshot entry's fields in their form (:mod:`autotuner.snapshot`)."""

    strategy: Strategy
    source: str                              # tuned | nearest | model | default
    speedup: float | None
    confidence: tuple[float, float] | None
    record_id: int | None
    measured_at: datetime | None
    problem_key: str
    device_key: str
    origin: str = "service"                  # service | memory | disk | snapshot | fallback
    distance: float | None = None
    neighbor_key: str | None = None
    trials: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any], origin: str) -> LookupResult:
        """The result :meth:`to_json`'s form describes. Raises ValueError (StrategyError for the
        strategy) for anything else: not an object, a key that is not :data:`KEY_RE`, a field of
        the wrong type, a number that is not finite, ``measured_at`` not an ISO time."""
        d = _checked(d)
        speedup, distance, conf = d.get("speedup"), d.get("distance"), d.get("confidence")
        return cls(strategy=Strategy.from_dict(d["strategy"]), source=d.get("source") or "tuned",
                   speedup=None if speedup is None else float(speedup),
                   confidence=(float(conf[0]), float(conf[1])) if conf else None,
                   record_id=d.get("record_id"), measured_at=snapshot.time_of(d.get("measured_at")),
                   problem_key=d["problem_key"], device_key=d["device_key"],
                   origin=d.get("origin") or origin, distance=None if distance is None else float(distance),
                   neighbor_key=d.get("neighbor_key"), trials=d.get("trials"))

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy.to_dict(), "source": self.source, "speedup": self.speedup,
                "confidence": list(self.confidence) if self.confidence else None,
                "record_id": self.record_id, "measured_at": snapshot.time_json(self.measured_at),
                "problem_key": self.problem_key, "device_key": self.device_key,
                "distance": self.distance, "neighbor_key": self.neighbor_key, "trials": self.trials}

    @classmethod
    def baseline(cls, problem_key: str, device_key: str) -> LookupResult:
        return cls(strategy=Strategy.baseline(), source="default", speedup=1.0, confidence=None,
                   record_id=None, measured_at=None, problem_key=problem_key, device_key=device_key,
                   origin="fallback")


def _checked(d: Any) -> dict[str, Any]:
    """``d`` if it is an answer's JSON (see :meth:`LookupResult.from_json`), else ValueError."""
    if not isinstance(d, dict) or "strategy" not in d:
        raise ValueError(f"a lookup answer is an object with a strategy, not {type(d).__name__}")
    for name in ("problem_key", "device_key"):
        if not isinstance(d.get(name), str) or not KEY_RE.fullmatch(d[name]):
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
    snapshot.time_of(d.get("measured_at"))  # ValueError unless ISO
    return d


def _line_result(line: bytes) -> LookupResult | None:
    """A disk cache line's result; None for untrusted bytes that do not parse, however."""
    try:
        return LookupResult.from_json(json.loads(line), "disk")
    except Exception:  # noqa: BLE001 - UnicodeDecodeError, JSONDecodeError, RecursionError, ...
        return None


class DiskCache:
    """One JSON-lines file per device (a :data:`KEY_RE` key) under ``root``; later lines win;
    a file with a bad line is set aside and rewritten from its good lines."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._loaded: dict[str, dict[str, LookupResult]] = {}
        self._lock = threading.Lock()

    def _path(self, device_key: str) -> Path | None:
        if not KEY_RE.fullmatch(device_key):
            return None
        return self.root / f"lookups-{device_key}.jsonl"

    def _device(self, device_key: str) -> dict[str, LookupResult]:
        table = self._loaded.get(device_key)
        if table is not None:
            return table
        path = self._path(device_key)
        try:
            lines = path.read_bytes().splitlines() if path is not None else []
        except OSError:  # no file yet, or unreadable: nothing cached
            lines = []
        results = [_line_result(line) for line in lines if line.strip()]
        table = {r.problem_key: r for r in results if r is not None}
        if path is not None and None in results:
            self._set_aside(path, list(table.values()), results.count(None))
        self._loaded[device_key] = table
        return table

    def _set_aside(self, path: Path, good: list[LookupResult], bad: int) -> None:
        """Rename a corrupt file aside (kept for a look) and write its good lines anew; INFO,
        not a warning: the client repairs it, losing only the lines that did not parse."""
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        try:
            os.replace(path, aside)
            write_atomic(path, "".join(json.dumps(r.to_json()) + "\n" for r in good))
            log.info("lookup cache %s: %d bad line(s); moved to %s, rewritten", path, bad, aside.name)
        except OSError as e:
            log.warning("lookup cache %s: %d bad line(s), cannot set it aside: %s", path, bad, e)

    def get(self, device_key: str, problem_key: str) -> LookupResult | None:
        with self._lock:
            return self._device(device_key).get(problem_key)

    def put(self, results: Iterable[LookupResult]) -> None:
        by_device: dict[str, list[LookupResult]] = {}
        for r in results:
            by_device.setdefault(r.device_key, []).append(r)
        with self._lock:
            for dkey, rs in by_device.items():
                table = self._device(dkey)
                new = [r for r in rs if table.get(r.problem_key) != replace(r, origin="disk")]
                path = self._path(dkey)
                if not new or path is None:
                    continue
                try:
                    self.root.mkdir(parents=True, exist_ok=True)
                    with path.open("a", encoding="utf-8") as f:  # one write of whole lines
                        f.write("".join(json.dumps(r.to_json()) + "\n" for r in new))
                except OSError as e:
                    log.warning("cannot write the lookup cache %s: %s", path, e)
                    return
                for r in new:
                    table[r.problem_key] = replace(r, origin="disk")


def session_answer(session: Any, problem_key: str, device_key: str) -> LookupResult | None:
    """A measured session's winner as a `tuned` answer, by the one winner rule (`autotuner.rule`):
    the candidate with the highest speedup among those whose interval clears it, else the
    reference (the session's first program: baseline, or plain on TPU); None when it did not run."""
    from datetime import UTC

    from autotuner.rule import Evidence, choose

    if session.baseline.status != "ok":
        return None
    ok = [c for c in session.candidates if c.status == "ok"]
    won = choose([Evidence(Strategy.from_dict(c.strategy).method, c.ratio, c.ratio_lo, c.ratio_hi) for c in ok],
                 Strategy.from_dict(session.baseline.strategy).method)
    trials = 1 + len(session.candidates)
    now = datetime.now(UTC)
    if won is None:
        return LookupResult(Strategy.from_dict(session.baseline.strategy), "tuned", 1.0, None, None, now,
                            problem_key, device_key, origin="in-job", trials=trials)
    best = ok[won]
    ci = (float(best.ratio_lo), float(best.ratio_hi)) if best.ratio_hi is not None else None
    return LookupResult(Strategy.from_dict(best.strategy), "tuned", float(best.ratio), ci, None, now,
                        problem_key, device_key, origin="in-job", trials=trials)


def snapshot_answers(path: str | os.PathLike[str]) -> tuple[dict[tuple[str, str], LookupResult], list[Any]]:
    """A snapshot file's answers by (device key, problem key), `estimated` for a device whose
    topology says so, and its evidence items. Raises `snapshot.SnapshotError`."""
    doc = snapshot.load(path)
    out = {}
    estimated = {d.get("key") for d in doc.get("devices") or []
                 if isinstance(d, dict) and estimated_topology(d.get("topology"))}
    for i, e in enumerate(doc.get("entries", [])):
        try:
            source = rule.exact_source(isinstance(e, dict) and e.get("device_key") in estimated)
            r = LookupResult.from_json({**e, "source": source}, "snapshot")
        except (KeyError, TypeError, ValueError, StrategyError) as err:
            raise snapshot.SnapshotError(f"{path}: entries[{i}] is invalid: {err}") from None
        out[(r.device_key, r.problem_key)] = r
    evidence = doc.get("evidence")
    return out, evidence if isinstance(evidence, list) else []
