"""Figures 3 and 4 as drawn (Agg): every label inside its axes, none over a bar, each legible on what it sits on
(text bounding boxes from the renderer; contrast by WCAG 2's relative-luminance formula, written out here)."""

from __future__ import annotations

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.patches import Rectangle

from reports.figures import draw as drawing
from reports.figures import token_level

MIN_CONTRAST = 3.0  # WCAG 2's minimum contrast for graphics and large text; white on white is 1.0


def _luminance(colour) -> float:
    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in to_rgb(colour))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a, b) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_contrast_formula_on_known_pairs():
    assert contrast("white", "white") == pytest.approx(1.0)
    assert contrast("black", "white") == pytest.approx(21.0)
    assert contrast("#777777", "white") == pytest.approx(4.48, abs=0.01)  # WCAG's well-known grey


@pytest.fixture
def drawn(ctx_factory, monkeypatch, tmp_path):
    """Draw a token-level figure for real (PNG into tmp_path) and keep its Figure (on an Agg canvas again after
    saving closed it, to measure its texts)."""
    figs = []
    real_save = drawing.save_figure

    def keep(fig, out_dir, name, formats=("png", "pdf")):
        paths = real_save(fig, out_dir, name, formats)
        FigureCanvasAgg(fig)
        figs.append(fig)
        return paths

    monkeypatch.setattr(drawing, "save_figure", keep)

    def draw(fn):
        ctx = ctx_factory()
        ctx.out, ctx.draw, ctx.formats = tmp_path, True, ("png",)
        result = fn(ctx)
        assert result.has_data and result.files[0].is_file()
        return figs[-1]

    return draw


def _bars(ax) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_height() != 0]


@pytest.mark.parametrize("name", ["fig3_unsafe_keep", "fig4_corrective"])
def test_labels_inside_the_axes_off_the_bars_and_legible(drawn, name):
    fig = drawn(getattr(token_level, name))
    renderer = fig.canvas.get_renderer()
    checked = bars_seen = 0
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        bars = [b.get_window_extent(renderer) for b in _bars(ax)]
        bars_seen += len(bars)
        for text in ax.texts:
            if not (text.get_visible() and text.get_text()):
                continue
            t = text.get_window_extent(renderer)
            where = f"{name}: {text.get_text()!r} at {t} in axes {box}"
            assert box.x0 <= t.x0 and t.x1 <= box.x1 and box.y0 <= t.y0 and t.y1 <= box.y1, where
            assert not any(t.overlaps(b) for b in bars), where
            # off the bars it sits on the axes' face
            assert contrast(text.get_color(), ax.get_facecolor()) >= MIN_CONTRAST, where
            checked += 1
    assert checked >= 4 and bars_seen >= 2  # the figure has labels and bars: the checks ran on something


def test_every_figure_names_its_intervals_by_the_one_rule(ctx_factory):
    """Each figure's caption ends with the rule's sentence once; the rule's page names every interval it uses."""
    from pathlib import Path

    from reports import artefact_registry, cells

    figures = artefact_registry.artefacts("figure")
    assert len(figures) >= 10
    for a in figures:
        caption = a(ctx_factory()).caption
        assert caption.count("Intervals, by the report's one rule") == 1, (a.name, caption)
    page = (Path(__file__).parents[2] / cells.INTERVAL_RULE_DOC).read_text()
    for words in ("Student-t", "seed-cluster bootstrap", "standard error", "Wilson"):
        assert words in page.split("## Intervals: one rule")[1].split("\n## ")[0], words
    with pytest.raises(ValueError, match=r"\['sd'\] not allowed; allowed: seeds, pooled"):
        cells.interval_caption("seeds", "sd")
