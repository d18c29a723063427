"""What the pages show: repository records turned into template values (pure; no I/O).

Formatting lives here, not in the templates, so it is tested without rendering.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry

from autotuner.device import ESTIMATED_LABEL, estimated_topology
from autotuner.rule import SOURCES, reference_method
from db.records import DeviceRecord, JobRecord, MeasurementRecord, ProblemRecord, WinnerRecord
from db.repository import TunedCount

__all__ = ["LOOKUP_SOURCES", "DeviceGroup", "device_label", "fmt_bytes", "fmt_ci", "fmt_split", "fmt_mesh",
           "fmt_shapes", "fmt_speedup", "fmt_time", "fmt_when", "job_summary", "lookup_shares",
           "measurement_groups", "problem_json", "tuned_by_device"]

LOOKUP_SOURCES = SOURCES
LOOKUP_COUNTER = "autotuner_lookups"  # service.metrics: Counter("autotuner_lookups_total", ...)


def fmt_when(ts: datetime | None) -> str:
    return ts.strftime("%Y-%m-%d %H:%M UTC") if ts is not None else "—"


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_speedup(x: float | None) -> str:
    return f"{x:.3f}×" if x is not None else "—"


def fmt_ci(lo: float | None, hi: float | None) -> str:
    return f"[{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else ""


def fmt_split(winner: Any) -> str:
    """A winner's speedup split by its serial control: "traffic 1.010× · overlap 1.287×" (what
    moving less saves, what running the transfers beside the einsums adds), "" where not split."""
    traffic, overlap = getattr(winner, "traffic_speedup", None), getattr(winner, "overlap_speedup", None)
    return f"traffic {traffic:.3f}× · overlap {overlap:.3f}×" if traffic is not None and overlap is not None else ""


def _entry(e: Any) -> str:
    if e is None:
        return ""
    if isinstance(e, list | tuple):
        return "(" + ",".join(map(str, e)) + ")" if e else ""
    return str(e)


def _operand(op: Any) -> str:
    if not isinstance(op, dict):
        return "?"
    shape = op.get("shape") or []
    spec = list(op.get("spec") or [])
    spec += [None] * (len(shape) - len(spec))
    return "×".join(f"{d}/{_entry(a)}" if _entry(a) else str(d)
                    for d, a in zip(shape, spec, strict=False))


def fmt_shapes(canonical: dict[str, Any]) -> str:
    """``8×2048/x×4096 · 4096×16384/x``: both operands' global shapes, a sharded dimension
    followed by its mesh axis."""
    return f"{_operand(canonical.get('lhs'))} · {_operand(canonical.get('rhs'))}"


def fmt_mesh(canonical: dict[str, Any]) -> str:
    mesh = canonical.get("mesh")
    if not isinstance(mesh, dict):
        return "?"
    return ", ".join(f"{k}={v}" for k, v in mesh.items())


def device_label(d: DeviceRecord | TunedCount | None) -> str:
    """``cpu ×4 · lab-ring-1gbit``: kind, count and topology of a device fingerprint; a
    compile-only target's says its figures are estimates."""
    if d is None:
        return "—"
    label = f"{d.device_kind} ×{d.num_devices}"
    label = f"{label} · {d.topology}" if d.topology else label
    return f"{label} · {ESTIMATED_LABEL}" if estimated_topology(d.topology) else label


def problem_json(p: ProblemRecord) -> str:
    """The Problem JSON (the canonical form the key hashes): one top-level field a line."""
    fields = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in p.canonical.items()]
    return "{\n" + ",\n".join(fields) + "\n}" if fields else "{}"


# --------------------------------------------------------------------------- overview


@dataclass(frozen=True)
class DeviceTuned:
    device_key: str
    label: str
    platform: str
    rows: tuple[TunedCount, ...]

    @property
    def problems(self) -> int:
        return sum(r.problems for r in self.rows)

    @property
    def decomposed(self) -> int:
        return sum(r.decomposed for r in self.rows)


def tuned_by_device(counts: Iterable[TunedCount]) -> list[DeviceTuned]:
    out: dict[str, list[TunedCount]] = {}
    for c in counts:
        out.setdefault(c.device_key, []).append(c)
    return [DeviceTuned(device_key=k, label=device_label(rows[0]), platform=rows[0].platform,
                        rows=tuple(rows)) for k, rows in out.items()]


