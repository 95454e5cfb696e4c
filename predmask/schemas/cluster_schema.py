"""The cluster side's config sections as dataclasses: the Hydra schemas of conf/cluster/*.yaml and of the cluster
models conf/model/qwen3_*.yaml. Every value lives in conf/: a field here is typed and MISSING. The verl
commands build them with ``predmask.config.typed_view``, which runs the range checks below (one line naming
the key)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

from omegaconf import MISSING

from predmask.vr_stages import SFT_STAGES

#: verl's training engines
ENGINES: tuple[str, ...] = ("megatron", "fsdp")
#: where a verl cluster computes (``cluster.device``)
DEVICES: tuple[str, ...] = ("cuda", "cpu")
#: the attention implementations a verl job may load its transformers model with (``cluster.attn_implementation``;
#: verl's own default is flash_attention_2), each with the Python module it needs on the nodes (None: torch's own)
ATTENTION_MODULES: dict[str, str | None] = {"flash_attention_2": "flash_attn", "sdpa": None}


def _positive(section: str, obj: Any, *names: str) -> None:
    """One line naming the first of ``names`` (fields of ``obj``) that is set and not > 0."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            raise ValueError(f"{section}.{name} must be a positive {type(value).__name__}, got {value!r}")


@dataclass
class ParallelConfig:
    """Megatron's ``tensor`` / ``pipeline`` / ``expert`` parallelism, FSDP's Ulysses ``sequence`` parallelism, vLLM's
    ``rollout_tensor`` parallelism."""

    tensor: int = MISSING
    pipeline: int = MISSING
    expert: int = MISSING
    sequence: int = MISSING
    rollout_tensor: int = MISSING

    def __post_init__(self) -> None:
        _positive("model.parallel", self, *(f.name for f in fields(self)))


@dataclass
class BatchConfig:
    """One GRPO run's sizes and schedule: prompts per rollout batch, responses per prompt (the group), prompts per
    mini-batch, token lengths, the dynamic-batch budget per GPU (null: 2 x (prompt + response)), AdamW's lr, sampling
    and validation sampling, steps, validation and checkpoint intervals, vLLM's share of GPU memory."""

    train_prompts: int = MISSING
    responses_per_prompt: int = MISSING
    ppo_mini_batch_prompts: int = MISSING
    max_prompt_length: int = MISSING
    max_response_length: int = MISSING
    max_token_len_per_gpu: int | None = MISSING
    lr: float = MISSING
    temperature: float = MISSING
    val_temperature: float = MISSING
    val_top_p: float = MISSING
    total_steps: int = MISSING
    val_every: int = MISSING
    save_every: int = MISSING
    gpu_memory_utilization: float = MISSING

    def __post_init__(self) -> None:
        _positive("model.batch", self, "train_prompts", "responses_per_prompt", "ppo_mini_batch_prompts",
                  "max_prompt_length", "max_response_length", "max_token_len_per_gpu", "total_steps", "val_every",
                  "save_every")


@dataclass
class ClusterModelConfig:
    """A real model of the cluster path: ``path`` its local checkpoint, ``engine`` verl's training engine
    (ENGINES), ``fused_kernels`` verl's fused log-prob kernels on engine=fsdp (no [tokens, vocab] logits;
    Megatron keeps the logits path, where the support gather from the hidden states is not wired), ``verl``
    raw verl overrides applied after ours; ``cpu_standin`` trains in its place on the CPU engine."""

    name: str = MISSING
    backend: str = MISSING
    label: str = MISSING
    hf_id: str = MISSING
    path: str = MISSING
    cpu_standin: str = MISSING
    stands_in_for: str = MISSING
    engine: str = MISSING
    fused_kernels: bool = MISSING
    parallel: ParallelConfig = MISSING
    batch: BatchConfig = MISSING
    verl: dict[str, Any] = MISSING

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("run config is missing model.path (needed for a VeRL run)")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown model.engine {self.engine!r}; allowed: {', '.join(ENGINES)}")
        p = self.parallel
        if self.engine == "fsdp" and (p.tensor, p.pipeline, p.expert) != (1, 1, 1):
            raise ValueError(f"model.engine=fsdp has no tensor/pipeline/expert parallelism in verl 0.9.1 (got tensor="
                             f"{p.tensor}, pipeline={p.pipeline}, expert={p.expert}): set them to 1 or use "
                             "model.engine=megatron")
        if self.engine == "megatron" and p.sequence != 1:
            raise ValueError("model.parallel.sequence (Ulysses) applies to engine=fsdp; Megatron runs with CP=1 here")


