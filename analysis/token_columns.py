"""The names of the token-level study (docs/math.md §5): its masks, criteria and columns, spelled once.

A studied step is made with one mask: ``ratio`` (DPPO's: a token is dropped when ``A (r - 1) > 0``) or the
predictive mask of one tail, ``pred_<tail>`` (dropped when ``A Ddot > 0``, Ddot with that tail's estimator). The
statistics call a mask a criterion: ``ratio``, and per tail ``predictive<suffix>``. A seed's row compares each
predictive criterion with the ratio criterion on their disagreement set. The study's compute writes these columns,
the store declares them and the statistics read them: each takes the names from here.
"""

from __future__ import annotations

RATIO = "ratio"
#: the unmasked reference step, which keeps every token
REFERENCE_MASK = "all"
#: tail -> its Ddot estimator (``predmask.predicted_divergence_change``'s ``tail``), in the columns' order
TAILS: dict[str, str] = {"agg": "aggregated", "uniform": "uniform", "exact": "exact"}
#: the tail of the paper's criterion, whose comparison's per-seed columns carry no suffix
HEADLINE_TAIL = "agg"
#: the own-update ground truth: first-order change of D through the network, SGD direction, A's sign included
#: (> 0: keeping the token's update raises its D)
OWN_UPDATE = "ddot_net"
#: the own update through Adam's preconditioner
OWN_UPDATE_ADAM = "ddot_net_adam"
#: the same-token counterfactual: D after the step with the token's gradient minus without it
COUNTERFACTUAL = "dd_cf"
#: the id of the token's (context, sampled token) pair
CONTEXT_ID = "context_id"
#: network-aware ground truths, whose sign is compared with the logit-space prediction A · Ddot
NETWORK_TRUTHS: tuple[str, ...] = (OWN_UPDATE, OWN_UPDATE_ADAM)


def predictive_mask(tail: str) -> str:
    return f"pred_{tail}"


def suffix(tail: str) -> str:
    """The suffix of the predictive criterion of ``tail`` and of its comparison's per-seed columns."""
    return "" if tail == HEADLINE_TAIL else f"_{tail}"


def keep_column(mask: str) -> str:
    return f"keep_{mask}"


def dd_column(mask: str) -> str:
    return f"dd_{mask}"


def ddot_column(tail: str) -> str:
    return f"ddot_{tail}"


def disagree_column(suffix: str) -> str:
    return f"n_disagree{suffix}"


def ratio_side(suffix: str) -> str:
    """The ratio criterion as one side of the comparison of ``suffix`` (its per-seed columns' name)."""
    return f"{RATIO}{suffix}"


def count_columns(side: str) -> tuple[str, str, str]:
    """The per-seed counts of one side on its disagreement set: kept, unsafe (dD > 0), corrective (dD < 0)."""
    return f"n_keep_{side}", f"n_unsafe_{side}", f"n_corrective_{side}"


def counterfactual_column(mode: str) -> str:
    """The counterfactual of one mode, as the ground-truth compute returns it."""
    return f"{COUNTERFACTUAL}_{mode}"


def unsafe_keep_column(side: str) -> str:
    return f"unsafe_keep_{side}"


#: the dD column of the unmasked reference step
DD_ALL = dd_column(REFERENCE_MASK)
#: predictive criterion -> its tail
PREDICTIVE_TAILS: dict[str, str] = {f"predictive{suffix(t)}": t for t in TAILS}
#: the paper's criterion (the predictive mask with the aggregated tail)
HEADLINE = f"predictive{suffix(HEADLINE_TAIL)}"
#: Ddot column -> its tail estimator
TAIL_COLUMNS: dict[str, str] = {ddot_column(t): estimator for t, estimator in TAILS.items()}
#: criterion -> the mask of its studied step
CRITERION_MASKS: dict[str, str] = {RATIO: RATIO, **{c: predictive_mask(t) for c, t in PREDICTIVE_TAILS.items()}}
#: criterion -> (keep column, dD column of the update made with that criterion's mask)
CRITERIA: dict[str, tuple[str, str]] = {c: (keep_column(m), dd_column(m)) for c, m in CRITERION_MASKS.items()}
#: predictive criterion -> (Ddot column, suffix of the per-seed columns of its comparison with the ratio criterion)
PREDICTIVE: dict[str, tuple[str, str]] = {c: (ddot_column(t), suffix(t)) for c, t in PREDICTIVE_TAILS.items()}
