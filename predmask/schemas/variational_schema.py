"""The variational-reasoning family's config sections as dataclasses: the Hydra schema ``variational_schema`` of
conf/variational.yaml, each with its range checks and ``from_mapping``; the stage runner
(``predmask.rl.vr_runner``) builds ``VRConfig.from_mapping(config)`` from a run's resolved config."""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from predmask.conf_tree import group_options
from predmask.schemas.unknown_keys import check_known_keys
from predmask.vr_stages import CLUSTER_STAGES, STAGES

FAMILY = "variational"
#: ``method.name`` of the stage runs that are not final or eval (set by the sweep; rft_samples: cluster only)
STAGE_METHODS: tuple[str, ...] = ("prior", "posterior", "traces", "weights", "rft_samples")
#: ``method.name`` of the final recipes: one conf/vr_method/<name>.yaml each
FINAL_RECIPES: tuple[str, ...] = tuple(group_options("vr_method"))
#: how a vr_* recipe uses the traces: all K with their normalised weights, or the best one per question + the original
DATA_MODES: tuple[str, ...] = ("all_weighted", "best_mixed")


def _at_least(low: float, *, default: float) -> Any:
    """A field whose value must be a number >= ``low`` (checked by ``_Section``)."""
    return field(default=default, metadata={"allowed": f"a number >= {low:g}", "ok": lambda v: v >= low})


def _positive(default: float) -> Any:
    """A field whose value must be a number > 0 (checked by ``_Section``)."""
    return field(default=default, metadata={"allowed": "a number > 0", "ok": lambda v: v > 0})


