"""The one look of every report figure: Agg backend, Okabe-Ito colours, method and setting labels, atomic saving."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: reports never need a display

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

# Okabe & Ito (2008), "Color Universal Design": distinguishable under the common colour-vision deficiencies.
OKABE_ITO: dict[str, str] = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
}
GREY = "#7F7F7F"

# method name -> (label, colour, line style). The paper's four methods first.
METHOD_STYLE: dict[str, tuple[str, str, str]] = {
    "grpo_clip_higher": ("GRPO clip-higher", OKABE_ITO["black"], "--"),
    "dppo_topk_kl": ("DPPO-TopK-KL", OKABE_ITO["vermillion"], "-"),
    "predmask_kl_agg": ("Predictive (aggregated tail)", OKABE_ITO["blue"], "-"),
    "predmask_kl_uniform": ("Predictive (uniform tail)", OKABE_ITO["bluish_green"], "-"),
    "predmask_kl_exact": ("Predictive (exact tail)", OKABE_ITO["reddish_purple"], "-"),
    "dppo_topk_tv": ("DPPO-TopK-TV", OKABE_ITO["orange"], ":"),
    "dppo_binary_kl": ("DPPO-Binary-KL", OKABE_ITO["orange"], "-."),
    "dppo_binary_tv": ("DPPO-Binary-TV", OKABE_ITO["sky_blue"], "-."),
    "predmask_tv_agg": ("Predictive TV (aggregated)", OKABE_ITO["sky_blue"], ":"),
    "predmask_tv_uniform": ("Predictive TV (uniform)", OKABE_ITO["yellow"], ":"),
}
METHOD_ORDER: tuple[str, ...] = tuple(METHOD_STYLE)
_FALLBACK = (
    OKABE_ITO["orange"],
    OKABE_ITO["sky_blue"],
    OKABE_ITO["reddish_purple"],
    OKABE_ITO["yellow"],
    GREY,
)

# Token-level criteria (fig3, fig4): same colours as the methods that use them.
CRITERION_STYLE: dict[str, tuple[str, str]] = {
    "ratio": ("Ratio (A·(r−1))", OKABE_ITO["vermillion"]),
    "predictive": ("Predictive, aggregated tail", OKABE_ITO["blue"]),
    "predictive_uniform": ("Predictive, uniform tail", OKABE_ITO["bluish_green"]),
    "predictive_exact": ("Predictive, exact tail", OKABE_ITO["reddish_purple"]),
}

# The paper's model-precision settings, in its panel order; CPU models that stand in for the paper's.
PAPER_MODELS: dict[str, str] = {
    "qwen3_4b_base": "Qwen3-4B-Base",
    "qwen3_8b_base": "Qwen3-8B-Base",
    "qwen3_30b_a3b_base": "Qwen3-30B-A3B-Base",
}
CPU_STAND_INS: dict[str, str] = {
    "cpu_s": "qwen3_4b_base",
    "cpu_m": "qwen3_8b_base",
    "cpu_moe": "qwen3_30b_a3b_base",
}
PRECISION_LABELS: dict[str, str] = {"bf16": "BF16", "fp8_rollout": "FP8 Rollout", "fp8_e2e": "FP8 E2E"}
PAPER_SETTINGS: tuple[tuple[str, str], ...] = (
    ("qwen3_4b_base", "bf16"),
    ("qwen3_8b_base", "bf16"),
    ("qwen3_30b_a3b_base", "fp8_rollout"),
    ("qwen3_30b_a3b_base", "fp8_e2e"),
)

RC: dict[str, object] = {
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "lines.linewidth": 1.4,
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "pdf.fonttype": 3,  # matplotlib's own Type 3 subsetting: several times faster than Type 42 via fontTools
    "pdf.compression": 6,
    "axes.prop_cycle": matplotlib.cycler(color=list(_FALLBACK)),
}


plt.rcParams.update(RC)  # one style for every figure of the process (reports run in their own process)


def method_style(method: str | None, index: int = 0) -> tuple[str, str, str]:
    """(label, colour, line style) of a method; unknown methods get a fallback colour by index."""
    if method in METHOD_STYLE:
        return METHOD_STYLE[method]
    return (method or "unknown method", _FALLBACK[index % len(_FALLBACK)], "-")


def method_rank(method: str | None) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def setting_label(paper_model: str, precision: str | None) -> str:
    """'Qwen3-4B-Base · BF16' for a paper setting (or the raw names when unknown)."""
    model = PAPER_MODELS.get(paper_model, paper_model)
    return f"{model} · {PRECISION_LABELS.get(precision or '', precision or '?')}"


def new_figure(n_rows: int, n_cols: int, panel_w: float = 3.2, panel_h: float = 2.5) -> tuple[Figure, list]:
    """A figure with an n_rows × n_cols grid of axes (returned row-major as a flat list), in the house style."""
    fig, axes = plt.subplots(
        n_rows, n_cols, figsize=(panel_w * n_cols + 0.4, panel_h * n_rows + 0.9), squeeze=False
    )
    return fig, [ax for row in axes for ax in row]


def grid_figure(
    n_rows: int,
    n_cols: int,
    *,
    ax_w: float = 2.7,
    ax_h: float = 1.75,
    left: float = 0.75,
    right: float = 0.2,
    top: float = 0.9,
    bottom: float = 0.8,
    wgap: float = 0.6,
    hgap: float = 0.95,
) -> tuple[Figure, list]:
    """A grid of axes laid out by fixed margins in inches (no tight_layout pass: a third less drawing)."""
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


def empty_panel(ax, message: str) -> None:
    """A labelled empty panel: visible, not silently dropped."""
    ax.text(
        0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color=GREY, fontsize=8, wrap=True
    )
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


def save_figure(fig: Figure, out_dir: Path, name: str, formats: Iterable[str] = ("png", "pdf")) -> list[Path]:
    """Write name.<fmt> for each format atomically (tmp file then os.replace); close the figure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    try:
        for fmt in formats:
            final = out_dir / f"{name}.{fmt}"
            tmp = out_dir / f".{name}.{fmt}.tmp"
            fig.savefig(tmp, format=fmt)
            os.replace(tmp, final)
            paths.append(final)
    finally:
        plt.close(fig)
    return paths


LEGEND_ROW_IN = 0.25  # height of one legend row, inches


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
