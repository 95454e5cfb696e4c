"""Each direction criterion judged against each per-token ground truth on the same tokens (docs/math.md §5.1).

docs/math.md §5.1 defines when a decision is right, the token sets (``TOKEN_SETS``), the ground truths
(``TRUTHS``, judged when their column is present), the rates, the constant predictor and the sign agreement.
A token whose truth is not finite is left out of that truth's judgement and counted in ``n_missing``. Pooled
statistics have seed-cluster bootstrap intervals over every seed of the token frame (a seed with no token in the
set counts with zero counts); each criterion but the ratio's is compared with the ratio criterion seed by seed
(``analysis.paired``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import astuple, dataclass

import numpy as np
import polars as pl

from analysis import token_columns
from analysis.paired import (
    BOOTSTRAP_SEED,
    RESAMPLES,
    ClusterInterval,
    PairedComparison,
    cluster_bootstrap,
    cluster_bootstrap_ratio,
    paired_comparison,
    wilson_interval,
    z_of,
)
from analysis.token_columns import CONTEXT_ID, CRITERIA, DD_ALL, HEADLINE, PREDICTIVE, RATIO, TAIL_COLUMNS
from analysis.token_level.summary.study_stats import DISAGREE_SET
from analysis.training.stats import CONFIDENCE

OUTSIDE = "outside"
#: disagreement set -> the predictive criterion that decides differently from the ratio criterion there
_DISAGREE_SETS: dict[str, str] = {f"{DISAGREE_SET}{suffix}": crit for crit, (_ddot, suffix) in PREDICTIVE.items()}
#: token set -> what it holds
TOKEN_SETS: dict[str, str] = {
    OUTSIDE: "outside tokens with A != 0",
    **{name: f"outside tokens where the ratio criterion and {crit} decide differently"
       for name, crit in _DISAGREE_SETS.items()},
}
#: ground-truth column -> what ``> 0`` means for the token (keeping its update increases its divergence)
TRUTHS: dict[str, str] = {
    token_columns.OWN_UPDATE: "own-update first-order change of D, network-aware (SGD)",
    token_columns.OWN_UPDATE_ADAM: "own-update first-order change of D, network-aware (Adam's preconditioner)",
    token_columns.COUNTERFACTUAL: "D after the step with the token's gradient minus without it",
    DD_ALL: "realised dD of the step that keeps every token",
}
RISES, FALLS = "rises", "falls"

# per-seed count columns, in this order: right decisions, tokens, true positives, positives, true negatives, negatives
_RIGHT, _N, _TP, _POS, _TN, _NEG = range(6)


def _check(tokens: pl.DataFrame, names: Iterable[str], what: str) -> None:
    missing = [c for c in names if c not in tokens.columns]
    if missing:
        raise ValueError(
            f"{what} needs token columns {', '.join(missing)}; the frame has {', '.join(tokens.columns)}"
        )


def token_set(tokens: pl.DataFrame, name: str) -> pl.DataFrame:
    """The tokens of one token set (``TOKEN_SETS``)."""
    if name not in TOKEN_SETS:
        raise ValueError(f"unknown token set {name!r}; valid: {', '.join(TOKEN_SETS)}")
    if name == OUTSIDE:
        _check(tokens, ["a"], "the outside set")
        return tokens.filter(pl.col("a") != 0)
    keep_pred, keep_ratio = CRITERIA[_DISAGREE_SETS[name]][0], CRITERIA[RATIO][0]
    _check(tokens, [keep_ratio, keep_pred], f"token set {name}")
    return tokens.filter(pl.col(keep_ratio) != pl.col(keep_pred))


def _finite(column: str) -> pl.Expr:
    return pl.col(column).is_not_null() & pl.col(column).cast(pl.Float64).is_finite()


def _per_seed(frame: pl.DataFrame, seeds: np.ndarray, *counts: pl.Expr) -> np.ndarray:
    """Seeds × len(counts) sums of ``counts`` over each seed's rows of ``frame``, zero for seeds without rows."""
    per = frame.group_by("seed").agg(*(c.sum().alias(f"c{i}") for i, c in enumerate(counts)))
    full = pl.DataFrame({"seed": seeds}, schema={"seed": frame.schema["seed"]}).join(per, on="seed", how="left")
    return full.drop("seed").fill_null(0).to_numpy().astype(float)


def _seed_counts(judged: pl.DataFrame, seeds: np.ndarray, drop: pl.Expr, truth: str) -> np.ndarray:
    """Seeds × 6 counts (right, tokens, TP, positives, TN, negatives) of one decision, zero for seeds without tokens."""
    pos = pl.col(truth) > 0
    return _per_seed(judged, seeds, drop == pos, pl.len(), drop & pos, pos, ~drop & ~pos, ~pos)


