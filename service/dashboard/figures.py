"""The dashboard's plotly figures, built from repository records (pure; no I/O).

Each function returns a ``plotly.graph_objects.Figure`` (so plotly validates every attribute);
:func:`embed` turns one into JSON safe to put inside ``<script type="application/json">``.
Strings that plotly renders (hover text, labels) are HTML-escaped first: plotly interprets a
few tags in them.
"""

from __future__ import annotations

import html
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go
from markupsafe import Markup

from db.records import MeasurementRecord
from db.repository import ShapeSample, SpeedupBin

__all__ = ["COLORS", "embed", "lookup_figure", "shape_map", "speedup_histogram",
           "strategy_figure", "trial_history", "winner_label"]

# one colour per winning method/direction, the same on every figure
COLORS = {"baseline": "#7f7f7f", "ring-uni": "#1f77b4", "ring-bidi": "#d62728",
          "xla_windowed": "#2ca02c", "plain": "#bcbd22"}
_EXTRA = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#ff7f0e")
_LAYOUT: dict[str, Any] = {"template": "plotly_white", "margin": {"l": 60, "r": 20, "t": 40, "b": 50},
                           "legend": {"orientation": "h", "y": -0.2}, "font": {"size": 12}}
_SOURCE_COLORS = {"tuned": "#2ca02c", "nearest": "#1f77b4", "model": "#ff7f0e",
                  "default": "#7f7f7f"}


def winner_label(method: str, direction: str | None = None) -> str:
    """``ring-bidi``, ``baseline``, ...: the method, and the direction if the strategy has one."""
    return f"{method}-{direction}" if direction else method


def color(label: str) -> str:
    if label in COLORS:
        return COLORS[label]
    return _EXTRA[sum(map(ord, label)) % len(_EXTRA)]


def _esc(text: object) -> str:
    return html.escape(str(text), quote=False)


def embed(fig: go.Figure) -> Markup:
    """The figure's JSON, with ``<``, ``>``, ``&`` escaped so no string in it can close the
    surrounding ``<script>`` element (they only occur inside JSON strings, where ``\\u003c`` is
    the same character)."""
    text = fig.to_json(validate=False, pretty=False)
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return Markup(text)


def _layout(**kw: Any) -> dict[str, Any]:
    return {**_LAYOUT, **kw}


def speedup_histogram(bins: Sequence[SpeedupBin]) -> go.Figure:
    """Stacked bars: winners per speedup bin, one colour per winning method/direction."""
    by_label: dict[str, dict[float, tuple[int, str]]] = defaultdict(dict)
    for b in bins:
        edge = f"≥ {b.lo:g}" if b.hi is None else f"{b.lo:.2f}–{b.hi:.2f}"
        by_label[winner_label(b.method, b.direction)][b.lo] = (b.count, edge)
    width = next((b.hi - b.lo for b in bins if b.hi is not None), 0.05)
    fig = go.Figure()
    for label in sorted(by_label):
        cells = sorted(by_label[label].items())
        fig.add_trace(go.Bar(
            x=[lo + width / 2 for lo, _ in cells], y=[c for _, (c, _) in cells], width=width,
            name=_esc(label), marker={"color": color(label)},
            customdata=[e for _, (_, e) in cells],
            hovertemplate="speedup %{customdata}<br>%{y} problems<extra>%{fullData.name}</extra>",
        ))
    fig.update_layout(**_layout(barmode="stack", bargap=0.05, height=420,
                                title={"text": "Winning speedup over the baseline"},
                                xaxis={"title": {"text": "speedup (baseline time / winner time)"}},
                                yaxis={"title": {"text": "tuned problems"}}))
    fig.add_vline(x=1.0, line={"dash": "dot", "color": "#444"})
    return fig


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def shape_map(sample: ShapeSample) -> go.Figure:
    """Speedup against bytes moved (a button switches to flops), log axes, one colour per
    winning method/direction; clicking a point opens its problem (``customdata[0]``)."""
    groups: dict[str, list[Any]] = defaultdict(list)
    for p in sample.points:
        groups[winner_label(p.method, p.direction)].append(p)
    fig = go.Figure()
    for label in sorted(groups):
        pts = groups[label]
        fig.add_trace(go.Scatter(
            x=[max(p.comm_bytes, 1.0) for p in pts], y=[p.speedup for p in pts],
            mode="markers", name=_esc(label),
            marker={"color": color(label), "size": 7, "opacity": 0.75,
                    "line": {"width": 0.5, "color": "#fff"}},
            customdata=[[p.problem_id, max(p.flops, 1.0)] for p in pts],
            text=[_esc(f"#{p.problem_id} {p.equation} {p.dtype} mesh {p.mesh_size} · "
                       f"{_si(p.comm_bytes)}B · {_si(p.flops)}flop") for p in pts],
            hovertemplate="%{text}<br>speedup %{y:.3f}<extra>%{fullData.name}</extra>",
        ))
    xs_comm = [[max(p.comm_bytes, 1.0) for p in groups[k]] for k in sorted(groups)]
    xs_flops = [[max(p.flops, 1.0) for p in groups[k]] for k in sorted(groups)]
    shown = f"{len(sample.points)} of {sample.total}" if sample.stride > 1 else str(sample.total)
    fig.update_layout(**_layout(
        height=420, title={"text": f"Shape map ({shown} tuned problems)"},
        margin={**_LAYOUT["margin"], "t": 70},
        xaxis={"type": "log", "title": {"text": "bytes received per device (collective)"}},
        yaxis={"type": "log", "title": {"text": "winning speedup"}},
        updatemenus=[{
            "type": "buttons", "direction": "right", "x": 1, "y": 1.02, "xanchor": "right",
            "yanchor": "bottom", "pad": {"r": 0, "t": 0},
            "showactive": True,
            "buttons": [
                {"label": "bytes moved", "method": "update",
                 "args": [{"x": xs_comm}, {"xaxis.title.text": "bytes received per device (collective)"}]},
                {"label": "flops (2·M·N·K·B)", "method": "update",
                 "args": [{"x": xs_flops}, {"xaxis.title.text": "flops of the einsum"}]},
            ],
        }],
    ))
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "#444"})
    return fig


