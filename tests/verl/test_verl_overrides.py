"""verl_overrides: golden command lines per method and precision, composed against verl 0.9.1's real Hydra config.

Golden files (tests/verl/golden/*.txt, one override per line) were reviewed by eye; regenerate with
``PREDMASK_UPDATE_GOLDEN=1 pytest tests/verl/test_verl_overrides.py`` and review the diff. The run configs are the
project's composed conf/train.yaml on cluster=h20_4x8 with the fixture's model, batch and cluster values given as
overrides (so the golden lines do not move when conf/model's values do).
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from pathlib import Path

import pytest
from verl_helpers import GOLDEN, require_verl, verl_composer

import predmask
from predmask import config
from predmask.config import to_container
from predmask.verl.overrides import (
    DATA_FILES,
    PLUGIN_MODULE,
    hydra_value,
    run_attention,
    verl_command,
    verl_overrides,
)
from predmask.verl.settings import SETTINGS_ENV, PluginSettings, current_settings

pytestmark = pytest.mark.verl

BATCH = {"train_prompts": 256, "responses_per_prompt": 16, "ppo_mini_batch_prompts": 64, "max_prompt_length": 1024,
         "max_response_length": 8192, "max_token_len_per_gpu": None, "lr": 1.0e-6, "temperature": 1.0,
         "val_temperature": 1.0, "val_top_p": 1.0, "total_steps": 500, "val_every": 10, "save_every": 20,
         "gpu_memory_utilization": 0.6}
PARALLEL = {"pipeline": 1, "sequence": 1}
MODELS = {
    "qwen3_4b_base": {"path": "/models/Qwen3-4B-Base", "engine": "megatron",
                      "parallel": {**PARALLEL, "tensor": 2, "expert": 1, "rollout_tensor": 1}, "batch": BATCH},
    "qwen3_8b_base": {"path": "/models/Qwen3-8B-Base", "engine": "megatron",
                      "parallel": {**PARALLEL, "tensor": 4, "expert": 1, "rollout_tensor": 2}, "batch": BATCH},
    "qwen3_30b_a3b_base": {"path": "/models/Qwen3-30B-A3B-Base", "engine": "megatron",
                           "parallel": {**PARALLEL, "tensor": 4, "expert": 8, "rollout_tensor": 4}, "batch": BATCH},
}
#: the paper's four model-precision settings
SETTINGS = [("qwen3_4b_base", "bf16"), ("qwen3_8b_base", "bf16"), ("qwen3_30b_a3b_base", "fp8_rollout"),
            ("qwen3_30b_a3b_base", "fp8_e2e")]
MAIN_METHODS = ["grpo_clip_higher", "dppo_topk_kl", "predmask_kl_agg", "predmask_kl_uniform"]
CASES = [(m, model, prec) for m in MAIN_METHODS for model, prec in SETTINGS] + [
    (m, "qwen3_4b_base", "bf16") for m in sorted(predmask.METHODS) if m not in MAIN_METHODS
]


def dotted(prefix: str, values: dict) -> list[str]:
    """``values`` as Hydra overrides under ``prefix`` (nested mappings as dotted keys)."""
    out = []
    for key, value in values.items():
        out += dotted(f"{prefix}.{key}", value) if isinstance(value, dict) else [f"{prefix}.{key}={hydra_value(value)}"]
    return out


@functools.cache
def composed(method: str, model: str, precision: str) -> dict:
    return to_container(config.compose("train", [
        f"method={method}", f"model={model}", f"precision={precision}", "cluster=h20_4x8", "seed=1", "delta=0.15",
        "top_k=20", *dotted("model", MODELS[model]), "cluster.nodes=4", "cluster.gpus_per_node=8",
        "cluster.data_dir=/shared/predmask/data"]))


def run_cfg(method: str, model: str, precision: str) -> dict:
    run = f"{method}-{model}-{precision}"
    return {**copy.deepcopy(composed(method, model, precision)), "run_id": run, "sweep": "main_comparison",
            "run_dir": f"/shared/predmask/runs/main_comparison/{run}"}


def golden_path(method: str, model: str, precision: str) -> Path:
    return GOLDEN / f"{method}__{model}__{precision}.txt"


def render(method: str, model: str, precision: str) -> str:
    cfg = run_cfg(method, model, precision)
    return "\n".join(verl_overrides(cfg, file_logger_path=f"{cfg['run_dir']}/metrics.jsonl")) + "\n"


@pytest.mark.parametrize(("method", "model", "precision"), CASES)
def test_golden_command_lines(method: str, model: str, precision: str) -> None:
    path = golden_path(method, model, precision)
    text = render(method, model, precision)
    if os.environ.get("PREDMASK_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"missing golden file {path}; run with PREDMASK_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text()


def test_no_stale_golden_files() -> None:
    expected = {golden_path(*case).name for case in CASES}
    assert {p.name for p in GOLDEN.glob("*.txt")} == expected


@pytest.fixture(scope="module")
def compose():
    """verl's own config composed with a command line (verl_helpers.verl_composer), the config alone."""
    for run in verl_composer():
        yield lambda overrides, run=run: run(overrides)[0]


