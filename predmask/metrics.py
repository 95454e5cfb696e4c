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


_CATALOGUE: list[Metric] = []


def _metric(name: str, reduce: Reduce, meaning: str, *, wall_clock: bool = False,
            weight: str | None = None) -> str:
    """Add a catalogue entry and return its name: the constants below are the names code uses."""
    _CATALOGUE.append(Metric(name, reduce, meaning, wall_clock=wall_clock, weight=weight))
    return name


# per micro-batch, from predmask.policy_loss (math.md §4) and the update around it
MASK_TOKENS = _metric("actor/mask/tokens", "sum", "response tokens the loss saw")
MASK_ADV_TOKENS = _metric("actor/mask/adv_tokens", "sum", "response tokens with a nonzero advantage (what "
                          "actor/pg_clipfrac is a fraction of; written by the verl plugin's loss statistics)")
PPO_KL = _metric("actor/ppo_kl", "mean", "mean of log anchor - log pi_k (the ratio's anchor, pi_old or mu_k, "
                 "minus the training log-prob) over response tokens, before the update", weight=MASK_TOKENS)
CLIPFRAC = _metric("actor/pg_clipfrac", "mean", "fraction of response tokens with a nonzero advantage whose "
                   "gradient the method drops (clipped ratio or masked token)", weight=MASK_ADV_TOKENS)
CLIPFRAC_LOWER = _metric("actor/pg_clipfrac_lower", "mean", "the part of actor/pg_clipfrac with a negative "
                         "advantage", weight=MASK_ADV_TOKENS)
ACTOR_PG_LOSS = _metric("actor/pg_loss", "mean", "the policy loss of the micro-batch (after loss "
                        "aggregation)")
ACTOR_GRAD_NORM = _metric("actor/grad_norm", "mean", "global gradient norm before clipping")
MASK_DIVERGENCE_MEAN = _metric("actor/mask/divergence_mean", "mean", "mean top-K divergence D(mu, pi) of the "
                               "method over response tokens", weight=MASK_TOKENS)
MASK_DIVERGENCE_MAX = _metric("actor/mask/divergence_max", "max", "largest per-token top-K divergence D(mu, "
                              "pi)")
MASK_OUTSIDE_FRAC = _metric("actor/mask/outside_frac", "mean", "fraction of response tokens outside the "
                            "trust region (D > delta)", weight=MASK_TOKENS)
MASK_MU_TAIL_CLAMPED = _metric("actor/mask/mu_tail_clamped", "sum", "tokens whose rollout tail mass 1 - "
                               "sum_S mu fell below the floor (clamped)")
MASK_PI_TAIL_CLAMPED = _metric("actor/mask/pi_tail_clamped", "sum", "tokens whose training tail mass 1 - "
                               "sum_S pi fell below the floor (clamped)")
MASK_DIRECTION_DISAGREE = _metric("actor/mask/direction_disagree", "sum", "outside tokens with a nonzero "
                                  "advantage where the predictive direction and the ratio direction disagree "
                                  "(predictive methods only)")
MASK_PI_SAMPLED_GAP = _metric("actor/mask/pi_sampled_gap", "max", "largest |log pi_k from the support gather "
                              "- verl's log_prob| (verl plugin: a check that the support is aligned)")
# per step: rollout-vs-training mismatch on the first mini-batch, before any update
MISMATCH_TOPK_KL = _metric("rollout_corr/topk_kl", "mean", "mean top-K KL(mu || pi) over response tokens "
                           "(math.md §2)")
MISMATCH_TOPK_KL_MAX = _metric("rollout_corr/topk_kl_max", "max", "largest per-token top-K KL(mu || pi)")
MISMATCH_KL = _metric("rollout_corr/kl", "mean", "verl's sampled-token mismatch estimate: mean of log mu_k - "
                      "log pi_k")
# per step: the rollout batch (verl's data metrics)
SCORE_MEAN = _metric("critic/score/mean", "mean", "mean reward of the step's rollouts (training reward)")
SCORE_MAX = _metric("critic/score/max", "max", "largest reward of the step's rollouts")
SCORE_MIN = _metric("critic/score/min", "min", "smallest reward of the step's rollouts")
REWARDS_MEAN = _metric("critic/rewards/mean", "mean", "mean sequence reward (no KL penalty: equals "
                       "critic/score/mean)")
ADVANTAGES_MEAN = _metric("critic/advantages/mean", "mean", "mean GRPO advantage of the step's rollouts")
ADVANTAGES_MAX = _metric("critic/advantages/max", "max", "largest GRPO advantage")
ADVANTAGES_MIN = _metric("critic/advantages/min", "min", "smallest GRPO advantage")
RESPONSE_LENGTH_MEAN = _metric("response_length/mean", "mean", "mean response length in tokens")
RESPONSE_LENGTH_MAX = _metric("response_length/max", "max", "longest response in tokens")
RESPONSE_LENGTH_MIN = _metric("response_length/min", "min", "shortest response in tokens")
RESPONSE_LENGTH_CLIP_RATIO = _metric("response_length/clip_ratio", "mean", "fraction of responses that "
                                     "reached the maximum response length")
PROMPT_LENGTH_MEAN = _metric("prompt_length/mean", "mean", "mean prompt length in tokens")
TOPK_TAIL_MASS_MEAN = _metric("rollout/topk_tail_mass/mean", "mean", "mean rollout mass off the reported "
                              "top-K, 1 - sum_TopK mu, over response tokens")
