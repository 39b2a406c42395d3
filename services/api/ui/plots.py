"""Plots as inline SVG, drawn on the server: horizontal bars with an optional whisker (p50 to
p90). No script and no asset from elsewhere; the page carries the picture."""

from __future__ import annotations

import math
from dataclasses import dataclass

from markupsafe import Markup, escape

from schemas.manifest import ArtifactManifest
from schemas.tuning import CandidateOutcome, TuningTable

_WIDTH = 760
_LABEL_W = 260
_VALUE_W = 170
_ROW_H = 24
_BAR_H = 14


@dataclass(frozen=True)
class Bar:
    label: str
    #: The bar's length (e.g. p50 ms); ``None``: no bar, ``note`` says why.
    value: float | None
    #: Where the whisker ends (e.g. p90 ms).
    upper: float | None = None
    #: CSS class of the bar: ``won``, ``slower``, ``failed``, ``plain``.
    kind: str = "plain"
    note: str = ""


#: Figures spread wider than this (largest over smallest) are drawn on a log scale, so that
#: one slow outlier does not flatten the rest.
LOG_SPREAD = 20.0


def hbars(bars: list[Bar], *, unit: str, title: str) -> Markup:
    """Horizontal bars, each row's label on the left and its figure (or note) on the right:
    on a linear scale from zero, or a log scale when the figures spread over more than
    ``LOG_SPREAD`` (the plot's title says which)."""
    if not bars:
        return Markup("")
    figures = [f for b in bars for f in (b.value, b.upper) if f is not None and f > 0]
    top = max(figures, default=1e-9)
    bottom = min(figures, default=top)
    log = top / bottom > LOG_SPREAD
    plot_w = _WIDTH - _LABEL_W - _VALUE_W
    height = _ROW_H * len(bars) + 8 + (16 if log else 0)
    if log:
        title += " (log scale)"
        floor = math.log10(bottom) - 0.3  # the smallest bar still shows

    def x(value: float) -> float:
        if log:
            share = (math.log10(max(value, bottom)) - floor) / (math.log10(top) - floor)
            return _LABEL_W + plot_w * share
        return _LABEL_W + plot_w * value / top

    parts = [f'<svg class="plot" role="img" viewBox="0 0 {_WIDTH} {height}" width="{_WIDTH}" '
             f'height="{height}" xmlns="http://www.w3.org/2000/svg">'
             f'<title>{escape(title)}</title>']
    for i, bar in enumerate(bars):
        y = 4 + i * _ROW_H
        mid = y + _ROW_H / 2
        label = bar.label if len(bar.label) <= 44 else bar.label[:41] + "..."
        parts.append(f'<text class="label" x="{_LABEL_W - 8}" y="{mid + 4:.1f}" '
                     f'text-anchor="end"><title>{escape(bar.label)}</title>{escape(label)}'
                     f'</text>')
        if bar.value is None:
            parts.append(f'<text class="note" x="{_LABEL_W + 4}" y="{mid + 4:.1f}">'
                         f'{escape(bar.note)}</text>')
            continue
        width = max(1.0, x(bar.value) - _LABEL_W)
        parts.append(f'<rect class="bar {escape(bar.kind)}" x="{_LABEL_W}" '
                     f'y="{mid - _BAR_H / 2:.1f}" width="{width:.1f}" height="{_BAR_H}">'
                     f'<title>{escape(bar.label)}: {bar.value:.4g} {escape(unit)}</title></rect>')
        figure = f"{bar.value:.3g} {unit}"
        if bar.upper is not None and bar.upper > bar.value:
            parts.append(f'<line class="whisker" x1="{x(bar.value):.1f}" y1="{mid:.1f}" '
                         f'x2="{x(bar.upper):.1f}" y2="{mid:.1f}"/>'
                         f'<line class="whisker" x1="{x(bar.upper):.1f}" y1="{mid - 4:.1f}" '
                         f'x2="{x(bar.upper):.1f}" y2="{mid + 4:.1f}"/>')
            figure += f" · p90 {bar.upper:.3g}"
        parts.append(f'<text class="value" x="{_WIDTH - _VALUE_W + 4}" y="{mid + 4:.1f}">'
                     f'{escape(figure)}</text>')
    if log:
        parts.append(f'<text class="scale" x="{_LABEL_W}" y="{height - 4}">log scale: '
                     f'{escape(_figure(bottom))} to {escape(_figure(top))} {escape(unit)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _figure(value: float) -> str:
    return f"{value:.3g}"


def latency_by_key(manifests: list[ArtifactManifest]) -> Markup:
    """p50 (bar) and p90 (whisker) of each artifact's benchmark on its build host, one row per
    fingerprint key (and options, when one model was built with several)."""
    several = len({m.options_digest for m in manifests}) > 1
    bars = [Bar(label=m.fingerprint_key + (f" · {m.options_digest[:8]}" if several else ""),
                value=m.benchmark.p50_ms, upper=m.benchmark.p90_ms)
            for m in sorted(manifests, key=lambda m: (m.fingerprint_key, m.options_digest))]
    return hbars(bars, unit="ms", title="p50 latency per fingerprint key (whisker: p90)")


_KIND = {CandidateOutcome.WON: "won", CandidateOutcome.SLOWER: "slower"}


def candidates(table: TuningTable) -> Markup:
    """Each tuning candidate's p50 (whisker p90); one that did not pass shows its outcome."""
    bars = [Bar(label=c.name, value=c.p50_ms, upper=c.p90_ms, kind=_KIND.get(c.outcome, "failed"),
                note=c.outcome.value.replace("_", " "))
            for c in table.candidates]
    return hbars(bars, unit="ms", title=f"tuning candidates on {table.fingerprint_key}")
