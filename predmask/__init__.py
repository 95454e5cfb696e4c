"""predmask: the predictive divergence mask and its baselines as pure-torch losses (no verl import here)."""

from predmask.divergence import (
    DIVERGENCES,
    MASS_FLOOR,
    TAILS,
    Coarse,
    coarse_distributions,
    predicted_divergence_change,
    topk_divergence,
)
from predmask.methods import (
    LOSS_AGG_MODES,
    METHODS,
    Method,
    MethodParams,
    agg_loss,
    get_method,
    policy_loss,
    register_method,
)
from predmask.support import TopKSupport, binary_support_valid, build_support, gather_support_logprobs

__version__ = "0.1.0"

__all__ = [
    "DIVERGENCES",
    "LOSS_AGG_MODES",
    "MASS_FLOOR",
    "METHODS",
    "TAILS",
    "Coarse",
    "Method",
    "MethodParams",
    "TopKSupport",
    "agg_loss",
    "binary_support_valid",
    "build_support",
    "coarse_distributions",
    "gather_support_logprobs",
    "get_method",
    "policy_loss",
    "predicted_divergence_change",
    "register_method",
    "topk_divergence",
]