@pytest.mark.parametrize(("method", "model", "precision"), CASES)
def test_overrides_compose_with_verl_config(compose, method: str, model: str, precision: str) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    cfg = compose(verl_overrides(run_cfg(method, model, precision), file_logger_path="/x/metrics.jsonl"))
    assert not need_reference_policy(cfg) and not need_critic(cfg)
    validate_config(config=cfg, use_reference_policy=False, use_critic=False)  # what main_ppo checks first
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert actor.policy_loss["loss_mode"] == method and actor.strategy == "megatron"
    # verl's keys keep verl's meaning: PPO's eps (a clip method's own range: grpo_clip_higher 0.2 / 0.28, grpo
    # 0.2 / 0.2; verl's defaults 0.2 / 0.2 for the divergence methods), verl's own clip_ratio / dual-clip c
    clip = predmask.get_method(method).kind == "clip"
    high = {"grpo_clip_higher": 0.28}.get(method, 0.2)
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == ((0.2, high) if clip else (0.2, 0.2))
    assert (actor.clip_ratio, actor.clip_ratio_c) == (0.2, 3.0)
    assert rollout.calculate_log_probs is True and rollout.val_kwargs.n == 16 and rollout.name == "vllm"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.trainer.use_v1) == (4, 8, False)
    assert list(cfg.trainer.logger) == ["console", "file"]
    env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.VERL_USE_EXTERNAL_MODULES == PLUGIN_MODULE == "predmask.verl.plugin" and env.VERL_FILE_LOGGER_PATH == "/x/metrics.jsonl"
    assert "predmask" not in cfg
    settings = current_settings({SETTINGS_ENV: env[SETTINGS_ENV]})
    run_dir = run_cfg(method, model, precision)["run_dir"]
    if clip:
        assert settings == PluginSettings(anchor="old", stats_dir=f"{run_dir}/loss_stats", stage_timeout_s=3600)
    else:
        # the cap of verl's DPPO recipe (conf/cluster/recipe/dppo_verl.yaml), as the cluster's method parameter
        assert settings == PluginSettings(delta=0.15, ratio_cap=10000.0, anchor="rollout", top_k=20,
                                          stats_dir=f"{run_dir}/loss_stats", stage_timeout_s=3600)
    assert actor.loss_agg_mode == "seq-mean-token-sum-norm" and cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert rollout.quantization == ("fp8" if precision in ("fp8_rollout", "fp8_e2e") else None)
    fp8 = actor.megatron.override_transformer_config.get("fp8")
    assert fp8 == ("hybrid" if precision == "fp8_e2e" else None)
    assert list(cfg.data.val_files) == [f"/shared/predmask/data/{DATA_FILES['aime24']}",
                                        f"/shared/predmask/data/{DATA_FILES['aime25']}"]
    assert cfg.actor_rollout_ref.model.path == MODELS[model]["path"]
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == MODELS[model]["parallel"]["tensor"]
    assert cfg.actor_rollout_ref.actor.megatron.expert_model_parallel_size == MODELS[model]["parallel"]["expert"]
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, actor.ppo_mini_batch_size) == (256, 16, 64)
    assert cfg.trainer.total_training_steps == 500 and cfg.trainer.test_freq == 10


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_cluster_configs_follow_verls_dppo_recipe(compose, model: str) -> None:
    """conf/ as it is (no fixture values): every cluster model, composed with verl's real config, runs the values of
    verl's DPPO recipe (examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh) where the paper is silent: 8
    mini-batches per rollout batch (the CPU engine's staleness too), seq-mean-token-sum-norm, GRPO advantages not
    divided by the group's std, the ratio cap 10,000; delta stays the paper's."""
    cpu = to_container(config.compose("train", []))["trainer"]
    for method in ("dppo_topk_kl", "grpo_clip_higher"):
        run = to_container(config.compose("train", [f"method={method}", f"model={model}", "cluster=h20_4x8",
                                                    "cluster.data_dir=/d"]))
        cfg = compose(verl_overrides(run))
        actor = cfg.actor_rollout_ref.actor
        assert cfg.data.train_batch_size // actor.ppo_mini_batch_size == 8 == \
            cpu["train_batch_size"] // cpu["ppo_mini_batch_size"]
        assert actor.loss_agg_mode == "seq-mean-token-sum-norm"
        assert cfg.algorithm.norm_adv_by_std_in_grpo is False
        settings = current_settings({SETTINGS_ENV: cfg.ray_kwargs.ray_init.runtime_env.env_vars[SETTINGS_ENV]})
        if method == "dppo_topk_kl":
            assert (settings.ratio_cap, settings.delta) == (10000.0, 0.15)
    local = to_container(config.compose("train", ["method=dppo_topk_kl", f"model={model}", "cluster=local"]))
    assert "loss_agg_mode" not in local["method"] and "ratio_cap" not in local["method"]  # CPU: MethodParams'