def lookup_figure(shares: dict[str, float]) -> go.Figure:
    """Lookups answered per source (tuned / nearest / model / default), as horizontal bars."""
    total = sum(shares.values()) or 1.0
    names = list(shares)
    fig = go.Figure(go.Bar(
        x=[shares[n] for n in names], y=[_esc(n) for n in names], orientation="h",
        marker={"color": [_SOURCE_COLORS.get(n, "#9467bd") for n in names]},
        text=[f"{100 * shares[n] / total:.1f}%" for n in names], textposition="auto",
        hovertemplate="%{y}: %{x} lookups<extra></extra>",
    ))
    fig.update_layout(**_layout(height=80 + 34 * max(len(names), 1),
                                title={"text": "Lookups answered, by source"},
                                xaxis={"title": {"text": "lookups since the service started"}},
                                yaxis={"autorange": "reversed"}, showlegend=False))
    return fig


def quartiles(m: MeasurementRecord) -> tuple[float, float] | None:
    """(q1, q3) of a measurement's samples (numpy's linear percentiles, as the harness
    computes its IQR); else median -/+ IQR/2; else None."""
    if len(m.samples) >= 2:
        q1, _, q3 = statistics.quantiles(m.samples, n=4, method="inclusive")
        return q1, q3
    if m.median_s is not None and m.iqr_s is not None:
        return m.median_s - m.iqr_s / 2, m.median_s + m.iqr_s / 2
    return None


def latest_per_strategy(measurements: Iterable[MeasurementRecord]) -> list[MeasurementRecord]:
    """The latest measurement of every strategy (the winner rule's evidence), by strategy."""
    latest: dict[str, MeasurementRecord] = {}
    for m in measurements:
        cur = latest.get(m.strategy_key)
        if cur is None or (m.created_at, m.id) > (cur.created_at, cur.id):
            latest[m.strategy_key] = m
    return list(latest.values())