def lookup_shares(registry: CollectorRegistry) -> dict[str, float]:
    """Lookups answered per source since the service started, read from its Prometheus counter
    (all workers' when ``PROMETHEUS_MULTIPROC_DIR`` is set). The four known sources always
    appear, in order; any other source after them."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    counts = dict.fromkeys(LOOKUP_SOURCES, 0.0)
    for metric in registry.collect():
        if metric.name != LOOKUP_COUNTER:
            continue
        for sample in metric.samples:
            if sample.name == LOOKUP_COUNTER + "_total" and "source" in sample.labels:
                source = sample.labels["source"]
                counts[source] = counts.get(source, 0.0) + float(sample.value)
    return counts


def _device_json_label(d: Any) -> str:
    if not isinstance(d, dict):
        return "?"
    label = f"{d.get('device_kind', '?')} ×{d.get('num_devices', '?')}"
    return f"{label} · {d['topology']}" if d.get("topology") else label


def _summary(problem: Any, device: Any) -> dict[str, Any]:
    """A queued problem (canonical JSON) on a device (fingerprint JSON), as table cells."""
    canonical = problem if isinstance(problem, dict) else {}
    return {"equation": canonical.get("equation", "?"), "shapes": fmt_shapes(canonical),
            "dtype": canonical.get("dtype", "?"), "mesh": fmt_mesh(canonical),
            "device": _device_json_label(device)}


def job_summary(jobs: Sequence[JobRecord]) -> list[dict[str, Any]]:
    return [{"job": j, **_summary(j.problem, j.device)} for j in jobs]


def demand_summary(items: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"demand": d, **_summary(d.problem, d.device)} for d in items]


# --------------------------------------------------------------------------- problem page


@dataclass(frozen=True)
class DeviceGroup:
    """One device's measurements of a problem, its stored winner and the bound if known."""

    device: DeviceRecord | None
    device_id: int
    winner: WinnerRecord | None
    measurements: tuple[MeasurementRecord, ...]
    bound_s: float | None

    @property
    def failed(self) -> list[tuple[int, MeasurementRecord]]:
        """(trial number, measurement) of every failed trial."""
        return [(i, m) for i, m in enumerate(self.measurements, start=1) if m.status != "ok"]

    @property
    def winning(self) -> MeasurementRecord | None:
        """The measurement the winner was chosen from (its strategy's among the winner's evidence):
        whose source, token, host and repetitions the page shows as the winner's provenance."""
        w = self.winner
        if w is None:
            return None
        ids = set(w.measurement_ids)
        found = [m for m in self.measurements if m.id in ids and m.strategy_key == w.strategy_key]
        return found[-1] if found else None

    @property
    def label(self) -> str:
        return device_label(self.device) if self.device else f"device {self.device_id}"

    @property
    def estimated(self) -> bool:
        """A compile-only target's: its times are XLA:TPU's estimates."""
        return self.device is not None and estimated_topology(self.device.topology)

    @property
    def reference(self) -> str:
        """The method every speedup here is over (plain on TPU, else the baseline)."""
        return reference_method(self.device.platform if self.device else None)


def measurement_groups(measurements: Sequence[MeasurementRecord],
                       winners: Sequence[WinnerRecord],
                       devices: dict[int, DeviceRecord]) -> list[DeviceGroup]:
    """Measurements grouped per device (by device id), in stored order.

    The bound max(T_comm, T_comp) + fill is not stored with measurements (the tuner computes
    it per session and prints it), so ``bound_s`` is None until the database records it.
    """
    by_device: dict[int, list[MeasurementRecord]] = {}
    for m in measurements:
        by_device.setdefault(m.device_id, []).append(m)
    winner_of = {w.device_id: w for w in winners}
    for device_id in winner_of:
        by_device.setdefault(device_id, [])
    return [DeviceGroup(device=devices.get(i), device_id=i, winner=winner_of.get(i),
                        measurements=tuple(by_device[i]), bound_s=None)
            for i in sorted(by_device)]
