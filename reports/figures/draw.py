"""Drawing helpers every figure family shares: grids of axes, wrapped titles, one legend, empty panels, saving."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: reports never need a display

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from predmask.io import atomic_write
from reports.artefact import Artefact, ArtefactResult, Panel, ReportContext, Source, declare
from reports.style import GREY, RC

plt.rcParams.update(RC)  # one style for every figure of the process (reports run in their own process)

LEGEND_ROW_IN = 0.25  # height of one legend row, inches


def new_figure(n_rows: int, n_cols: int, panel_w: float = 3.2, panel_h: float = 2.5) -> tuple[Figure, list]:
    """A figure with an n_rows × n_cols grid of axes (returned row-major as a flat list), in the house style."""
    fig, axes = plt.subplots(
        n_rows, n_cols, figsize=(panel_w * n_cols + 0.4, panel_h * n_rows + 0.9), squeeze=False
    )
    return fig, [ax for row in axes for ax in row]


def titled_grid(
    n_rows: int,
    n_cols: int,
    title: Iterable[str],
    n_labels: int,
    legend_cols: int,
    *,
    ax_w: float = 2.7,
    ax_h: float = 1.75,
    bottom: float = 0.55,
) -> tuple[Figure, list]:
    """A grid of axes laid out by fixed margins in inches (no tight_layout pass: a third less drawing), with room
    above for the wrapped title and below for a legend of n_labels entries."""
    left, right, wgap, hgap = 0.75, 0.2, 0.6, 0.95
    top = 0.2 * len(wrap_lines(title, 0.95 + n_cols * ax_w + (n_cols - 1) * 0.6)) + 0.55
    bottom += LEGEND_ROW_IN * legend_rows(n_labels, legend_cols)
    width = left + n_cols * ax_w + (n_cols - 1) * wgap + right
    height = top + n_rows * ax_h + (n_rows - 1) * hgap + bottom
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width, height), squeeze=False)
    fig.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        top=1 - top / height,
        bottom=bottom / height,
        wspace=wgap / ax_w,
        hspace=hgap / ax_h,
    )
    return fig, [ax for row in axes for ax in row]


def wrap_lines(lines: Iterable[str], width_in: float) -> list[str]:
    """Lines wrapped to a figure width in inches (9 pt text: about 13 characters per inch)."""
    width_chars = max(40, int(width_in * 13))
    return [w for line in lines for w in textwrap.wrap(line, width_chars)]


def panel_axes(ax, panel: Panel, title: str | None = None, empty: bool | None = None, **title_kw) -> bool:
    """Title the axes (the panel's title unless given); a panel without series (or ``empty``) shows its note
    instead, visible, not silently dropped: False."""
    ax.set_title(panel.title if title is None else title, **title_kw)
    if not panel.series if empty is None else empty:
        message = panel.note or "no data"
        ax.text(
            0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color=GREY, fontsize=8, wrap=True
        )
        ax.set_xticks([])
        ax.set_yticks([])
        ax.grid(False)
        return False
    return True


def save_figure(fig: Figure, out_dir: Path, name: str, formats: Iterable[str] = ("png", "pdf")) -> list[Path]:
    """Write name.<fmt> for each format atomically; close the figure."""
    paths: list[Path] = []
    try:
        for fmt in formats:
            final = out_dir / f"{name}.{fmt}"
            atomic_write(final, lambda tmp, fmt=fmt: fig.savefig(tmp, format=fmt))
            paths.append(final)
    finally:
        plt.close(fig)
    return paths


def figure(title: str, source: Source = "runs") -> Callable[[Callable[[ReportContext], ArtefactResult]], Artefact]:
    """Declare a figure function named as its files are; it sets the result's `drawn` to its open Figure."""
    return declare("figure", title, source, lambda r, ctx: save_figure(r.drawn, ctx.out, r.name, ctx.formats))


def legend_rows(n_labels: int, ncol: int = 4) -> int:
    """Rows a legend of n_labels entries takes with ncol columns."""
    return -(-n_labels // ncol) if n_labels else 0


def legend_below(fig: Figure, handles_labels: Mapping[str, object], ncol: int = 4) -> None:
    """One shared legend at the bottom edge of the figure (label -> artist, insertion order); the layout must
    reserve legend_rows(...) * LEGEND_ROW_IN inches for it."""
    if not handles_labels:
        return
    labels = list(handles_labels)
    fig.legend(
        [handles_labels[k] for k in labels],
        labels,
        loc="lower center",
        ncol=min(len(labels), ncol),
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )


def suptitle(fig: Figure, *lines: str) -> None:
    """A centred figure title, each line wrapped to the figure's width (the layout must make room for it)."""
    fig.suptitle("\n".join(wrap_lines(lines, fig.get_figwidth())), fontsize=9)


def finish(fig: Figure, title: Iterable[str], handles_labels: Mapping[str, object], ncol: int) -> Figure:
    """The figure with its title lines (suptitle) and its legend below (legend_below; none without handles)."""
    suptitle(fig, *title)
    legend_below(fig, handles_labels, ncol)
    return fig


def _overflow(ax, texts: Iterable) -> tuple[float, float, float, float]:
    """How far (pixels) the texts reach past the axes box: left, right, bottom, top (≤ 0: inside)."""
    renderer = ax.figure.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    boxes = [t.get_window_extent(renderer) for t in texts if t.get_visible() and t.get_text()]
    if not boxes:
        return (0.0, 0.0, 0.0, 0.0)
    return (
        max(box.x0 - b.x0 for b in boxes),
        max(b.x1 - box.x1 for b in boxes),
        max(box.y0 - b.y0 for b in boxes),
        max(b.y1 - box.y1 for b in boxes),
    )


def keep_inside(ax, texts: Iterable, margin_px: float = 3.0, rounds: int = 8) -> None:
    """Widen the axes' data limits until every text placed in data coordinates (or offset from a data point) lies
    inside the axes box: no label past the axis. Call after the layout is final."""
    texts = list(texts)
    for _ in range(rounds):
        left, right, bottom, top = (
            max(0.0, v + margin_px) if v > -margin_px else 0.0 for v in _overflow(ax, texts)
        )
        if not (left or right or bottom or top):
            return
        box = ax.get_window_extent(ax.figure.canvas.get_renderer())
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        dx, dy = (x1 - x0) / box.width, (y1 - y0) / box.height
        ax.set_xlim(x0 - 1.5 * left * dx, x1 + 1.5 * right * dx)
        ax.set_ylim(y0 - 1.5 * bottom * dy, y1 + 1.5 * top * dy)


def clear_of(ax, text, obstacles: Iterable, margin_px: float = 3.0, rounds: int = 12) -> None:
    """Raise the axes' upper y-limit until `text` (placed in axes coordinates near the top) overlaps none of the
    `obstacles` (bars, other labels): no text over data. Call after the layout is final."""
    obstacles = list(obstacles)
    for _ in range(rounds):
        renderer = ax.figure.canvas.get_renderer()
        t = text.get_window_extent(renderer).padded(margin_px)
        if not any(t.overlaps(o.get_window_extent(renderer)) for o in obstacles):
            return
        y0, y1 = ax.get_ylim()
        ax.set_ylim(y0, y1 + 0.25 * (y1 - y0))


def fit_width(ax, text, margin_px: float = 3.0, rounds: int = 8) -> None:
    """Re-wrap a text placed in axes coordinates to narrower lines until it ends inside the axes box on the right
    (its lines joined by newlines are wrapped again, each paragraph line on its own)."""
    for _ in range(rounds):
        if _overflow(ax, [text])[1] <= -margin_px:
            return
        lines = text.get_text().split("\n")
        width = max(20, int(0.85 * max(len(line) for line in lines)))
        text.set_text("\n".join(w for line in lines for w in (textwrap.wrap(line, width) or [""])))