def test_the_clusters_attention_loads_the_fsdp_model(compose) -> None:
    """conf/ as it is: the FSDP models' actor is loaded with cluster.attn_implementation (h20_4x8: flash_attention_2,
    verl's default, spelled out), where verl's model config reads it (``override_config.attn_implementation``); sdpa
    on request; a Megatron model gets no such key (Megatron's own attention); sdpa with Ulysses sequence parallelism,
    which verl 0.9.1 runs inside flash-attention only, and an unknown implementation are one line each."""
    def run(model: str, *extra: str) -> dict:
        return to_container(config.compose("train", ["method=dppo_topk_kl", f"model={model}", "cluster=h20_4x8",
                                                     "cluster.data_dir=/d", *extra]))

    key = "+actor_rollout_ref.model.override_config.attn_implementation"
    for model in ("qwen3_4b_base", "qwen3_8b_base"):
        assert f"{key}=flash_attention_2" in verl_overrides(run(model))
        cfg = compose(verl_overrides(run(model, "cluster.attn_implementation=sdpa")))
        assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert run_attention(run("qwen3_4b_base")) == "flash_attention_2"
    megatron = run("qwen3_30b_a3b_base")
    assert not any(o.startswith(key) for o in verl_overrides(megatron)) and run_attention(megatron) == "megatron"
    assert compose(verl_overrides(megatron)).actor_rollout_ref.model.override_config.get("attn_implementation") is None
    with pytest.raises(ValueError, match="cluster.attn_implementation=sdpa with model.parallel.sequence=2: verl 0.9.1 "
                                         "runs Ulysses sequence parallelism inside flash_attention_2 only"):
        verl_overrides(run("qwen3_4b_base", "cluster.attn_implementation=sdpa", "model.parallel.sequence=2"))
    with pytest.raises(ValueError, match="unknown cluster.attn_implementation 'xformers'; allowed: flash_attention_2, "
                                         "sdpa"):
        verl_overrides(run("qwen3_4b_base", "cluster.attn_implementation=xformers"))


def test_the_top_k_only_support_travels_as_its_own_key(compose) -> None:
    """support=topk (the DPPO reference's) reaches every process as predmask.support; the default
    (topk_plus_sampled) adds no key, so default runs' command lines stay what they were."""
    cfg = run_cfg("dppo_topk_kl", "qwen3_4b_base", "bf16")
    assert not any(o.startswith("predmask.support") for o in verl_overrides(cfg))
    cfg["method"]["support"] = "topk"
    overrides = verl_overrides(cfg)
    assert "predmask.support=topk" in overrides
    env = compose(overrides).ray_kwargs.ray_init.runtime_env.env_vars
    assert current_settings({SETTINGS_ENV: env[SETTINGS_ENV]}).support == "topk"
    for method, match in (("predmask_kl_agg", "support=topk needs the ratio direction"),
                          ("dppo_binary_kl", "takes no support=topk")):
        bad = run_cfg(method, "qwen3_4b_base", "bf16")
        bad["method"]["support"] = "topk"
        with pytest.raises(ValueError, match=match):
            verl_overrides(bad)