TOPK_TAIL_MASS_MAX = _metric("rollout/topk_tail_mass/max", "max", "largest rollout mass off the reported "
                             "top-K")
ACTOR_LR = _metric("actor/lr", "mean", "the optimiser's learning rate")
GLOBAL_STEP = _metric("training/global_step", "max", "the training step")
PERF_TOTAL_NUM_TOKENS = _metric("perf/total_num_tokens", "sum", "response tokens generated in the step")
# per step: wall-clock
TIMING_GEN = _metric("timing_s/gen", "sum", "seconds spent generating the rollouts", wall_clock=True)
TIMING_UPDATE_ACTOR = _metric("timing_s/update_actor", "sum", "seconds spent in the policy updates",
                              wall_clock=True)
TIMING_STEP = _metric("timing_s/step", "sum", "seconds of the whole step", wall_clock=True)
TIMING_TESTING = _metric("timing_s/testing", "sum", "seconds of the validation", wall_clock=True)
PERF_THROUGHPUT = _metric("perf/throughput", "mean", "generated tokens per second of the step",
                          wall_clock=True)
# validation, per data source (families: one metric per data source ``source`` and samples per problem ``n``)
VAL_CORE_PREFIX = "val-core/"
VAL_ACC = _metric("val-core/{source}/acc/mean@{n}", "mean", "validation accuracy avg@n on a data source (the "
                  "CPU engine's: aime24_standin, aime25_standin)")
#: a concrete VAL_ACC name; groups ``source`` (may contain "/") and ``n``
VAL_ACC_RE = re.compile(r"^val-core/(?P<source>.+)/acc/mean@(?P<n>\d+)$")
VAL_RESPONSE_LENGTH = _metric("val-aux/{source}/response_length/mean", "mean", "mean validation response "
                              "length on a data source")
#: pass@k of a data source: the unbiased estimate from the validation samples (predmask.evaluation.pass_at_k)
VAL_PASS = _metric("val-core/{source}/pass@{k}", "mean", "validation pass@k on a data source: mean over "
                   "problems of the unbiased estimate 1 - C(n-c, k) / C(n, k) from n samples with c correct "
                   "(k = 1..n)")
# the variational-reasoning family (predmask.rl.vr_runner; stand-in scale): the weighted SFT loss of a step
# and the stage metrics
TRAIN_LOSS = _metric("train/loss", "mean", "the supervised (weighted) SFT loss of a step: -sum_b w_b sum_t "
                     "log p / normaliser")
VR_POSTERIOR_CORRECT = _metric("vr/posterior_correct/mean", "mean", "share of q_phi's traces whose own "
                               "answer equals the hinted (correct) answer")
VR_PRIOR_CORRECT = _metric("vr/prior_correct/mean", "mean", "share of pi_theta0's samples on the traces "
                           "stage's questions (K each, same sampler and temperature) whose answer is "
                           "correct: what q_phi's hinted rate is compared with")
VR_DECOY_HIT = _metric("vr/posterior_decoy_hit/mean", "mean", "share of q_phi's traces sampled with a decoy "
                       "hint (the answer +-3) whose own answer is the decoy: whether q_phi follows its hint "
                       "(near 0: it ignores it)")
VR_DECOY_CORRECT = _metric("vr/posterior_decoy_correct/mean", "mean", "share of q_phi's traces sampled with "
                           "a decoy hint whose own answer is the correct one")
VR_TRACE_TOKENS_MEAN = _metric("vr/trace_tokens/mean", "mean", "mean trace length |z| in tokens (the steps "
                               "before the box)")
VR_ANSWER_ACC = _metric("vr/answer_acc/mean", "mean", "mean correctness of the M answers pi_theta0 samples "
                        "after a trace (acc estimator)")
VR_LOG_RATIO_MEAN = _metric("vr/log_ratio/mean", "mean", "mean per-token log ratio (log pi_theta0(z|x) - log "
                            "q_phi(z|x,y')) / |z|")
VR_RFT_KEPT = _metric("vr/rft_kept/mean", "mean", "share of pi_theta0's samples that RFT keeps (correct "
                      "ones)")

METRICS: dict[str, Metric] = {m.name: m for m in _CATALOGUE}

#: the verl plugin's per-micro-batch loss statistics (docs/verl-plugin.md "Metrics"): a folder of the run dir,
#: one JSON line per micro-batch with the fields STATS_FIELDS (``session``: the launch, a later one's lines of
#: a step replace an earlier one's; ``metrics``: catalogue name -> the micro-batch's value, each mean with its
#: weight)
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
    """One mini-batch's metrics from its micro-batches (any split over micro-batches and ranks, the same
    result): a mean with a ``weight`` is weighted by that count of each part (0.0 when the counts are all 0),
    which a part must then carry (else ValueError); every other metric reduces by its ``reduce``."""
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
    """Combine per-micro-batch metrics into one dict, each name by its catalogue ``reduce`` over the parts
    that have it, names in sorted order; unknown names raise ValueError."""
    names = sorted({k for m in per_microbatch for k in m})
    return {
        name: float(_REDUCERS[metric(name).reduce]([float(m[name]) for m in per_microbatch if name in m]))
        for name in names
    }
