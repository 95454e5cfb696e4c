"""The metric catalogue: every metric name a run writes (CPU engine or verl), how it aggregates, and what it means.

Names follow verl's; the mask metrics live under ``actor/mask/``. A name with ``{placeholders}`` is a family
(one metric per validation data source and sample count). A ``mean`` of the policy loss names its ``weight``,
the count it is taken over, so that micro-batches and ranks merge exactly (:func:`merge_micro_batches`) before
a step's mini-batches reduce (:func:`reduce_metrics`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Reduce = Literal["sum", "mean", "max", "min"]


@dataclass(frozen=True)
class Metric:
    """One metric: its name (or family template), how values combine across micro-batches and steps, its meaning."""

    name: str
    reduce: Reduce
    meaning: str
    wall_clock: bool = False
    #: for a ``mean`` over tokens: the count metric it is taken over (merges micro-batches exactly)
    weight: str | None = None


# -- names used in code (the constants are the names; METRICS below says what each means)
PPO_KL = "actor/ppo_kl"
CLIPFRAC = "actor/pg_clipfrac"
CLIPFRAC_LOWER = "actor/pg_clipfrac_lower"
ACTOR_PG_LOSS = "actor/pg_loss"
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_LR = "actor/lr"
MASK_TOKENS = "actor/mask/tokens"
MASK_ADV_TOKENS = "actor/mask/adv_tokens"
MASK_DIVERGENCE_MEAN = "actor/mask/divergence_mean"
MASK_DIVERGENCE_MAX = "actor/mask/divergence_max"
MASK_OUTSIDE_FRAC = "actor/mask/outside_frac"
MASK_MU_TAIL_CLAMPED = "actor/mask/mu_tail_clamped"
MASK_PI_TAIL_CLAMPED = "actor/mask/pi_tail_clamped"
MASK_DIRECTION_DISAGREE = "actor/mask/direction_disagree"
MASK_PI_SAMPLED_GAP = "actor/mask/pi_sampled_gap"
MISMATCH_TOPK_KL = "rollout_corr/topk_kl"
MISMATCH_TOPK_KL_MAX = "rollout_corr/topk_kl_max"
MISMATCH_KL = "rollout_corr/kl"
SCORE_MEAN = "critic/score/mean"
SCORE_MAX = "critic/score/max"
SCORE_MIN = "critic/score/min"
REWARDS_MEAN = "critic/rewards/mean"
ADVANTAGES_MEAN = "critic/advantages/mean"
ADVANTAGES_MAX = "critic/advantages/max"
ADVANTAGES_MIN = "critic/advantages/min"
RESPONSE_LENGTH_MEAN = "response_length/mean"
RESPONSE_LENGTH_MAX = "response_length/max"
RESPONSE_LENGTH_MIN = "response_length/min"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"
PROMPT_LENGTH_MEAN = "prompt_length/mean"
TOPK_TAIL_MASS_MEAN = "rollout/topk_tail_mass/mean"
TOPK_TAIL_MASS_MAX = "rollout/topk_tail_mass/max"
TIMING_GEN = "timing_s/gen"
TIMING_UPDATE_ACTOR = "timing_s/update_actor"
TIMING_STEP = "timing_s/step"
TIMING_TESTING = "timing_s/testing"
PERF_TOTAL_NUM_TOKENS = "perf/total_num_tokens"
PERF_THROUGHPUT = "perf/throughput"
GLOBAL_STEP = "training/global_step"
#: families: one metric per validation data source ``source`` and samples per problem ``n`` (avg@n)
VAL_CORE_PREFIX = "val-core/"
VAL_ACC = "val-core/{source}/acc/mean@{n}"
VAL_RESPONSE_LENGTH = "val-aux/{source}/response_length/mean"
#: a concrete VAL_ACC name; groups ``source`` (may contain "/") and ``n``
VAL_ACC_RE = re.compile(r"^val-core/(?P<source>.+)/acc/mean@(?P<n>\d+)$")
#: pass@k of a data source: the unbiased estimate from the validation samples (predmask.evaluation.pass_at_k)
VAL_PASS = "val-core/{source}/pass@{k}"
VAL_PASS_RE = re.compile(r"^val-core/(?P<source>.+)/pass@(?P<k>\d+)$")
#: supervised stages (the variational-reasoning family, predmask.rl.vr_runner): the weighted SFT loss of a step
TRAIN_LOSS = "train/loss"
#: variational-reasoning stage metrics (predmask.rl.vr_runner)
VR_POSTERIOR_CORRECT = "vr/posterior_correct/mean"
VR_PRIOR_CORRECT = "vr/prior_correct/mean"
VR_DECOY_HIT = "vr/posterior_decoy_hit/mean"
VR_DECOY_CORRECT = "vr/posterior_decoy_correct/mean"
VR_TRACE_TOKENS_MEAN = "vr/trace_tokens/mean"
VR_ANSWER_ACC = "vr/answer_acc/mean"
VR_LOG_RATIO_MEAN = "vr/log_ratio/mean"
VR_RFT_KEPT = "vr/rft_kept/mean"

_CATALOGUE: tuple[Metric, ...] = (
    # per micro-batch, from predmask.policy_loss (math.md §4) and the update around it
    Metric(PPO_KL, "mean", "mean of log anchor - log pi_k (the ratio's anchor, pi_old or mu_k, minus the training "
                           "log-prob) over response tokens, before the update", weight=MASK_TOKENS),
    Metric(CLIPFRAC, "mean", "fraction of response tokens with a nonzero advantage whose gradient the method drops "
                             "(clipped ratio or masked token)", weight=MASK_ADV_TOKENS),
    Metric(CLIPFRAC_LOWER, "mean", "the part of actor/pg_clipfrac with a negative advantage",
           weight=MASK_ADV_TOKENS),
    Metric(ACTOR_PG_LOSS, "mean", "the policy loss of the micro-batch (after loss aggregation)"),
    Metric(ACTOR_GRAD_NORM, "mean", "global gradient norm before clipping"),
    Metric(MASK_TOKENS, "sum", "response tokens the loss saw"),
    Metric(MASK_ADV_TOKENS, "sum", "response tokens with a nonzero advantage (what actor/pg_clipfrac is a fraction "
                                   "of; written by the verl plugin's loss statistics)"),
    Metric(MASK_DIVERGENCE_MEAN, "mean", "mean top-K divergence D(mu, pi) of the method over response tokens",
           weight=MASK_TOKENS),
    Metric(MASK_DIVERGENCE_MAX, "max", "largest per-token top-K divergence D(mu, pi)"),
    Metric(MASK_OUTSIDE_FRAC, "mean", "fraction of response tokens outside the trust region (D > delta)",
           weight=MASK_TOKENS),
    Metric(MASK_MU_TAIL_CLAMPED, "sum", "tokens whose rollout tail mass 1 - sum_S mu fell below the floor (clamped)"),
    Metric(MASK_PI_TAIL_CLAMPED, "sum", "tokens whose training tail mass 1 - sum_S pi fell below the floor (clamped)"),
    Metric(MASK_DIRECTION_DISAGREE, "sum", "outside tokens with a nonzero advantage where the predictive direction "
                                           "and the ratio direction disagree (predictive methods only)"),
    Metric(MASK_PI_SAMPLED_GAP, "max", "largest |log pi_k from the support gather - verl's log_prob| (verl plugin: "
                                       "a check that the support is aligned)"),
    # per step: rollout-vs-training mismatch on the first mini-batch, before any update
    Metric(MISMATCH_TOPK_KL, "mean", "mean top-K KL(mu || pi) over response tokens (math.md §2)"),
    Metric(MISMATCH_TOPK_KL_MAX, "max", "largest per-token top-K KL(mu || pi)"),
    Metric(MISMATCH_KL, "mean", "verl's sampled-token mismatch estimate: mean of log mu_k - log pi_k"),
    # per step: the rollout batch (verl's data metrics)
    Metric(SCORE_MEAN, "mean", "mean reward of the step's rollouts (training reward)"),
    Metric(SCORE_MAX, "max", "largest reward of the step's rollouts"),
    Metric(SCORE_MIN, "min", "smallest reward of the step's rollouts"),
    Metric(REWARDS_MEAN, "mean", "mean sequence reward (no KL penalty: equals critic/score/mean)"),
    Metric(ADVANTAGES_MEAN, "mean", "mean GRPO advantage of the step's rollouts"),
    Metric(ADVANTAGES_MAX, "max", "largest GRPO advantage"),
    Metric(ADVANTAGES_MIN, "min", "smallest GRPO advantage"),
    Metric(RESPONSE_LENGTH_MEAN, "mean", "mean response length in tokens"),
    Metric(RESPONSE_LENGTH_MAX, "max", "longest response in tokens"),
    Metric(RESPONSE_LENGTH_MIN, "min", "shortest response in tokens"),
    Metric(RESPONSE_LENGTH_CLIP_RATIO, "mean", "fraction of responses that reached the maximum response length"),
    Metric(PROMPT_LENGTH_MEAN, "mean", "mean prompt length in tokens"),
    Metric(TOPK_TAIL_MASS_MEAN, "mean", "mean rollout mass off the reported top-K, 1 - sum_TopK mu, over response "
                                        "tokens"),
    Metric(TOPK_TAIL_MASS_MAX, "max", "largest rollout mass off the reported top-K"),
    Metric(ACTOR_LR, "mean", "the optimiser's learning rate"),
    Metric(GLOBAL_STEP, "max", "the training step"),
    Metric(PERF_TOTAL_NUM_TOKENS, "sum", "response tokens generated in the step"),
    # per step: wall-clock
    Metric(TIMING_GEN, "sum", "seconds spent generating the rollouts", wall_clock=True),
    Metric(TIMING_UPDATE_ACTOR, "sum", "seconds spent in the policy updates", wall_clock=True),
    Metric(TIMING_STEP, "sum", "seconds of the whole step", wall_clock=True),
    Metric(TIMING_TESTING, "sum", "seconds of the validation", wall_clock=True),
    Metric(PERF_THROUGHPUT, "mean", "generated tokens per second of the step", wall_clock=True),
    # validation, per data source (avg@n: n samples per problem)
    Metric(VAL_ACC, "mean", "validation accuracy avg@n on a data source (the CPU engine's: aime24_standin, "
                            "aime25_standin)"),
    Metric(VAL_RESPONSE_LENGTH, "mean", "mean validation response length on a data source"),
    Metric(VAL_PASS, "mean", "validation pass@k on a data source: mean over problems of the unbiased estimate "
                             "1 - C(n-c, k) / C(n, k) from n samples with c correct (k = 1..n)"),
    # the variational-reasoning family (predmask.rl.vr_runner; stand-in scale)
    Metric(TRAIN_LOSS, "mean", "the supervised (weighted) SFT loss of a step: -sum_b w_b sum_t log p / normaliser"),
    Metric(VR_POSTERIOR_CORRECT, "mean", "share of q_phi's traces whose own answer equals the hinted (correct) answer"),
    Metric(VR_PRIOR_CORRECT, "mean", "share of pi_theta0's samples on the traces stage's questions (K each, same "
           "sampler and temperature) whose answer is correct: what q_phi's hinted rate is compared with"),
    Metric(VR_DECOY_HIT, "mean", "share of q_phi's traces sampled with a decoy hint (the answer +-3) whose own answer "
           "is the decoy: whether q_phi follows its hint (near 0: it ignores it)"),
    Metric(VR_DECOY_CORRECT, "mean", "share of q_phi's traces sampled with a decoy hint whose own answer is the "
           "correct one"),
    Metric(VR_TRACE_TOKENS_MEAN, "mean", "mean trace length |z| in tokens (the steps before the box)"),
    Metric(VR_ANSWER_ACC, "mean", "mean correctness of the M answers pi_theta0 samples after a trace (acc estimator)"),
    Metric(VR_LOG_RATIO_MEAN, "mean", "mean per-token log ratio (log pi_theta0(z|x) - log q_phi(z|x,y')) / |z|"),
    Metric(VR_RFT_KEPT, "mean", "share of pi_theta0's samples that RFT keeps (correct ones)"),
)

METRICS: dict[str, Metric] = {m.name: m for m in _CATALOGUE}

#: the verl plugin's per-micro-batch loss statistics: a folder of the run dir, one JSON-lines file per launch and
#: rank, ``<session>.rank<R>.jsonl``; every line is one micro-batch with the fields STATS_FIELDS: ``session`` (the
#: launch; a later session's lines of a step replace an earlier one's), ``step`` (verl's global step), ``mini_batch``
#: (its index in the step), ``rank`` (the writing data-parallel rank), ``micro_batch`` (its index on that rank) and
#: ``metrics`` (catalogue name -> value of that micro-batch alone, each mean with its weight)
LOSS_STATS_DIR = "loss_stats"
STATS_FIELDS: tuple[str, ...] = ("session", "step", "mini_batch", "rank", "micro_batch", "metrics")

_REDUCERS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "max": max,
    "min": min,
    "mean": lambda values: sum(values) / len(values),
}
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _family_re(template: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(template)  # literal, name, literal, name, ..., literal
    body = "".join(re.escape(p) if i % 2 == 0 else (r"\d+" if p in ("n", "k") else ".+") for i, p in enumerate(parts))
    return re.compile(f"^{body}$")


_FAMILIES: tuple[tuple[re.Pattern[str], Metric], ...] = tuple(
    (_family_re(m.name), m) for m in _CATALOGUE if _PLACEHOLDER.search(m.name)
)


def metric(name: str) -> Metric:
    """The catalogue entry of a concrete metric name (a family's member included); unknown names raise ValueError."""
    found = METRICS.get(name)
    if found is not None and not _PLACEHOLDER.search(name):
        return found
    for pattern, m in _FAMILIES:
        if pattern.match(name):
            return m
    raise ValueError(f"unknown metric {name!r}; known: {', '.join(sorted(METRICS))} (predmask.metrics)")


def val_acc(source: str, n: int) -> str:
    """The validation accuracy name of a data source at avg@n, e.g. ``val-core/aime24_standin/acc/mean@16``."""
    return VAL_ACC.format(source=source, n=n)


def val_pass(source: str, k: int) -> str:
    """The validation pass@k name of a data source, e.g. ``val-core/aime24_standin/pass@4``."""
    return VAL_PASS.format(source=source, k=k)


def val_response_length(source: str) -> str:
    """The mean validation response length name of a data source."""
    return VAL_RESPONSE_LENGTH.format(source=source)


def wall_clock(name: str) -> bool:
    """Whether a metric measures wall-clock time (differs between otherwise identical runs)."""
    return metric(name).wall_clock


def merge_micro_batches(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One mini-batch's metrics from its micro-batches (any split over micro-batches and ranks, the same result).

    Counts add up, extremes take the extreme, a mean with a ``weight`` is weighted by that count of each part (0.0
    when the counts are all 0, as a masked mean over no tokens); a mean without one is averaged. A weighted mean
    whose part lacks its weight raises ValueError.
    """
    names = sorted({k for p in parts for k in p})
    out: dict[str, float] = {}
    for name in names:
        m = metric(name)
        have = [p for p in parts if name in p]
        if m.reduce == "mean" and m.weight is not None:
            if any(m.weight not in p for p in have):
                raise ValueError(f"metric {name} is weighted by {m.weight}, which a micro-batch lacks")
            total = sum(float(p[m.weight]) for p in have)
            out[name] = sum(float(p[name]) * float(p[m.weight]) for p in have) / total if total else 0.0
        else:
            out[name] = float(_REDUCERS[m.reduce]([float(p[name]) for p in have]))
    return out


def reduce_metrics(per_microbatch: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combine per-micro-batch metrics into one dict, each name by its catalogue ``reduce``, names in sorted order.

    A name missing from some micro-batches is reduced over those that have it. Unknown names raise ValueError.
    """
    names = sorted({k for m in per_microbatch for k in m})
    return {
        name: float(_REDUCERS[metric(name).reduce]([float(m[name]) for m in per_microbatch if name in m]))
        for name in names
    }