def test_large_k_raises_vllms_logprob_cap(compose) -> None:
    cfg = {**run_cfg("predmask_kl_agg", "qwen3_4b_base", "bf16"), "top_k": 32}
    composed = compose(verl_overrides(cfg))
    env = composed.ray_kwargs.ray_init.runtime_env.env_vars
    assert current_settings({SETTINGS_ENV: env[SETTINGS_ENV]}).top_k == 32
    assert composed.actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs == 32


def test_predmask_keys_do_not_compose_as_verl_keys(compose) -> None:
    """verl's strict config refuses predmask's keys: only the launcher's argv (without them) composes."""
    from hydra import compose as hydra_compose
    from hydra.errors import ConfigCompositionException

    overrides = verl_overrides(run_cfg("dppo_topk_kl", "qwen3_4b_base", "bf16"))
    ours = [o for o in overrides if o.startswith("predmask.")]
    assert [o.split("=")[0] for o in ours] == ["predmask.delta", "predmask.ratio_cap", "predmask.anchor",
                                               "predmask.top_k", "predmask.stats_dir", "predmask.stage_timeout_s"]
    assert not any("clip_ratio" in o for o in overrides)
    compose(overrides)  # the launcher's argv composes
    with pytest.raises(ConfigCompositionException, match="predmask"):
        hydra_compose(config_name="ppo_trainer", overrides=[ours[0]])


def test_anchor_rollout_gives_grpo_the_top_k() -> None:
    cfg = run_cfg("grpo_clip_higher", "qwen3_4b_base", "bf16")
    cfg["method"]["anchor"] = "rollout"
    overrides = verl_overrides(cfg)
    assert "predmask.anchor=rollout" in overrides and "predmask.top_k=20" in overrides
    assert not any(o.startswith(("predmask.delta", "predmask.ratio_cap")) for o in overrides)


def test_grpo_takes_its_own_clip_range_even_from_a_bare_method_section() -> None:
    """grpo's eps 0.2 / 0.2 are the method's own defaults (predmask.methods), not MethodParams' clip-higher 0.28:
    a run config naming only the method gets them, and grpo_clip_higher keeps its 0.28."""
    for name, high in (("grpo", 0.2), ("grpo_clip_higher", 0.28)):
        cfg = run_cfg(name, "qwen3_4b_base", "bf16")
        cfg["method"] = {"name": name}
        overrides = verl_overrides(cfg)
        assert f"actor_rollout_ref.actor.clip_ratio_high={high}" in overrides, (name, overrides)
        assert "actor_rollout_ref.actor.clip_ratio_low=0.2" in overrides


