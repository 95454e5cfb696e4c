"""predmask: the predictive divergence mask and its baselines as pure-torch losses (no verl import here).

The catalogues: ``predmask.methods`` (methods and the registries of their behaviour), ``predmask.divergence``
(divergences, tail estimators), ``predmask.precisions``, ``predmask.metrics``. Imports are lazy (PEP 562), so that
``import predmask.io`` or ``predmask.config`` does not pay for torch; the names below are the public API.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: module -> the names it exports here
_MODULE_EXPORTS: dict[str, tuple[str, ...]] = {
    "divergence": ("DIVERGENCES", "MASS_FLOOR", "TAILS", "Coarse", "Divergence", "coarse_distributions",
                   "get_divergence", "get_tail", "predicted_divergence_change", "register_divergence",
                   "register_tail", "topk_divergence"),
    "hidden_gather": ("gather_support_logprobs_from_hidden",),
    "methods": ("DIRECTIONS", "LOSS_AGG_MODES", "LOSS_KINDS", "METHODS", "SUPPORTS", "Method", "MethodParams",
                "agg_loss", "get_method", "method_config", "policy_loss", "register_direction",
                "register_method"),
    "metrics": ("METRICS", "Metric", "reduce_metrics"),
    "precisions": ("PRECISIONS", "Precision", "get_precision"),
    "support": ("TopKSupport", "binary_support_valid", "build_support", "gather_support_logprobs"),
}
_EXPORTS: dict[str, str] = {name: module for module, names in _MODULE_EXPORTS.items() for name in names}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"predmask.{_EXPORTS[name]}"), name)
    if name in _MODULE_EXPORTS:
        return importlib.import_module(f"predmask.{name}")
    raise AttributeError(f"module 'predmask' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_MODULE_EXPORTS})
