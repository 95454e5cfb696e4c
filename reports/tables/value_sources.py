"""Where each value of Table 1 comes from: the paper, verl's DPPO recipe (where the paper is silent), or our choice
with its reason; names, labels and the deployment's plumbing are said to be such. A key no rule names has no
source: Table 1 shows it missing, and the tests refuse that for the cluster settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

PAPER = "paper"
#: verl's examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh, by the DPPO authors
RECIPE = "verl's DPPO recipe"
NAME = "name / label"
SITE = "deployment (not a training value)"
UNREAD = "the CPU engine's (a verl run does not read it)"


@dataclass(frozen=True)
class SourceRule:
    """Keys matching ``pattern`` (fnmatch, dotted) on runs of ``trainer`` (``verl``, ``cpu``; None: any) come from
    ``source``."""

    pattern: str
    source: str
    trainer: str | None = None


def _ours(reason: str) -> str:
    return f"ours: {reason}"


#: the first matching rule answers
SOURCE_RULES: tuple[SourceRule, ...] = (
    # what identifies a run, a setting or a model
    *(SourceRule(p, NAME) for p in ("*.name", "*.label", "sweep_name", "model.hf_id", "model.stands_in_for",
                                    "model.cpu_standin", "model.resolved_from")),
    # the method
    *(SourceRule(p, PAPER + " (0.15; the tight-threshold study 0.05)") for p in ("delta", "method.delta")),
    *(SourceRule(p, PAPER + " (DAPO's clip-higher 0.2 / 0.28; grpo 0.2 / 0.2)") for p in ("method.eps_low",
                                                                                        "method.eps_high")),
    SourceRule("method.anchor", PAPER + " (the rollout's mu; verl's pi_old for GRPO)"),
    SourceRule("method.support", _ours("the DPPO reference code's top-K-only support, chosen on the command line")),
    SourceRule("method.loss_agg_mode", RECIPE, "verl"),
    SourceRule("method.ratio_cap", RECIPE + " (actor.clip_ratio_c)", "verl"),
    SourceRule("method.loss_agg_mode", _ours("verl's default token-mean; the paper does not say"), "cpu"),
    SourceRule("method.ratio_cap", _ours("the DPPO reference code's default cap"), "cpu"),
    SourceRule("top_k", PAPER + " (K = 20)"),
    # the cluster models
    SourceRule("model.backend", _ours("a real checkpoint on the cluster")),
    SourceRule("model.engine", _ours("FSDP for the dense models, Megatron for the MoE (the paper trains with "
                                     "Megatron-LM)")),
    SourceRule("model.fused_kernels", _ours("verl's fused log-probs on FSDP (no [tokens, vocab] logits; the support "
                                            "from the hidden states); off on Megatron, where it is not wired")),
    SourceRule("model.parallel.*", _ours("sized for 4 x 8 GPUs; the paper gives no parallelism")),
    SourceRule("model.batch.train_prompts", RECIPE + " (256 prompts per rollout batch)"),
    SourceRule("model.batch.responses_per_prompt", RECIPE + " (16 responses per prompt)"),
    SourceRule("model.batch.ppo_mini_batch_prompts", RECIPE + " (8 mini-batches per rollout batch; the CPU engine's "
                                                             "staleness too)"),
    SourceRule("model.batch.max_response_length", RECIPE + " (8,192)"),
    SourceRule("model.batch.max_prompt_length", _ours("1,024 (the recipe allows 2,048); longer prompts are "
                                                      "filtered out")),
    SourceRule("model.batch.max_token_len_per_gpu", _ours("2 x (prompt + response), so one full sequence always "
                                                          "fits a micro-batch")),
    SourceRule("model.batch.lr", RECIPE + " (1e-6)"),
    SourceRule("model.batch.temperature", PAPER + " (rollouts at temperature 1, top-p 1)"),
    *(SourceRule(f"model.batch.{p}", PAPER + " (validation samples as the rollouts)") for p in ("val_temperature",
                                                                                                  "val_top_p")),
    SourceRule("model.batch.total_steps", _ours("the paper's curves' length is not given")),
    SourceRule("model.batch.val_every", RECIPE + " (test_freq 10)"),
    SourceRule("model.batch.save_every", _ours("a requeued run loses at most 20 steps")),
    SourceRule("model.batch.gpu_memory_utilization", _ours("below the recipe's 0.8: room for the colocated actor")),
    SourceRule("cluster.norm_adv_by_std", RECIPE + " (algorithm.norm_adv_by_std_in_grpo=False)"),
    SourceRule("cluster.variational.*", PAPER + " (§C) where it says; the rest ours (conf/cluster/h20_4x8.yaml)"),
    SourceRule("cluster.*", SITE),
    # the paper's settings
    SourceRule("precision.*", PAPER + " (the four model-precision settings)"),
    # the CPU engine (small stand-ins of the paper's models, sized for a 2-core CPU)
    SourceRule("model.*", _ours("the CPU stand-in model (conf/model), sized for a 2-core CPU"), "cpu"),
    SourceRule("base.*", _ours("the CPU stand-in's supervised pretraining (conf/base)"), "cpu"),
    SourceRule("task.*", _ours("the synthetic arithmetic task (conf/task)"), "cpu"),
    *(SourceRule(f"rollout.{p}", PAPER + " (rollouts at temperature 1, top-p 1)") for p in ("temperature", "top_p")),
    SourceRule("rollout.*", _ours("the CPU engine's group size and response length (conf/train.yaml)"), "cpu"),
    SourceRule("trainer.ppo_epochs", PAPER + " (one epoch per batch)"),
    SourceRule("trainer.val_n", PAPER + " (avg@16)"),
    SourceRule("trainer.val_before_train", _ours("a step-0 validation, the base model's score (verl's default)")),
    SourceRule("trainer.ppo_mini_batch_size", RECIPE + " (8 mini-batches per rollout batch)", "cpu"),
    SourceRule("trainer.logger", SITE),
    SourceRule("trainer.*", _ours("the CPU engine's regime (conf/train.yaml; the README's training regime)"), "cpu"),
    # on a verl run, the CPU engine's own sections are carried but not read
    *(SourceRule(f"{section}.*", UNREAD, "verl") for section in ("trainer", "rollout", "task", "base")),
)


def _trainer(run_config: Mapping[str, Any]) -> str:
    cluster = run_config.get("cluster")
    trainer = cluster.get("trainer") if isinstance(cluster, Mapping) else None
    return str(trainer or "cpu")


def value_source(key: str, run_config: Mapping[str, Any]) -> str | None:
    """The source of dotted ``key`` in ``run_config`` (the first rule of SOURCE_RULES that matches), or None."""
    trainer = _trainer(run_config)
    for rule in SOURCE_RULES:
        if (rule.trainer is None or rule.trainer == trainer) and fnmatchcase(key, rule.pattern):
            return rule.source
    return None