@dataclass
class ClusterConfig:
    """Where a sweep's runs go: ``backend`` local | slurm, ``trainer`` cpu | verl, runs at once, seeds per cell (an
    int or a list), whether a missing input path stops the submission, the OMP/MKL threads of a CPU-engine job."""

    name: str = MISSING
    backend: str = MISSING
    trainer: str = MISSING
    max_parallel: int = MISSING
    seeds: Any = MISSING
    check_paths: bool = MISSING
    threads: int = MISSING


@dataclass
class SlurmClusterConfig(ClusterConfig):
    """A Slurm cluster (launch/): the job's shape and limits, its environment lines, the Ray cluster inside each job
    (``ray``: ``launch.ray_slurm.RayOptions``)."""

    python: str | None = MISSING
    partition: str | None = MISSING
    nodes: int = MISSING
    tasks_per_node: int = MISSING
    gpus_per_node: int = MISSING
    cpus_per_task: int | None = MISSING
    mem_gb: int | None = MISSING
    timeout_min: int = MISSING
    max_num_timeout: int = MISSING
    signal_delay_s: int = MISSING
    slurm_additional_parameters: dict[str, Any] = MISSING
    modules: list[str] = MISSING
    activate: str | None = MISSING
    conda: str | None = MISSING
    setup: list[str] = MISSING
    env: dict[str, str] = MISSING
    ray: dict[str, Any] = MISSING

    def __post_init__(self) -> None:
        _positive("cluster", self, "nodes", "gpus_per_node")


@dataclass
class SFTStageConfig:
    """One SFT stage: epochs over its data, global batch (samples), peak lr."""

    epochs: int = MISSING
    batch: int = MISSING
    lr: float = MISSING


@dataclass
class VLLMSamplingConfig:
    """How a stage samples with vLLM: temperature, top-p, and at most ``max_tokens`` tokens a response."""

    temperature: float = MISSING
    top_p: float = MISSING
    max_tokens: int = MISSING


def _sampling(name: str, count: str, doc: str) -> Any:
    """A stage's sampling: :class:`VLLMSamplingConfig` and the stage's own count, the int field ``count``."""
    return make_dataclass(name, [(count, int, field(default=MISSING))], bases=(VLLMSamplingConfig,),
                          namespace={"__doc__": doc, "__module__": __name__})


TracesSamplingConfig = _sampling("TracesSamplingConfig", "k", "``k`` traces per question from q_phi.")
WeightsSamplingConfig = _sampling("WeightsSamplingConfig", "m", "``m`` answers per trace from pi_theta0.")
RFTSamplingConfig = _sampling("RFTSamplingConfig", "samples", "``samples`` responses per question from pi_theta0 "
                              "for the rft final (its correct ones are kept).")
EvalSamplingConfig = _sampling("EvalSamplingConfig", "n", "``n`` samples per problem of an evaluation (avg@n, "
                               "pass@1..n).")


@dataclass
class VLLMConfig:
    """One vLLM engine per ``tensor_parallel`` GPUs of the head node, and what bounds its prompt log-probs' memory
    (``predmask.verl.vr_cluster.prompt_logprob_tokens``): the GPU's memory, the logits' vocabulary, the bytes each
    prompt log-prob materialises per vocabulary entry, the headroom kept free."""

    tensor_parallel: int = MISSING
    gpu_memory_utilization: float = MISSING
    max_model_len: int = MISSING
    gpu_memory_gib: float = MISSING
    logits_vocab: int = MISSING
    bytes_per_logit: int = MISSING
    reserve_gib: float = MISSING