def _rates(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy and balanced accuracy of count rows (NaN where undefined)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = c[..., _RIGHT] / c[..., _N]
        bal = 0.5 * (c[..., _TP] / c[..., _POS] + c[..., _TN] / c[..., _NEG])
    return acc, bal


def _accuracy(sums: np.ndarray) -> np.ndarray:
    return _rates(sums)[0]


def _balanced(sums: np.ndarray) -> np.ndarray:
    return _rates(sums)[1]


@dataclass(frozen=True)
class Judgement:
    """One criterion against one ground truth on one token set: pooled rates with intervals, per-seed rates, and
    (for every criterion but the ratio's) the paired per-seed comparison with the ratio criterion."""

    token_set: str
    truth: str
    criterion: str
    seeds: np.ndarray  # every seed of the token frame, ascending
    counts: np.ndarray  # seeds × 6: right, tokens, TP, positives, TN, negatives
    n_contexts: int | None  # distinct context_id values among the judged tokens; None without that column
    n_missing: int  # tokens of the set whose truth is not finite, left out
    level: float
    share_positive: ClusterInterval
    accuracy: ClusterInterval
    accuracy_wilson: tuple[float, float]  # assumes independent tokens
    balanced_accuracy: ClusterInterval
    constant_class: str  # "rises" (drop every token) or "falls" (keep every token)
    constant_accuracy: ClusterInterval
    constant_balanced_accuracy: float | None  # 0.5, None when the tokens hold one class only
    vs_ratio_accuracy: PairedComparison | None
    vs_ratio_balanced: PairedComparison | None

    @property
    def n_tokens(self) -> int:
        return int(self.counts[:, _N].sum())

    @property
    def seed_accuracy(self) -> np.ndarray:
        return _rates(self.counts)[0]

    @property
    def seed_balanced_accuracy(self) -> np.ndarray:
        return _rates(self.counts)[1]


def _carried(tokens: pl.DataFrame, column: str) -> bool:
    """The study recorded ``column``: present with a value (a database gives a study that never computed a column,
    because another study did, an all-NULL one)."""
    if column not in tokens.columns:
        return False
    return tokens.height == 0 or tokens.get_column(column).null_count() < tokens.height


def _criteria(tokens: pl.DataFrame) -> list[str]:
    return [c for c, (keep, _dd) in CRITERIA.items() if _carried(tokens, keep)]


def judge(
    tokens: pl.DataFrame,
    set_name: str,
    truth: str,
    *,
    level: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, Judgement]:
    """criterion -> its Judgement against ``truth`` on the token set ``set_name`` of ``tokens`` (outside tokens of
    one study, all its seeds), for every criterion whose keep column the frame has."""
    if truth not in TRUTHS:
        raise ValueError(f"unknown ground truth {truth!r}; valid: {', '.join(TRUTHS)}")
    _check(tokens, ["seed", truth, CRITERIA[RATIO][0]], f"judging against {truth}")
    seeds = np.sort(tokens.get_column("seed").unique().to_numpy())
    in_set = token_set(tokens, set_name)
    judged = in_set.filter(_finite(truth))
    n_contexts = judged.get_column(CONTEXT_ID).n_unique() if CONTEXT_ID in judged.columns else None
    kw = {"level": level, "resamples": resamples, "seed": seed}
    counts = {
        c: _seed_counts(judged, seeds, ~pl.col(CRITERIA[c][0]).cast(pl.Boolean), truth)
        for c in _criteria(tokens)
    }
    first = counts[RATIO]
    pos, n = first[:, _POS], first[:, _N]
    constant = RISES if 2 * pos.sum() >= n.sum() else FALLS
    majority = pos if constant == RISES else first[:, _NEG]
    both_classes = pos.sum() > 0 and first[:, _NEG].sum() > 0
    share = cluster_bootstrap_ratio(pos, n, **kw)
    const_acc = cluster_bootstrap_ratio(majority, n, **kw)
    ratio_acc, ratio_bal = _rates(first)
    z = z_of(level)
    out: dict[str, Judgement] = {}
    for crit, c in counts.items():
        acc, bal = _rates(c)
        out[crit] = Judgement(
            token_set=set_name,
            truth=truth,
            criterion=crit,
            seeds=seeds,
            counts=c,
            n_contexts=n_contexts,
            n_missing=in_set.height - judged.height,
            level=level,
            share_positive=share,
            accuracy=cluster_bootstrap(c, _accuracy, **kw),
            accuracy_wilson=wilson_interval(int(c[:, _RIGHT].sum()), int(c[:, _N].sum()), z),
            balanced_accuracy=cluster_bootstrap(c, _balanced, **kw),
            constant_class=constant,
            constant_accuracy=const_acc,
            constant_balanced_accuracy=0.5 if both_classes else None,
            vs_ratio_accuracy=None if crit == RATIO else paired_comparison(acc, ratio_acc, level),
            vs_ratio_balanced=None if crit == RATIO else paired_comparison(bal, ratio_bal, level),
        )
    return out


_F, _I, _S = pl.Float64, pl.Int64, pl.String


def _interval_columns(prefix: str, wilson: bool = False) -> dict[str, pl.DataType]:
    """A pooled rate with its seed-cluster interval; with ``wilson``, its Wilson score interval too (which assumes
    independent tokens)."""
    names = ("", "_lo", "_hi", *(("_wilson_indep_lo", "_wilson_indep_hi") if wilson else ()))
    return {f"{prefix}{name}": _F for name in names}


def _paired_columns(prefix: str) -> dict[str, pl.DataType]:
    names = {"mean": _F, "lo": _F, "hi": _F, "seeds": _I, "lower": _I, "tied": _I, "higher": _I}
    tests = {"sign_p": _F, "wilcoxon_p": _F, "note": _S}
    return {f"{prefix}_{k}": v for k, v in {**names, **tests}.items()}


#: the long table of ``criteria_table``: one row per token set × ground truth × criterion
CRITERIA_COLUMNS: dict[str, pl.DataType] = {
    "token_set": _S,
    "truth": _S,
    "criterion": _S,
    "level": _F,
    "resamples": _I,
    "n_seeds": _I,
    "n_tokens": _I,
    "n_contexts": _I,
    "n_missing": _I,
    **_interval_columns("share_positive"),
    **_interval_columns("accuracy", wilson=True),
    **_interval_columns("balanced_accuracy"),
    "constant_class": _S,
    **_interval_columns("constant_accuracy"),
    "constant_balanced_accuracy": _F,
    **_paired_columns("vs_ratio_accuracy"),
    **_paired_columns("vs_ratio_balanced"),
}


def _interval_row(
    prefix: str, ci: ClusterInterval, wilson: tuple[float, float] | tuple[()] = ()
) -> dict[str, float | None]:
    values = (ci.estimate, ci.lo, ci.hi, *(x if np.isfinite(x) else None for x in wilson))
    return dict(zip(_interval_columns(prefix, wilson=bool(wilson)), values))


def _paired_row(prefix: str, cmp: PairedComparison | None) -> dict[str, object]:
    if cmp is None:
        return dict.fromkeys(_paired_columns(prefix))
    return dict(zip(_paired_columns(prefix), (*astuple(cmp.estimate), cmp.note)))


def _judgement_row(j: Judgement) -> dict[str, object]:
    return {
        "token_set": j.token_set,
        "truth": j.truth,
        "criterion": j.criterion,
        "level": j.level,
        "resamples": j.accuracy.resamples,
        "n_seeds": int(j.seeds.size),
        "n_tokens": j.n_tokens,
        "n_contexts": j.n_contexts,
        "n_missing": j.n_missing,
        **_interval_row("share_positive", j.share_positive),
        **_interval_row("accuracy", j.accuracy, j.accuracy_wilson),
        **_interval_row("balanced_accuracy", j.balanced_accuracy),
        "constant_class": j.constant_class,
        **_interval_row("constant_accuracy", j.constant_accuracy),
        "constant_balanced_accuracy": j.constant_balanced_accuracy,
        **_paired_row("vs_ratio_accuracy", j.vs_ratio_accuracy),
        **_paired_row("vs_ratio_balanced", j.vs_ratio_balanced),
    }


def _can_form(tokens: pl.DataFrame, name: str) -> bool:
    if name == OUTSIDE:
        return True
    return _carried(tokens, CRITERIA[_DISAGREE_SETS[name]][0])


def judge_all(
    tokens: pl.DataFrame,
    *,
    level: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> list[Judgement]:
    """Every criterion against every ground truth the frame has, on every token set it can form."""
    truths = [t for t in TRUTHS if t in tokens.columns]
    sets = [s for s in TOKEN_SETS if _can_form(tokens, s)]
    kw = {"level": level, "resamples": resamples, "seed": seed}
    return [j for s in sets for t in truths for j in judge(tokens, s, t, **kw).values()]


def criteria_table(judgements: Iterable[Judgement]) -> pl.DataFrame:
    """Judgements as a long table: one row per token set × ground truth × criterion (``CRITERIA_COLUMNS``)."""
    return pl.DataFrame([_judgement_row(j) for j in judgements], schema=CRITERIA_COLUMNS)


#: the table of ``per_seed_table``: one row per token set × ground truth × criterion × seed
PER_SEED_COLUMNS: dict[str, pl.DataType] = {
    "token_set": _S,
    "truth": _S,
    "criterion": _S,
    "seed": _I,
    "n_tokens": _I,
    "n_right": _I,
    "accuracy": _F,
    "balanced_accuracy": _F,
}


def per_seed_table(judgements: Iterable[Judgement]) -> pl.DataFrame:
    """The per-seed rates behind judgements: one row per token set × ground truth × criterion × seed
    (``PER_SEED_COLUMNS``; no judgement: an empty table with those columns)."""
    frames = [
        pl.DataFrame(
            {
                "token_set": j.token_set,
                "truth": j.truth,
                "criterion": j.criterion,
                "seed": j.seeds.astype(np.int64),
                "n_tokens": j.counts[:, _N].astype(np.int64),
                "n_right": j.counts[:, _RIGHT].astype(np.int64),
                "accuracy": j.seed_accuracy,
                "balanced_accuracy": j.seed_balanced_accuracy,
            },
            schema=PER_SEED_COLUMNS,
        ).with_columns(pl.col("accuracy", "balanced_accuracy").fill_nan(None))
        for j in judgements
    ]
    return pl.concat(frames) if frames else pl.DataFrame(schema=PER_SEED_COLUMNS)


@dataclass(frozen=True)
class Agreement:
    """How often a network-aware truth and the logit-space prediction ``A · Ddot`` agree in sign, pooled over seeds."""

    truth: str
    ddot: str
    seeds: np.ndarray
    counts: np.ndarray  # seeds × 2: agreeing tokens, tokens
    agreement: ClusterInterval
    wilson: tuple[float, float]  # assumes independent tokens

    @property
    def n_tokens(self) -> int:
        return int(self.counts[:, 1].sum())


def sign_agreement(
    tokens: pl.DataFrame,
    truth: str = token_columns.OWN_UPDATE,
    ddot: str = PREDICTIVE[HEADLINE][0],
    *,
    level: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Agreement:
    """The share of ``outside`` tokens (both values finite) where ``sign(truth) == sign(A * ddot)``."""
    if truth not in token_columns.NETWORK_TRUTHS:
        raise ValueError(
            f"sign agreement compares a network-aware truth; got {truth!r}, valid: {token_columns.NETWORK_TRUTHS}"
        )
    if ddot not in TAIL_COLUMNS:
        raise ValueError(f"unknown logit-space Ddot column {ddot!r}; valid: {', '.join(TAIL_COLUMNS)}")
    _check(tokens, ["seed", "a", truth, ddot], "sign agreement")
    seeds = np.sort(tokens.get_column("seed").unique().to_numpy())
    live = token_set(tokens, OUTSIDE).filter(_finite(truth) & _finite(ddot))
    agree = pl.col(truth).sign() == (pl.col("a") * pl.col(ddot)).sign()
    counts = _per_seed(live, seeds, agree, pl.len())
    k, n = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    return Agreement(
        truth=truth,
        ddot=ddot,
        seeds=seeds,
        counts=counts,
        agreement=cluster_bootstrap_ratio(
            counts[:, 0], counts[:, 1], level=level, resamples=resamples, seed=seed
        ),
        wilson=wilson_interval(k, n, z_of(level)),
    )


#: the table of ``agreement_table``: one row per network-aware truth × logit-space Ddot
AGREEMENT_COLUMNS: dict[str, pl.DataType] = {
    "truth": _S,
    "ddot": _S,
    "level": _F,
    "n_seeds": _I,
    "n_tokens": _I,
    **_interval_columns("agreement", wilson=True),
}


def agreement_table(
    tokens: pl.DataFrame,
    *,
    level: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> pl.DataFrame:
    """Sign agreement of every network-aware truth with every logit-space Ddot the frame has (``AGREEMENT_COLUMNS``)."""
    rows = []
    for truth in (t for t in token_columns.NETWORK_TRUTHS if t in tokens.columns):
        for ddot in (d for d in TAIL_COLUMNS if d in tokens.columns):
            g = sign_agreement(tokens, truth, ddot, level=level, resamples=resamples, seed=seed)
            rows.append(
                {
                    "truth": truth,
                    "ddot": ddot,
                    "level": level,
                    "n_seeds": int(g.seeds.size),
                    "n_tokens": g.n_tokens,
                    **_interval_row("agreement", g.agreement, g.wilson),
                }
            )
    return pl.DataFrame(rows, schema=AGREEMENT_COLUMNS)