class _Section:
    """``from_mapping`` of a section (unknown keys raise one line naming them and the allowed ones) and the
    range check of each ``_at_least`` / ``_positive`` field, in field order."""

    _name = "section"

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if "ok" in f.metadata and (isinstance(value, bool) or not f.metadata["ok"](value)):
                raise ValueError(f"{self._name}.{f.name} = {value!r} is not allowed; "
                                 f"allowed: {f.metadata['allowed']}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Any:
        check_known_keys(cls, values, cls._name)
        return cls(**dict(values))


@dataclass(frozen=True)
class DataConfig(_Section):
    """The original data: the first ``questions`` train problems, one worked solution each written with slips at
    rate ``noise`` (``predmask.rl.task.noisy_steps``, rng seeded by ``seed`` only: fixed across training seeds)."""

    _name = "data"
    questions: int = _at_least(1, default=1024)
    noise: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.noise < 1.0:
            raise ValueError(f"data.noise = {self.noise!r} is not allowed; allowed: a number in [0, 1)")


@dataclass(frozen=True)
class HintConfig(_Section):
    """q_phi's prompt: ``template.format(prompt=<question>, hint=<answer>)``; the hint sits in a marked segment.
    ``use: false`` is the ablation without hint conditioning: q_phi is trained and sampled on the question alone."""

    _name = "hint"
    template: str = "\\boxed{{{hint}}} {prompt}"
    use: bool = True

    def prompt(self, question: str, hint: int) -> str:
        """q_phi's prompt for ``question`` with the hinted answer ``hint`` (the question alone when not ``use``)."""
        return self.template.format(prompt=question, hint=hint) if self.use else question

    def __post_init__(self) -> None:
        if not isinstance(self.use, bool):
            raise ValueError(f"hint.use = {self.use!r} is not allowed; allowed: true, false")  # noqa: TRY004
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
        except ValueError as err:
            raise ValueError(f"hint.template = {self.template!r} is not a format string ({err})") from None
        if names != {"prompt", "hint"}:
            raise ValueError(f"hint.template = {self.template!r} is not allowed; allowed: a format string with "
                             f"exactly the fields {{prompt}} and {{hint}}, got {sorted(names)}")


@dataclass(frozen=True)
class SFTConfig(_Section):
    """The supervised stages: AdamW at ``lr`` with ``warmup`` linear warmup steps, constant after; batches of
    ``questions_per_step`` questions (all their rows); loss normaliser = ``normaliser`` x ``questions_per_step``;
    a checkpoint every ``save_every`` steps (0: only at the end)."""

    _name = "sft"
    lr: float = _positive(1e-3)
    warmup: int = _at_least(0, default=10)
    grad_clip: float = _positive(1.0)
    normaliser: float = _positive(16.0)
    questions_per_step: int = _at_least(1, default=16)
    save_every: int = _at_least(0, default=50)


#: what q_phi is fitted to: the original solutions, or pi_theta0's own worked samples (POSTERIOR_SOURCES)
POSTERIOR_SOURCES: tuple[str, ...] = ("original", "prior", "original+prior")


@dataclass(frozen=True)
class PosteriorConfig(_Section):
    """q_phi's SFT on hint prompts, ``epochs`` shuffled passes over its rows: each original solution with its own
    answer as the hint (``source`` original), ``samples`` responses per question sampled from pi_theta0 with their own
    answer as the hint, the worked ones kept, each weighted 1/samples (prior), or both."""

    _name = "posterior"
    epochs: int = _at_least(1, default=4)
    source: str = "original"
    samples: int = _at_least(1, default=8)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source not in POSTERIOR_SOURCES:
            raise ValueError(f"posterior.source = {self.source!r} is not allowed; allowed: "
                             f"{', '.join(POSTERIOR_SOURCES)}")


@dataclass(frozen=True)
class TracesConfig(_Section):
    """``k`` traces per question sampled from q_phi at ``temperature``."""

    _name = "traces"
    k: int = _at_least(1, default=8)
    temperature: float = _positive(1.0)


@dataclass(frozen=True)
class WeightsConfig(_Section):
    """``m`` answers sampled from pi_theta0(.|x, z) per trace at ``temperature`` (the acc estimator's correctness)."""

    _name = "weights"
    m: int = _at_least(1, default=8)
    temperature: float = _positive(1.0)


@dataclass(frozen=True)
class FinalConfig(_Section):
    """The final recipes: ``epochs`` shuffled passes over the questions, from the base model."""

    _name = "final"
    epochs: int = _at_least(1, default=1)


@dataclass(frozen=True)
class RFTConfig(_Section):
    """RFT: ``samples`` responses per question from pi_theta0; the correct ones are kept, each weighted 1/samples."""

    _name = "rft"
    samples: int = _at_least(1, default=8)


@dataclass(frozen=True)
class EvalConfig(_Section):
    """Evaluation of prior and final models: ``n`` samples per problem (avg@n, pass@1..n) at ``temperature``."""

    _name = "eval"
    n: int = _at_least(1, default=16)
    temperature: float = _positive(1.0)


@dataclass(frozen=True)
class VRMethodConfig(_Section):
    """The ``method`` section of a variational run: a final recipe (conf/vr_method) or a stage's name; the vr_*
    recipes name their ``estimator`` (``predmask.vr_weights.ESTIMATORS``) and ``data`` mode (DATA_MODES)."""

    _name = "method"
    name: str = "vr_acc"
    label: str = ""
    estimator: str | None = None
    data: str | None = None

    def __post_init__(self) -> None:
        allowed = (*FINAL_RECIPES, *STAGE_METHODS)
        if self.name not in allowed:
            raise ValueError(f"method.name = {self.name!r} is not allowed; allowed: {', '.join(allowed)}")
        if self.name.startswith("vr_"):
            if self.estimator is None:
                raise ValueError(f"method {self.name!r} needs method.estimator (predmask.vr_weights.ESTIMATORS)")
            if self.data not in DATA_MODES:
                raise ValueError(f"method.data = {self.data!r} is not allowed; allowed: {', '.join(DATA_MODES)}")


#: config section -> its dataclass: the schema node ``variational_schema``, as ``predmask.config`` stores it
SECTIONS: dict[str, type] = {
    "data": DataConfig, "hint": HintConfig, "sft": SFTConfig, "posterior": PosteriorConfig, "traces": TracesConfig,
    "weights": WeightsConfig, "final": FinalConfig, "rft": RFTConfig, "eval": EvalConfig,
}


@dataclass(frozen=True)
class VRConfig:
    """Every variational section of a run's resolved config, checked (the stage runner's view of it)."""

    stage: str
    seed: int
    method: VRMethodConfig
    inputs: dict[str, str] = field(default_factory=dict)
    data: DataConfig = DataConfig()
    hint: HintConfig = HintConfig()
    sft: SFTConfig = SFTConfig()
    posterior: PosteriorConfig = PosteriorConfig()
    traces: TracesConfig = TracesConfig()
    weights: WeightsConfig = WeightsConfig()
    final: FinalConfig = FinalConfig()
    rft: RFTConfig = RFTConfig()
    eval: EvalConfig = EvalConfig()

    def __post_init__(self) -> None:
        if self.stage not in CLUSTER_STAGES:  # the CPU runner refuses the cluster-only ones (predmask.vr_stages)
            raise ValueError(f"stage = {self.stage!r} is not allowed; allowed: {', '.join(CLUSTER_STAGES)}")
        if self.stage == "final" and self.method.name not in FINAL_RECIPES:
            raise ValueError(f"stage final needs a final recipe as method.name, got {self.method.name!r}; "
                             f"allowed: {', '.join(FINAL_RECIPES)}")
        if self.stage == "eval" and self.method.name not in ("prior", *FINAL_RECIPES):
            raise ValueError(f"stage eval runs with the evaluated run's method.name, got {self.method.name!r}; "
                             f"allowed: {', '.join(('prior', *FINAL_RECIPES))}")
        if self.stage not in ("final", "eval") and self.method.name != self.stage:
            raise ValueError(f"stage {self.stage} runs with method.name {self.stage!r}, got {self.method.name!r}")
        bad = sorted(set(self.inputs) - set(CLUSTER_STAGES))
        if bad:
            raise ValueError(f"inputs names unknown stages {bad}; allowed: {', '.join(CLUSTER_STAGES)}")

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> VRConfig:
        """The variational view of a whole resolved run config (other keys, e.g. model or task, are not read)."""
        if config.get("family") != FAMILY:
            raise ValueError(f"family = {config.get('family')!r} is not allowed here; allowed: {FAMILY!r} "
                             f"(compose conf/variational.yaml)")
        stage = config.get("stage")
        if not isinstance(stage, str):
            raise ValueError(f"stage = {stage!r} is not allowed; allowed: {', '.join(STAGES)}")  # noqa: TRY004
        sections = {name: kind.from_mapping(config.get(name) or {})  # type: ignore[attr-defined]
                    for name, kind in SECTIONS.items()}
        inputs = {str(k): str(v) for k, v in (config.get("inputs") or {}).items()}
        return cls(stage=stage, seed=int(config.get("seed", 0)),
                   method=VRMethodConfig.from_mapping(config.get("method") or {}), inputs=inputs, **sections)