def strategy_figure(measurements: Sequence[MeasurementRecord], winner_key: str | None,
                    bound_s: float | None) -> go.Figure:
    """Every strategy's latest ok measurement: median with IQR error bars (ms), fastest on top;
    the baseline and the winner marked; the bound max(T_comm, T_comp) + fill as a line when
    known, else a note that it was not recorded."""
    ok = sorted((m for m in latest_per_strategy(measurements)
                 if m.status == "ok" and m.median_s is not None),
                key=lambda m: (m.median_s, m.strategy_key))
    roles = {"baseline": [], "winner": [], "other": []}  # type: dict[str, list[MeasurementRecord]]
    for m in ok:
        role = ("baseline" if m.method == "baseline" else
                "winner" if m.strategy_key == winner_key else "other")
        roles[role].append(m)
    style = {"baseline": ("baseline", "#7f7f7f", "diamond", 11),
             "winner": ("winner", "#d62728", "star", 14),
             "other": ("other strategies", "#1f77b4", "circle", 8)}
    fig = go.Figure()
    for role, ms in roles.items():
        if not ms:
            continue
        name, col, symbol, size = style[role]
        q = [quartiles(m) for m in ms]
        med = [m.median_s * 1e3 for m in ms]  # type: ignore[operator]
        fig.add_trace(go.Scatter(
            x=med, y=[_esc(m.strategy_key) for m in ms], mode="markers", name=name,
            marker={"color": col, "symbol": symbol, "size": size},
            error_x={"type": "data", "symmetric": False, "color": col, "thickness": 1.5,
                     "array": [(qq[1] * 1e3 - x) if qq else 0 for qq, x in zip(q, med, strict=True)],
                     "arrayminus": [(x - qq[0] * 1e3) if qq else 0
                                    for qq, x in zip(q, med, strict=True)]},
            customdata=[[m.n, m.ratio if m.ratio is not None else 1.0] for m in ms],
            hovertemplate="%{y}<br>median %{x:.3f} ms (IQR bars), n=%{customdata[0]}"
                          "<br>speedup %{customdata[1]:.3f}<extra></extra>",
        ))
    base = roles["baseline"][0].median_s if roles["baseline"] else None
    shapes_y = [_esc(m.strategy_key) for m in ok]
    known = bound_s is not None and math.isfinite(bound_s)
    note = ("line: bound max(T_comm, T_comp) + fill" if known
            else "bound max(T_comm, T_comp) + fill not recorded")
    fig.update_layout(**_layout(
        height=max(300, 150 + 26 * len(ok)),
        title={"text": "Measured strategies: median and IQR", "subtitle": {"text": note}},
        margin={**_LAYOUT["margin"], "t": 70},
        legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom"},
        xaxis={"title": {"text": "time per call (ms)"}},
        yaxis={"autorange": "reversed", "categoryorder": "array", "categoryarray": shapes_y,
               "automargin": True},
    ))
    if base is not None:
        fig.add_vline(x=base * 1e3, line={"dash": "dash", "color": "#7f7f7f"})
    if known:
        assert bound_s is not None
        fig.add_vline(x=bound_s * 1e3, line={"color": "#2ca02c", "width": 2})
    return fig


def trial_history(measurements: Sequence[MeasurementRecord]) -> go.Figure:
    """The tuner's trials in the order they were stored: each ok trial's speedup over the
    baseline with its CI, the best speedup so far as a step line; failed trials as crosses on
    the baseline line (their reasons are listed under the plot)."""
    xs, ys, lo, hi, labels, failed_x, failed_t = [], [], [], [], [], [], []
    best_x, best_y, best = [], [], None
    for i, m in enumerate(measurements, start=1):
        if m.status != "ok":
            failed_x.append(i)
            failed_t.append(_esc(f"{m.strategy_key}: {(m.reason or 'failed')[:120]}"))
            continue
        ratio = 1.0 if m.method == "baseline" else m.ratio
        if ratio is None:
            continue
        xs.append(i)
        ys.append(ratio)
        lo.append(ratio - m.ratio_lo if m.ratio_lo is not None else 0.0)
        hi.append(m.ratio_hi - ratio if m.ratio_hi is not None else 0.0)
        labels.append(_esc(m.strategy_key))
        best = ratio if best is None else max(best, ratio)
        best_x.append(i)
        best_y.append(best)
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=xs, y=ys, mode="markers", name="trial", text=labels,
        marker={"color": "#1f77b4", "size": 8},
        error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo,
                 "color": "#1f77b4", "thickness": 1},
        hovertemplate="trial %{x}: %{text}<br>speedup %{y:.3f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=best_x, y=best_y, mode="lines", name="best so far",
                             line={"shape": "hv", "color": "#d62728"}, hoverinfo="skip"))
    if failed_x:
        fig.add_trace(go.Scatter(x=failed_x, y=[1.0] * len(failed_x), mode="markers",
                                 name="failed", text=failed_t,
                                 marker={"symbol": "x", "color": "#000", "size": 9},
                                 hovertemplate="trial %{x} failed: %{text}<extra></extra>"))
    fig.update_layout(**_layout(height=340, title={"text": "Trial history"},
                                legend={"orientation": "h", "x": 1, "xanchor": "right",
                                        "y": 1.0, "yanchor": "bottom"},
                                xaxis={"title": {"text": "trial (measurement order)"},
                                       "dtick": 1 if len(measurements) <= 20 else None},
                                yaxis={"title": {"text": "speedup over baseline"}}))
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "#444"})
    return fig
