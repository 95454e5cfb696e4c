"""The one look of every report figure: rc parameters, Okabe-Ito colours, line styles keyed by method name."""

from __future__ import annotations

import matplotlib

from analysis.token_columns import PREDICTIVE_TAILS, RATIO, TAILS

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

# method name -> (colour, line style), in the order methods are listed (the paper's four first). Labels: conf/.
METHOD_STYLE: dict[str, tuple[str, str]] = {
    "grpo_clip_higher": (OKABE_ITO["black"], "--"),
    "dppo_topk_kl": (OKABE_ITO["vermillion"], "-"),
    "predmask_kl_agg": (OKABE_ITO["blue"], "-"),
    "predmask_kl_uniform": (OKABE_ITO["bluish_green"], "-"),
    "predmask_kl_exact": (OKABE_ITO["reddish_purple"], "-"),
    "dppo_topk_tv": (OKABE_ITO["orange"], ":"),
    "dppo_binary_kl": (OKABE_ITO["orange"], "-."),
    "dppo_binary_tv": (OKABE_ITO["sky_blue"], "-."),
    "predmask_binary_kl": (OKABE_ITO["blue"], "-."),
    "predmask_tv_agg": (OKABE_ITO["sky_blue"], ":"),
    "predmask_tv_uniform": (OKABE_ITO["yellow"], ":"),
    # The variational family: baselines first, then the three estimators; a recipe's data setting picks the
    # marker and the fill (VR_DATA_STYLE), its estimator the colour.
    "prior": (GREY, ":"),
    "sft": (OKABE_ITO["orange"], "--"),
    "rft": (OKABE_ITO["sky_blue"], "--"),
    "grpo": (OKABE_ITO["black"], "-."),
    "vr_acc": (OKABE_ITO["vermillion"], "-"),
    "vr_gml": (OKABE_ITO["blue"], "-"),
    "vr_likelihood": (OKABE_ITO["bluish_green"], "-"),
}
METHOD_ORDER: tuple[str, ...] = tuple(METHOD_STYLE)

# data setting of a final recipe -> (marker, filled, line style): all K weighted traces solid and filled, the best
# trace mixed with the original data hollow and dashed; no data setting (baselines): a square; an unknown one: a
# triangle (VR_UNKNOWN_DATA).
VR_DATA_STYLE: dict[str | None, tuple[str, bool, str]] = {
    "all_weighted": ("o", True, "-"),
    "best_mixed": ("D", False, "--"),
    None: ("s", True, "-"),
}
VR_UNKNOWN_DATA = ("^", True, ":")
_FALLBACK = (
    OKABE_ITO["orange"],
    OKABE_ITO["sky_blue"],
    OKABE_ITO["reddish_purple"],
    OKABE_ITO["yellow"],
    GREY,
)

# Token-level criteria (fig3, fig4): same colours as the methods that use them; the predictive criteria's colours
# follow analysis.token_columns.TAILS' order (aggregated, uniform, exact).
CRITERION_STYLE: dict[str, tuple[str, str]] = {
    RATIO: ("Ratio (A·(r−1))", OKABE_ITO["vermillion"]),
    **{criterion: (f"Predictive, {TAILS[tail]} tail", OKABE_ITO[colour]) for (criterion, tail), colour
       in zip(PREDICTIVE_TAILS.items(), ("blue", "bluish_green", "reddish_purple"), strict=True)},
}

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


# A training line's markers (its legend shows one): every method a shape of its own, so a line drawn under another
# still shows its markers (the figures stagger the markers of a panel's lines so that no two share a point).
# The training methods are METHOD_ORDER's first eleven.
METHOD_MARKER: dict[str, str] = dict(zip(METHOD_ORDER, "so^vDPXh<>*"))
_FALLBACK_MARKERS = ("p", "8", "H", "d", "1")


def method_marker(method: str | None, index: int = 0) -> str:
    """The marker shape of a method's training line; unknown methods get a fallback shape by index."""
    return METHOD_MARKER.get(method or "", _FALLBACK_MARKERS[index % len(_FALLBACK_MARKERS)])


def method_style(method: str | None, index: int = 0) -> tuple[str, str]:
    """(colour, line style) of a method; unknown methods get a fallback colour by index."""
    return METHOD_STYLE.get(method or "", (_FALLBACK[index % len(_FALLBACK)], "-"))


def method_rank(method: str | None) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)
