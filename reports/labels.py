"""Display labels of methods, models, precisions and settings, the paper's settings (read from conf/), and the
size of the runs' evaluation splits (read from their recorded configs). An option conf/ no longer has is
labelled by its raw name, so its runs still draw.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from predmask import config


@cache
def _options(group: str) -> frozenset[str]:
    return frozenset(config.group_options(group))


@cache
def _label(group: str, name: str | None, unknown: str) -> str:
    if not name:
        return unknown
    return config.known_label(group, name)


def method_label(method: str | None) -> str:
    """'DPPO-TopK-KL' for a method of conf/method (its raw name when conf/ has no such method)."""
    return _label("method", method, "unknown method")


def model_label(model: str | None) -> str:
    """'Qwen3-4B-Base' for a model of conf/model (its raw name when conf/ has no such model)."""
    return _label("model", model, "?")


def precision_label(precision: str | None) -> str:
    """'FP8 Rollout' for a precision of conf/precision (its raw name when conf/ has no such precision)."""
    return _label("precision", precision, "?")


def setting_label(paper_model: str, precision: str | None) -> str:
    """'Qwen3-4B-Base · BF16' for a paper setting (or the raw names when unknown)."""
    return f"{model_label(paper_model)} · {precision_label(precision)}"


@cache
def cpu_standin(paper_model: str) -> str | None:
    """The CPU model that trains in place of a paper model on the CPU engine (None for a model conf/ lacks)."""
    if paper_model not in _options("model"):
        return None
    return str(config.cpu_standin(config.group_entry("model", paper_model))["name"])


def sweep_axis(sweep: str, key: str) -> tuple[str, ...]:
    """The values a sweep of conf/sweep runs over one axis, e.g. ``sweep_axis("main_comparison", "method")``."""
    return tuple(config.sweep_params(sweep)[key].split(","))


def sweep_delta(sweep: str) -> float:
    """The trust-region threshold δ of a sweep of conf/sweep (one line naming the valid sweeps when unknown)."""
    return float(config.group_entry("sweep", sweep)["delta"])


@cache
def setting_choice(setting: str) -> tuple[str, str]:
    """(model, precision) that a setting of conf/setting selects."""
    choices = config.option_choices("setting", setting)
    return choices["model"], choices["precision"]


def split_size_text(configs: Iterable[Mapping[str, Any]]) -> str:
    """'n = 30 problems per evaluation split' from the runs' recorded configs (``task.eval_size``; a range when they
    differ), '' when none records one (e.g. a cluster run on the real AIME files)."""
    sizes = sorted({n for c in configs if isinstance(task := c.get("task"), Mapping)
                    and isinstance(n := task.get("eval_size"), int)})
    if not sizes:
        return ""
    return f"n = {sizes[0] if len(sizes) == 1 else f'{sizes[0]}–{sizes[-1]}'} problems per evaluation split"


def paper_settings() -> tuple[tuple[str, str], ...]:
    """The paper's (model, precision) settings in its panel order: the main comparison's setting axis."""
    return tuple(setting_choice(s) for s in sweep_axis("main_comparison", "+setting"))


# ------------------------------------------------------------------------------------ variational family

#: the runs table's method of the stage run that evaluates π_θ0 (a stage of the family, not a recipe of
#: conf/vr_method; its label says what it is)
VR_PRIOR = "prior"
_VR_PRIOR_LABEL = "π_θ0 (cached base model)"

#: the final recipes' data settings (``method.data`` of conf/vr_method) in words
VR_DATA_LABELS: dict[str, str] = {
    "all_weighted": "all K traces, weighted",
    "best_mixed": "best trace + original data",
}


def vr_method_label(method: str | None) -> str:
    """'VR (acc weights)' for a recipe of conf/vr_method, 'GRPO' for a method of conf/method, the prior stage's
    label, else the raw name."""
    if method == VR_PRIOR:
        return _VR_PRIOR_LABEL
    if method in _options("vr_method"):
        return _label("vr_method", method, "unknown method")
    return method_label(method)


def vr_data_label(data: str | None) -> str:
    """A final recipe's data setting in words (its raw name when unknown)."""
    return VR_DATA_LABELS.get(data or "", data or "")


#: the accuracy-weighting analysis's methods (analysis.accuracy_weighting) that are no recipe of conf/
_WEIGHTING_LABELS: dict[str, str] = {
    "reinforce": "REINFORCE (0–1 reward)",
    "vr": "variational objective",
}
WEIGHTING_ORDER: tuple[str, ...] = ("reinforce", "grpo", "rft", "vr")


def weighting_method_label(method: str | None) -> str:
    """A method of the accuracy-weighting analysis in words (a recipe's label where conf/ has it)."""
    return _WEIGHTING_LABELS.get(method or "", vr_method_label(method))
