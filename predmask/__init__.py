"""predmask: the predictive divergence mask and its baselines as pure-torch losses (no verl import here).

The catalogues: ``predmask.methods`` (methods and the registries of their behaviour), ``predmask.divergence``
(divergences, tail estimators), ``predmask.precisions``, ``predmask.metrics``. Imports are lazy (PEP 562), so that
``import predmask.io`` or ``predmask.config`` does not pay for torch; the names below are the public API.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "DIVERGENCES": "divergence",
    "MASS_FLOOR": "divergence",
    "TAILS": "divergence",
    "Coarse": "divergence",
    "Divergence": "divergence",
    "coarse_distributions": "divergence",
    "get_divergence": "divergence",
    "get_tail": "divergence",
    "predicted_divergence_change": "divergence",
    "register_divergence": "divergence",
    "register_tail": "divergence",
    "topk_divergence": "divergence",
    "gather_support_logprobs_from_hidden": "hidden_gather",
    "DIRECTIONS": "methods",
    "LOSS_AGG_MODES": "methods",
    "LOSS_KINDS": "methods",
    "METHODS": "methods",
    "SUPPORTS": "methods",
    "Method": "methods",
    "MethodParams": "methods",
    "agg_loss": "methods",
    "get_method": "methods",
    "method_config": "methods",
    "policy_loss": "methods",
    "register_direction": "methods",
    "register_method": "methods",
    "METRICS": "metrics",
    "Metric": "metrics",
    "reduce_metrics": "metrics",
    "PRECISIONS": "precisions",
    "Precision": "precisions",
    "get_precision": "precisions",
    "TopKSupport": "support",
    "binary_support_valid": "support",
    "build_support": "support",
    "gather_support_logprobs": "support",
}
_SUBMODULES = ("divergence", "hidden_gather", "methods", "metrics", "precisions", "support")

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"predmask.{_EXPORTS[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"predmask.{name}")
    raise AttributeError(f"module 'predmask' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})