def test_fsdp_engine_and_explicit_data_files(compose) -> None:
    cfg = run_cfg("predmask_kl_agg", "qwen3_4b_base", "bf16")
    cfg["model"]["parallel"]["tensor"] = 1
    cfg["model"].update(engine="fsdp", verl={"actor_rollout_ref.actor.fsdp_config.param_offload": True})
    cfg["data"] = {"train_files": "/d/train.parquet", "val_files": ["/d/a.parquet"]}
    cfg["verl"] = {"trainer.total_training_steps": 3}
    composed = compose(verl_overrides(cfg))
    assert composed.actor_rollout_ref.actor.strategy == "fsdp"
    assert composed.actor_rollout_ref.model.use_fused_kernels is True  # conf/model/qwen3_4b_base.yaml's fused_kernels
    cfg["model"]["fused_kernels"] = False
    assert compose(verl_overrides(cfg)).actor_rollout_ref.model.use_fused_kernels is False
    assert composed.actor_rollout_ref.actor.fsdp_config.param_offload is True
    assert list(composed.data.train_files) == ["/d/train.parquet"] and composed.trainer.total_training_steps == 3


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: c.update(method={"name": "nope"}), "unknown method 'nope'"),
        (lambda c: c.update(precision="fp4"), "unknown precision 'fp4'"),
        (lambda c: c.update(precision={"name": "fp32"}), "'fp32' does not run on the cluster; allowed: bf16, fp8_rollout"),
        (lambda c: c["method"].update(delta=0.0), "delta must be a finite number > 0"),
        (lambda c: c.update(top_k=0), "top_k must be an integer >= 1"),
        (lambda c: c["model"].pop("path"), "model.path"),
        (lambda c: c["cluster"].pop("data_dir"), "data.dir"),
        (lambda c: c["model"]["batch"].update(total_steps=0), "model.batch.total_steps"),
        (lambda c: c["cluster"].pop("nodes"), "cluster.nodes"),
        (lambda c: c["model"].update(engine="fsdp"), "engine=megatron"),
        (lambda c: c["model"].update(engine="deepspeed"), "unknown model.engine"),
        (lambda c: c["trainer"].update(logger=["console", "file", "mlflow"]), "unknown trainer.logger 'mlflow'"),
        (lambda c: c["trainer"].update(logger=["console", "wandb"]), "lacks 'file'"),
    ],
)
def test_bad_run_configs_fail_with_one_line(change, match) -> None:
    cfg = copy.deepcopy(run_cfg("predmask_kl_agg", "qwen3_30b_a3b_base", "fp8_e2e"))
    change(cfg)
    with pytest.raises(ValueError, match=match):
        verl_overrides(cfg)


def test_verl_command_is_the_launcher_with_every_override(tmp_path) -> None:
    cfg = run_cfg("predmask_kl_uniform", "qwen3_8b_base", "bf16")
    argv = verl_command(cfg, tmp_path / "run", python="python3")
    assert argv[:3] == ["python3", "-m", "predmask.verl.launch"]
    assert f"trainer.default_local_dir={tmp_path}/run/checkpoints" in argv
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={tmp_path}/run/metrics.jsonl" in argv
    assert argv[3:] == verl_overrides({**cfg, "run_dir": str(tmp_path / "run")},
                                      file_logger_path=f"{tmp_path}/run/metrics.jsonl")


def test_trackers_reach_verl_with_the_run_directorys_places(compose, tmp_path) -> None:
    """The run config's trainer.logger becomes verl's; the launcher points TensorBoard and W&B at the run directory
    through the Ray workers' environment, with one W&B id per run directory (the same for every attempt)."""
    from predmask.rl.trackers import WANDB_ID_FILE, wandb_run_id
    from predmask.verl.launch import requested_loggers, tracker_argv

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = {**run_cfg("predmask_kl_agg", "qwen3_4b_base", "bf16"), "run_dir": str(run_dir)}
    cfg["trainer"]["logger"] = ["console", "file", "tensorboard", "wandb"]
    overrides = verl_overrides(cfg)
    assert "trainer.logger=[console,file,tensorboard,wandb]" in overrides
    attempts = []
    for _ in range(2):
        argv, env = tracker_argv(overrides, run_dir, {}, wandb_run_id(run_dir))
        attempts.append(compose(argv).ray_kwargs.ray_init.runtime_env.env_vars)
    composed = compose(argv)
    assert list(composed.trainer.logger) == ["console", "file", "tensorboard", "wandb"]
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    for workers in attempts:
        assert workers.TENSORBOARD_DIR == f"{run_dir}/tensorboard" and workers.WANDB_DIR == str(run_dir)
        assert (workers.WANDB_RUN_ID, workers.WANDB_RESUME) == (run_id, "allow")
    assert env == {"TENSORBOARD_DIR": f"{run_dir}/tensorboard", "WANDB_DIR": str(run_dir), "WANDB_RUN_ID": run_id,
                   "WANDB_RESUME": "allow"}
    # the launching environment's TENSORBOARD_DIR / WANDB_DIR win, as in verl
    _, env = tracker_argv(overrides, run_dir, {"TENSORBOARD_DIR": "/tb/x", "WANDB_DIR": "/w"}, run_id)
    assert (env["TENSORBOARD_DIR"], env["WANDB_DIR"]) == ("/tb/x", "/w")
    # the default list: verl's console and file logger, no tracker variables
    default = verl_overrides(run_cfg("predmask_kl_agg", "qwen3_4b_base", "bf16"))
    assert requested_loggers(default) == ["console", "file"] and tracker_argv(default, run_dir, {}, None)[1] == {}
    # a hand-written command line without trainer.logger gets verl's own default list (W&B included)
    assert requested_loggers(["trainer.nnodes=1"]) == list(compose(["trainer.nnodes=1"]).trainer.logger)
    assert requested_loggers(["trainer.logger=tensorboard"]) == ["tensorboard"]