@dataclass
class VariationalClusterConfig:
    """The variational family's stages on a cluster (``predmask.verl.vr_cluster``): the prepared data, SFT lengths,
    budget, normaliser, Ulysses parallelism, checkpoint interval and warm-up; each SFT stage's epochs/batch/lr; the
    sampling of traces, weights, the rft final's samples and evaluation; the vLLM engines."""

    data_dir: str | None = MISSING
    max_length: int = MISSING
    max_token_len_per_gpu: int = MISSING
    normaliser_tokens: int = MISSING
    sequence_parallel: int = MISSING
    save_every: int = MISSING
    warmup_ratio: float = MISSING
    prior: SFTStageConfig = MISSING
    posterior: SFTStageConfig = MISSING
    final: SFTStageConfig = MISSING
    traces: TracesSamplingConfig = MISSING
    weights: WeightsSamplingConfig = MISSING
    rft: RFTSamplingConfig = MISSING
    eval: EvalSamplingConfig = MISSING
    vllm: VLLMConfig = MISSING

    def __post_init__(self) -> None:
        at = "cluster.variational"
        _positive(at, self, "max_length", "max_token_len_per_gpu", "normaliser_tokens", "sequence_parallel",
                  "save_every")
        for stage in SFT_STAGES:
            _positive(f"{at}.{stage}", getattr(self, stage), "epochs", "batch", "lr")
        _positive(f"{at}.traces", self.traces, "k", "max_tokens")
        _positive(f"{at}.weights", self.weights, "m", "max_tokens")
        _positive(f"{at}.rft", self.rft, "samples", "max_tokens")
        _positive(f"{at}.eval", self.eval, "n", "max_tokens")
        _positive(f"{at}.vllm", self.vllm, "tensor_parallel", "max_model_len", "gpu_memory_gib", "logits_vocab",
                  "bytes_per_logit")
        if not 0 < self.vllm.gpu_memory_utilization < 1:
            raise ValueError(f"{at}.vllm.gpu_memory_utilization must be in (0, 1), got "
                             f"{self.vllm.gpu_memory_utilization!r}")
        if not self.vllm.reserve_gib >= 0:
            raise ValueError(f"{at}.vllm.reserve_gib must be >= 0, got {self.vllm.reserve_gib!r}")


@dataclass
class VerlClusterConfig(SlurmClusterConfig):
    """A Slurm cluster whose runs are verl jobs: the prepared data (``python -m sweeps.datasets prepare``), whether
    GRPO divides its advantages by the group's std (verl's ``algorithm.norm_adv_by_std_in_grpo``), the attention
    the FSDP engine and the SFT stages load the model with (ATTENTION_MODULES; Megatron runs use Megatron's own) and
    the variational family's settings."""

    data_dir: str | None = MISSING
    norm_adv_by_std: bool = MISSING
    attn_implementation: str = MISSING
    variational: VariationalClusterConfig = MISSING
    #: where verl computes: ``cuda`` (GPUs) or ``cpu`` (this machine, vLLM's CPU build: predmask.verl.cpu)
    device: str = MISSING
    #: with device=cpu, the CPU model (conf/model) every run trains in place of its cluster model
    #: (predmask.verl.cpu_standin); null on GPUs
    standin: str | None = MISSING
    #: seconds one rollout or weight sync may last before the run ends with one line naming it
    #: (predmask.verl.stages, as predmask.stage_timeout_s); null: only the job's time limit bounds a hang
    stage_timeout_s: int | None = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage_timeout_s is not None and not self.stage_timeout_s > 0:
            raise ValueError(f"cluster.stage_timeout_s must be a number of seconds > 0 or null, got "
                             f"{self.stage_timeout_s!r}")
        if self.device not in DEVICES:
            raise ValueError(f"unknown cluster.device {self.device!r}; allowed: {', '.join(DEVICES)}")
        if self.device == "cpu" and not self.standin:
            raise ValueError("cluster.device=cpu needs cluster.standin, the CPU model the runs train (e.g. cpu_s32)")
        if self.attn_implementation not in ATTENTION_MODULES:
            raise ValueError(f"unknown cluster.attn_implementation {self.attn_implementation!r}; allowed: "
                             f"{', '.join(ATTENTION_MODULES)}")
