"""The dashboard's SVG bars: scale, whiskers, notes for candidates with no figure, escaping."""

from __future__ import annotations

import re

from services.api.ui.plots import LOG_SPREAD, Bar, hbars


def widths(svg: str) -> list[float]:
    return [float(w) for w in re.findall(r'<rect class="bar[^"]*"[^>]*width="([\d.]+)"', svg)]


def test_linear_bars_are_proportional_with_a_whisker_to_p90():
    svg = hbars([Bar("a", 1.0, upper=1.5), Bar("b", 2.0)], unit="ms", title="t")
    small, large = widths(svg)
    assert large / small == 2.0
    assert svg.count('class="whisker"') == 2 and "p90 1.5" in svg
    assert "log scale" not in svg


def test_a_wide_spread_goes_log_and_keeps_the_smallest_bar_visible():
    svg = hbars([Bar("fast", 0.008), Bar("pruned", 0.008 * LOG_SPREAD * 10)], unit="ms",
                title="t")
    small, large = widths(svg)
    assert "log scale: 0.008 to 1.6 ms" in svg
    assert small > 10 and large > small


def test_a_candidate_without_figures_shows_its_outcome_and_labels_are_text():
    svg = hbars([Bar("<b>x</b>", None, note="failed verification", kind="failed"),
                 Bar("ok", 1.0)], unit="ms", title="<i>t</i>")
    assert "failed verification" in svg and len(widths(svg)) == 1
    assert "<b>" not in svg and "&lt;b&gt;x&lt;/b&gt;" in svg and "<i>" not in svg
    assert hbars([], unit="ms", title="t") == ""
