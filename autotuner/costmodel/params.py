"""The cost model's device parameters (`Params`) and the matmul-rate curve they carry."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from autotuner.errors import AutotunerError

VERSION = 1

class CostModelError(AutotunerError, ValueError):
    pass


# ============================================================================ parameters


@dataclass(frozen=True)
class Params:
    """A device's calibration. Times in seconds, sizes in bytes, rates in bytes/s or flop/s."""

    mm: tuple[tuple[float, float], ...]     # (flops, seconds) of local einsums, sorted by flops
    mem_bw: float                           # bytes/s: the floor of a memory-bound einsum
    ag: tuple[float, float]                 # all-gather alone: a + b * received bytes (a may be < 0)
    rs: tuple[float, float]                 # reduce-scatter alone: a + b * comm bytes
    alpha: float                            # s: the least a point-to-point transfer takes
    beta_uni: float                         # s per byte, one direction busy
    beta_bidi: float                        # s per byte per direction, both busy
    mm_fit: tuple[float, ...] = ()          # log T_mm = c0 + c1 log F (+ c2 log^2 F) on mm's range; (): interpolate
    kappa: float = 0.0                      # cpu slowdown while a transfer is in flight
    kappa_x: float = 0.0                    # transfer slowdown while the cpu computes
    loop_s: float = 0.0                     # per iteration of a rolled loop
    loop_serial: bool = False               # a rolled loop's body runs its ops one after another
    piece_s: float = 0.0                    # cpu overhead per partial einsum (slicing, dispatch)
    cpu_slots: int = 8                      # ready einsums the cpu runs at once, sharing it
    copy_bw: float = 5e9                    # bytes/s of fuse=after's assembly and concatenations
    after_copies: float = 2.0               # copies of the output fuse=after makes
    num_devices: int = 0                    # devices the calibration ran on
    version: int = VERSION
    info: dict[str, Any] = field(default_factory=dict, compare=False)  # fit diagnostics

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mm"] = [list(p) for p in self.mm]
        d["ag"], d["rs"], d["mm_fit"] = list(self.ag), list(self.rs), [float(c) for c in self.mm_fit]
        d["loop_serial"] = bool(self.loop_serial)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Params:
        try:
            if int(d.get("version", 0)) != VERSION:
                raise CostModelError(f"calibration version {d.get('version')!r}, this model reads {VERSION}: "
                                     "run `autotuner calibrate` again")
            mm = tuple(sorted((float(f), float(t)) for f, t in d["mm"]))
            if not mm:
                raise CostModelError("calibration has no matmul points")
            return cls(mm=mm, mem_bw=float(d["mem_bw"]), mm_fit=tuple(float(c) for c in d.get("mm_fit") or ()), ag=(float(d["ag"][0]), float(d["ag"][1])),
                       rs=(float(d["rs"][0]), float(d["rs"][1])), alpha=float(d["alpha"]),
                       beta_uni=float(d["beta_uni"]), beta_bidi=float(d["beta_bidi"]),
                       kappa=float(d.get("kappa", 0.0)), kappa_x=float(d.get("kappa_x", 0.0)),
                       loop_s=float(d.get("loop_s", 0.0)), loop_serial=bool(d.get("loop_serial", False)),
                       piece_s=float(d.get("piece_s", 0.0)),
                       cpu_slots=int(d.get("cpu_slots", 8)),
                       after_copies=float(d.get("after_copies", 2.0)),
                       copy_bw=float(d.get("copy_bw", 5e9)), num_devices=int(d.get("num_devices", 0)),
                       info=dict(d.get("info") or {}))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            if isinstance(e, CostModelError):
                raise
            raise CostModelError(f"invalid calibration: {type(e).__name__}: {e}") from None

    def t_mm(self, flops: float, nbytes: float = 0.0) -> float:
        """Seconds of an einsum of `flops` touching `nbytes` (roofline of the calibrated curve)."""
        t = _curve(self.mm, self.mm_fit, flops)
        return max(t, nbytes / self.mem_bw if self.mem_bw > 0 else 0.0)

    def t_data(self, nbytes: float, bidi: bool = False) -> float:
        """The data time of a transfer of `nbytes` on its link (per direction when `bidi`)."""
        return nbytes * (self.beta_bidi if bidi else self.beta_uni)

    def t_x(self, nbytes: float, bidi: bool = False) -> float:
        """One point-to-point transfer of `nbytes` alone (per direction when `bidi`): its data
        time, but at least `alpha`, the per-message cost (handshakes, the partner being
        scheduled) that a big message's data time hides; in a schedule the per-message costs of
        both directions queue on one resource (`_Schedule.send`). Measured on the lab (4
        processes, 1 Gbit/s links): 12 transfers of 64 KiB took 43 ms, 3 of 256 KiB 11.5 ms, 12 of
        1 MiB 103 ms, 3 of 4 MiB 103 ms; bidirectional rings lose to unidirectional ones below 1 MiB."""
        return max(self.alpha, nbytes * (self.beta_bidi if bidi else self.beta_uni))


def _curve(points: Sequence[tuple[float, float]], coef: Sequence[float], x: float) -> float:
    """The fitted matmul curve: the quadratic in log-log on the sweep's range, constant rate
    (time proportional to flops) beyond it; the interpolation of the points without a fit."""
    if x <= 0:
        return 0.0
    if not coef:
        return _loglog(points, x)
    lo, hi = points[0][0], points[-1][0]
    edge = min(max(x, lo), hi)
    lx = math.log(edge)
    t = math.exp(coef[0] + coef[1] * lx + coef[2] * lx * lx)
    return t * x / edge



def _loglog(points: Sequence[tuple[float, float]], x: float) -> float:
    """Monotone piecewise-linear interpolation in log-log; linear (constant rate) beyond the ends."""
    if x <= 0:
        return 0.0
    xs = [p[0] for p in points]
    ys = list(_cummax([p[1] for p in points]))
    if len(xs) == 1 or x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            lx0, lx1 = math.log(xs[i - 1]), math.log(xs[i])
            ly0, ly1 = math.log(ys[i - 1]), math.log(ys[i])
            w = (math.log(x) - lx0) / (lx1 - lx0) if lx1 > lx0 else 1.0
            return math.exp(ly0 + w * (ly1 - ly0))
    return ys[-1]


def _cummax(vals: Sequence[float]) -> list[float]:
    out, m = [], 0.0
    for v in vals:
        m = max(m, v)
        out.append(m)
    return out