@pytest.mark.slow
def test_every_launch_of_a_run_directory_hands_verl_the_same_wandb_run(tmp_path) -> None:
    """The real launcher twice on one run directory (``--cfg job``: verl's Hydra app prints the job config and
    stops): one ``wandb_id`` file, the same WANDB_RUN_ID in both attempts' Ray worker environment."""
    require_verl("verl.trainer.main_ppo")
    run_dir = tmp_path / "run"
    cfg = run_cfg("predmask_kl_agg", "qwen3_4b_base", "bf16")
    cfg["trainer"]["logger"] = ["console", "file", "wandb"]
    argv = verl_command(cfg, run_dir)
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VERL_USE_EXTERNAL_MODULES")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    ids = []
    for _ in range(2):
        proc = subprocess.run([*argv[:3], "--cfg", "job", *argv[3:]], capture_output=True, text=True, timeout=300,
                              env=env, cwd=tmp_path, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ids += [line.split(":", 1)[1].strip() for line in proc.stdout.splitlines() if "WANDB_RUN_ID:" in line]
        assert "WANDB_RESUME: allow" in proc.stdout and f"WANDB_DIR: {run_dir}" in proc.stdout
    assert ids == [(run_dir / "wandb_id").read_text().strip()] * 2


CONF_MODELS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "model").glob("qwen3_*.yaml"))


@pytest.mark.parametrize("name", CONF_MODELS)
def test_project_model_configs_translate_and_compose(compose, name: str) -> None:
    """The project's own conf/model files (whatever their current values), composed, give overrides verl accepts."""
    model = to_container(config.compose("train", [f"model={name}"]))["model"]
    precision = "fp8_e2e" if model["engine"] == "megatron" else "bf16"
    cfg = {**run_cfg("predmask_kl_agg", "qwen3_4b_base", precision), "model": model}
    composed = compose(verl_overrides(cfg))
    assert composed.actor_rollout_ref.model.path == model["path"]
    assert composed.actor_rollout_ref.actor.strategy == model["engine"]
    # verl's fused log-prob kernels (the support from the hidden states) where they are wired: the FSDP models
    assert composed.actor_rollout_ref.model.use_fused_kernels is {"qwen3_4b_base": True, "qwen3_8b_base": True,
                                                                  "qwen3_30b_a3b_base": False}[name]


def test_omegaconf_run_config_is_accepted() -> None:
    from omegaconf import OmegaConf

    cfg = run_cfg("dppo_topk_kl", "qwen3_8b_base", "bf16")
    assert verl_overrides(OmegaConf.create(cfg)) == verl_overrides(cfg)


@pytest.mark.parametrize(
    "value",
    ["plain", "/a/b-c_d.parquet", "Qwen/Qwen3-4B-Base", "hdfs://nn:9000/x", "user@host", "predmask.verl",
     "a b", "x; rm -rf /", "$(whoami)", "`id`", "it's", "back\\slash", "ends\\", "q\\'uote", "1e-6", "true",
     "null", "-starts", "a,b", "[x]", "k=v", "${oc.env:HOME}", "{a:1}", "tab\there"],
)
def test_hydra_values_round_trip_as_literal_strings(value: str) -> None:
    """Parsed by Hydra's override grammar and resolved by OmegaConf, each value comes back unchanged."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    (override,) = OverridesParser.create().parse_overrides([f"key={hydra_value(value)}"])
    assert OmegaConf.create({"key": override.value()}).key == value


def test_hydra_values_of_other_types() -> None:
    assert [hydra_value(v) for v in (True, None, 3, 0.15, ["a", 1], {"k": "v w"})] == [
        "true", "null", "3", "0.15", "[a,1]", "{k:'v w'}"]
