"""What the compile-time client knows besides the service: the on-disk cache of answers
(``DiskCache``; an answer and its checked JSON are :class:`autotuner.answer.Answer`'s), a
measured session's answer (`session_answer`) and a snapshot file's (`snapshot_answers`).

A key names a file only if it matches :data:`KEY_RE` (a device or problem key is 32 hex digits).
A cache file with a line that does not parse (a torn write, non-UTF-8 bytes, another program's
text) is set aside, renamed ``NAME.corrupt-TIME-PID``, and rewritten from its good lines.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from autotuner import rule, snapshot
from autotuner.answer import KEY_RE, Answer
from autotuner.device import estimated_topology
from autotuner.files import write_atomic
from autotuner.strategy import Strategy, StrategyError

__all__ = ["KEY_RE", "DiskCache", "session_answer", "snapshot_answers"]

log = logging.getLogger("autotuner.runtime.client")  # the client's: the disk cache is part of it


def _line_result(line: bytes) -> Answer | None:
    """A disk cache line's result; None for untrusted bytes that do not parse, however."""
    try:
        return Answer.from_json(json.loads(line), "disk")
    except Exception:  # noqa: BLE001 - UnicodeDecodeError, JSONDecodeError, RecursionError, ...
        return None


class DiskCache:
    """One JSON-lines file per device (a :data:`KEY_RE` key) under ``root``; later lines win;
    a file with a bad line is set aside and rewritten from its good lines."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._loaded: dict[str, dict[str, Answer]] = {}
        self._lock = threading.Lock()

    def _path(self, device_key: str) -> Path | None:
        if not KEY_RE.fullmatch(device_key):
            return None
        return self.root / f"lookups-{device_key}.jsonl"

    def _device(self, device_key: str) -> dict[str, Answer]:
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

    def _set_aside(self, path: Path, good: list[Answer], bad: int) -> None:
        """Rename a corrupt file aside (kept for a look) and write its good lines anew; INFO,
        not a warning: the client repairs it, losing only the lines that did not parse."""
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        try:
            os.replace(path, aside)
            write_atomic(path, "".join(json.dumps(r.to_json()) + "\n" for r in good))
            log.info("lookup cache %s: %d bad line(s); moved to %s, rewritten", path, bad, aside.name)
        except OSError as e:
            log.warning("lookup cache %s: %d bad line(s), cannot set it aside: %s", path, bad, e)

    def get(self, device_key: str, problem_key: str) -> Answer | None:
        with self._lock:
            return self._device(device_key).get(problem_key)

    def put(self, results: Iterable[Answer]) -> None:
        by_device: dict[str, list[Answer]] = {}
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


def session_answer(session: Any, problem_key: str, device_key: str) -> Answer | None:
    """A measured session's winner as a `tuned` answer, by the one winner rule (`autotuner.rule`):
    the candidate with the highest speedup among those whose interval clears it, else the
    reference (the session's first program: baseline, or plain on TPU); None when it did not run."""
    from datetime import UTC

    from autotuner.measure.session import controls_of, split
    from autotuner.rule import Evidence, choose

    if session.baseline.status != "ok":
        return None
    ok = [c for c in session.candidates if c.status == "ok"]
    won = choose([Evidence(Strategy.from_dict(c.strategy).method, c.ratio, c.ratio_lo, c.ratio_hi, c.aa_width, c.key)
                  for c in ok],
                 Strategy.from_dict(session.baseline.strategy).method)
    trials = 1 + len(session.candidates)
    now = datetime.now(UTC)
    if won is None:
        return Answer(Strategy.from_dict(session.baseline.strategy), "tuned", 1.0, None, None, now,
                            problem_key, device_key, origin="in-job", trials=trials)
    best = ok[won]
    ci = (float(best.ratio_lo), float(best.ratio_hi)) if best.ratio_hi is not None else None
    traffic = split(best, controls_of(session.candidates).get(id(best)))["traffic_speedup"]   # where timed
    return Answer(Strategy.from_dict(best.strategy), "tuned", float(best.ratio), ci, None, now,
                  problem_key, device_key, origin="in-job", trials=trials, traffic_speedup=traffic)


def snapshot_answers(path: str | os.PathLike[str]) -> tuple[dict[tuple[str, str], Answer], list[Any]]:
    """A snapshot file's answers by (device key, problem key), `estimated` for a device whose
    topology says so, and its evidence items. Raises `snapshot.SnapshotError`."""
    doc = snapshot.load(path)
    out = {}
    estimated = {d.get("key") for d in doc.get("devices") or []
                 if isinstance(d, dict) and estimated_topology(d.get("topology"))}
    for i, e in enumerate(doc.get("entries", [])):
        try:
            source = rule.exact_source(isinstance(e, dict) and e.get("device_key") in estimated)
            r = snapshot.entry_answer(e, source)
        except (KeyError, TypeError, ValueError, StrategyError) as err:
            raise snapshot.SnapshotError(f"{path}: entries[{i}] is invalid: {err}") from None
        out[(r.device_key, r.problem_key)] = r
    evidence = doc.get("evidence")
    return out, evidence if isinstance(evidence, list) else []
