"""The models pages (``/models``, ``/models/{id}``): stored ``autotuner bench-model`` runs as
table cells and figures (pure; no I/O). A run is a program's step timed plain (``jax.jit``) and
overlapped (``autotuner.overlap``) in one interleaved session; see :class:`db.ModelBenchRecord`.
"""

from __future__ import annotations

import json
from typing import Any

import plotly.graph_objects as go

from db.records import ModelBenchRecord
from service.dashboard.figures import _esc, _layout

__all__ = ["attribution_rows", "attribution_sums", "bench_figure", "fmt_ms", "fmt_ms_ci", "pair_figure",
           "pair_rows", "program_label"]

PLAIN, OVERLAPPED = "#7f7f7f", "#1f77b4"


def fmt_ms(seconds: float | None) -> str:
    """``12.34 ms`` (signed when negative: a loss), ``—`` when unknown."""
    return "—" if seconds is None else f"{seconds * 1e3:.2f} ms"


def fmt_ms_ci(lo: float | None, hi: float | None) -> str:
    return f"[{lo * 1e3:.2f}, {hi * 1e3:.2f}]" if lo is not None and hi is not None else ""


def program_label(b: ModelBenchRecord) -> str:
    """``module:factory {"layers": 1}``: the program and its factory's keywords, if any."""
    return f"{b.program} {json.dumps(b.kwargs, sort_keys=True)}" if b.kwargs else b.program


def _whiskers(median: float, lo: float | None, hi: float | None) -> tuple[float, float]:
    return ((hi - median) * 1e3 if hi is not None else 0.0, (median - lo) * 1e3 if lo is not None else 0.0)


def bench_figure(b: ModelBenchRecord) -> go.Figure:
    """Two bars, plain and overlapped: the median time per step (ms) with its 95% interval as
    whiskers; the speedup and its interval in the title."""
    steps = [("plain jit", b.plain_s, b.plain_lo_s, b.plain_hi_s, PLAIN),
             ("overlapped", b.overlapped_s, b.overlapped_lo_s, b.overlapped_hi_s, OVERLAPPED)]
    up, down = zip(*(_whiskers(m, lo, hi) for _, m, lo, hi, _ in steps), strict=True)
    fig = go.Figure(go.Bar(
        x=[name for name, *_ in steps], y=[m * 1e3 for _, m, *_ in steps],
        marker={"color": [c for *_, c in steps]},
        error_y={"type": "data", "symmetric": False, "array": list(up), "arrayminus": list(down),
                 "color": "#222", "thickness": 1.5, "width": 8},
        customdata=[[fmt_ms_ci(lo, hi)] for _, _, lo, hi, _ in steps],
        hovertemplate="%{x}: median %{y:.3f} ms per step<br>95% interval %{customdata[0]} ms<extra></extra>",
    ))
    ci = (f" [{b.speedup_lo:.3f}, {b.speedup_hi:.3f}]" if b.speedup_lo is not None
          and b.speedup_hi is not None else "")
    flag = " · SLOWER beyond the interval" if b.slower else ""
    fig.update_layout(**_layout(
        height=380, showlegend=False,
        title={"text": f"Time per step: speedup {b.speedup:.3f}×{ci}{flag}",
               "subtitle": {"text": f"median of {b.reps} interleaved steps each; whiskers: 95% interval"}},
        margin={"l": 60, "r": 20, "t": 70, "b": 50},
        yaxis={"title": {"text": "time per step (ms)"}, "rangemode": "tozero"}))
    return fig


def pair_rows(b: ModelBenchRecord) -> list[dict[str, Any]]:
    """The per-pair breakdown as table cells, as bench-model prints it (ms per run)."""
    rows = []
    for p in b.pairs:
        rows.append({"key": str(p.get("key", "?")), "names": ", ".join(map(str, p.get("names") or [])),
                     "strategy": str(p.get("strategy", "?")), "count": p.get("count"),
                     "baseline": fmt_ms(p.get("baseline_s")), "decomposed": fmt_ms(p.get("strategy_s")),
                     "ratio": "—" if p.get("ratio") is None else f"{p['ratio']:.2f}",
                     "ratio_ci": "" if p.get("ratio_lo") is None or p.get("ratio_hi") is None
                     else f"[{p['ratio_lo']:.2f}, {p['ratio_hi']:.2f}]",
                     "collective": fmt_ms(p.get("comm_s")), "einsum": fmt_ms(p.get("comp_s")),
                     "saved": fmt_ms(p.get("saved_s")), "failed": p.get("failed")})
    return rows


def attribution_rows(b: ModelBenchRecord) -> list[dict[str, Any]]:
    """`bench-model --attribute`'s table: per decomposed problem, its saving timed alone (the
    pairs), alone in the step and what removing it from the plan costs (ms per step)."""
    return [{"key": str(a.get("key", "?")), "name": str(a.get("name", "")), "count": a.get("count"),
             "isolated": fmt_ms(a.get("isolated_saved_s")), "alone": fmt_ms(a.get("alone_saved_s")),
             "alone_ci": fmt_ms_ci(a.get("alone_lo_s"), a.get("alone_hi_s")),
             "without": fmt_ms(a.get("without_saved_s")),
             "without_ci": fmt_ms_ci(a.get("without_lo_s"), a.get("without_hi_s"))}
            for a in b.attribution or ()]


def attribution_sums(b: ModelBenchRecord) -> dict[str, str] | None:
    """The attribution's sums against the measured saving, as cells; None without attribution."""
    if b.attribution is None:
        return None

    def total(field: str) -> str:
        got = [a[field] for a in b.attribution or () if isinstance(a.get(field), int | float)]
        return fmt_ms(sum(got)) if got else "—"

    return {"isolated": total("isolated_saved_s"), "alone": total("alone_saved_s"),
            "without": total("without_saved_s"), "measured": fmt_ms(b.measured_saved_s)}


def pair_figure(b: ModelBenchRecord) -> go.Figure | None:
    """Each pair timed alone (ms per run): its baseline, its decomposition (if decomposed), the
    collective alone and the einsum alone, grouped; ``None`` without a timed pair."""
    pairs = [p for p in b.pairs if p.get("baseline_s") is not None]
    if not pairs:
        return None
    labels = [_esc(f"{str(p.get('key', '?'))[:12]} {p.get('strategy', '?')}") for p in pairs]
    fig = go.Figure()
    for name, field, col in (("baseline", "baseline_s", PLAIN), ("decomposed", "strategy_s", OVERLAPPED),
                             ("collective alone", "comm_s", "#ff7f0e"), ("einsum alone", "comp_s", "#2ca02c")):
        ys = [None if p.get(field) is None else p[field] * 1e3 for p in pairs]
        if all(y is None for y in ys):
            continue
        fig.add_trace(go.Bar(x=labels, y=ys, name=name, marker={"color": col},
                             hovertemplate="%{x}<br>" + name + " %{y:.3f} ms<extra></extra>"))
    fig.update_layout(**_layout(barmode="group", height=400,
                                title={"text": "Each pair timed alone (ms per run)"},
                                yaxis={"title": {"text": "ms per run"}, "rangemode": "tozero"},
                                xaxis={"automargin": True}))
    return fig
