"""The launcher: plugin environment and argv, verl's Hydra app run in-process, the plugin loaded in Ray workers.

Real verl, real Hydra, real (local, CPU) Ray; nothing mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from verl_helpers import GOLDEN, REPO, require_verl

from predmask.verl.launch import launch_argv, plugin_modules_value
from predmask.verl.overrides import PLUGIN_ENV, PLUGIN_MODULE

pytestmark = pytest.mark.verl
ENV_OVERRIDE = f"+ray_kwargs.ray_init.runtime_env.env_vars.{PLUGIN_ENV}"
#: the launcher's settings override when no predmask.* key is given (see tests/verl/test_verl_settings.py)
NO_SETTINGS = "+ray_kwargs.ray_init.runtime_env.env_vars.PREDMASK_VERL_SETTINGS='{}'"


def test_plugin_modules_value_appends_once() -> None:
    assert PLUGIN_MODULE == "predmask.verl.plugin"
    assert plugin_modules_value(None) == "predmask.verl.plugin"
    assert plugin_modules_value("a.b, c") == "a.b,c,predmask.verl.plugin"
    assert plugin_modules_value("predmask.verl.plugin,x") == "predmask.verl.plugin,x"
    assert plugin_modules_value("predmask.verl") == "predmask.verl,predmask.verl.plugin"  # the package installs nothing


def test_launch_argv_adds_the_worker_env_and_the_v0_trainer() -> None:
    argv, env = launch_argv(["trainer.nnodes=4"], {})
    assert argv == ["trainer.nnodes=4", f"{ENV_OVERRIDE}=predmask.verl.plugin", "trainer.use_v1=false", NO_SETTINGS]
    assert env == {PLUGIN_ENV: "predmask.verl.plugin", "PREDMASK_VERL_SETTINGS": "{}"}
    argv, env = launch_argv(["trainer.use_v1=false"], {PLUGIN_ENV: "my.plugin"})
    assert argv == ["trainer.use_v1=false", f"{ENV_OVERRIDE}='my.plugin,predmask.verl.plugin'", NO_SETTINGS]
    assert env == {PLUGIN_ENV: "my.plugin,predmask.verl.plugin", "PREDMASK_VERL_SETTINGS": "{}"}


def test_launch_argv_keeps_an_explicit_worker_env_and_refuses_bad_ones() -> None:
    argv, _ = launch_argv([f"{ENV_OVERRIDE}=predmask.verl.plugin"], {})
    assert argv.count(f"{ENV_OVERRIDE}=predmask.verl.plugin") == 1
    argv, _ = launch_argv([f"{ENV_OVERRIDE}='other,predmask.verl.plugin'"], {})
    assert argv == [f"{ENV_OVERRIDE}='other,predmask.verl.plugin'", "trainer.use_v1=false", NO_SETTINGS]
    for bad in ("other", "predmask.verl", "predmask.verl.plugins"):  # a list entry, not a substring, must match
        with pytest.raises(ValueError, match="must include predmask.verl.plugin"):
            launch_argv([f"{ENV_OVERRIDE}={bad}"], {})
    with pytest.raises(ValueError, match="use_v1"):
        launch_argv(["trainer.use_v1=true"], {})


def test_launch_argv_forwards_the_file_logger_path_to_the_workers() -> None:
    key = "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH"
    argv, _ = launch_argv(["a=1", f"{key}=/run/metrics.jsonl"], {"VERL_FILE_LOGGER_PATH": "/run/metrics.attempt2.jsonl"})
    assert [a for a in argv if a.startswith(key)] == [f"{key}=/run/metrics.attempt2.jsonl"]
    argv, _ = launch_argv(["a=1", f"{key}=/run/metrics.jsonl"], {})
    assert f"{key}=/run/metrics.jsonl" in argv


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", PLUGIN_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
def test_launcher_runs_verls_hydra_app_with_the_overrides(tmp_path) -> None:
    """``--cfg job`` makes verl's own Hydra app print the composed job config and stop before training."""
    require_verl("verl.trainer.main_ppo")
    overrides = (GOLDEN / "predmask_kl_agg__qwen3_30b_a3b_base__fp8_e2e.txt").read_text().split()
    overrides = [o for o in overrides if not o.startswith("hydra.run.dir=")] + [f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "-m", "predmask.verl.launch", "--cfg", "job", *overrides],
                          capture_output=True, text=True, timeout=240, env=_env(), cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    cap = next(float(o.split("=", 1)[1]) for o in overrides if o.startswith("predmask.ratio_cap="))  # the recipe's
    for needle in ("loss_mode: predmask_kl_agg", "calculate_log_probs: true", "quantization: fp8", "fp8: hybrid",
                   f'PREDMASK_VERL_SETTINGS: \'{{"anchor":"rollout","delta":0.15,"ratio_cap":{cap},"session":',
                   "use_v1: false", "VERL_USE_EXTERNAL_MODULES: predmask.verl.plugin"):
        assert needle in out, needle
    bad = subprocess.run([sys.executable, "-m", "predmask.verl.launch", "trainer.use_v1=true"], capture_output=True,
                         text=True, timeout=60, env=_env(), cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "use_v1" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_ray_workers_import_the_plugin_through_the_runtime_env(monkeypatch) -> None:
    """What the launcher's runtime_env override does: a Ray worker that imports verl gets the losses registered
    and the actor worker patched; without the variable it gets neither."""
    require_verl("verl.workers.engine_workers")
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")

    def probe():
        from verl.trainer.ppo import core_algos
        from verl.workers import engine_workers

        import predmask

        registered = sorted(n for n in predmask.METHODS if n in core_algos.POLICY_LOSS_REGISTRY)
        patched = bool(getattr(engine_workers.ActorRolloutRefWorker.actor_worker_cls, "predmask_topk", False))
        return registered, patched

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {PLUGIN_ENV: PLUGIN_MODULE, "PYTHONPATH": _env()["PYTHONPATH"]}})
    try:
        remote = ray.remote(probe)
        registered, patched = ray.get(remote.remote(), timeout=180)
        import predmask

        assert registered == sorted(predmask.METHODS) and patched
        control = remote.options(runtime_env={"env_vars": {PLUGIN_ENV: "", "PYTHONPATH": _env()["PYTHONPATH"]}})
        assert ray.get(control.remote(), timeout=180) == ([], False)
    finally:
        ray.shutdown()


def test_the_launcher_finds_its_run_dir_from_verls_hydra_dir(tmp_path) -> None:
    from predmask.verl.launch import run_dir_of

    assert run_dir_of([f"hydra.run.dir={tmp_path}/r1/hydra", "x=1"]) == tmp_path / "r1"
    assert run_dir_of([f"hydra.run.dir='{tmp_path}/r 2/hydra'"]) == tmp_path / "r 2"
    assert run_dir_of([f"hydra.run.dir={tmp_path}/elsewhere"]) is None  # not a predmask run directory
    assert run_dir_of(["x=1"]) is None


def test_a_second_launcher_on_a_run_dir_being_written_refuses_in_one_line(tmp_path) -> None:
    """A real process holds the run dir's writer lock; the launcher refuses before verl starts, writing nothing."""
    run_dir = tmp_path / "run"
    script = ("import time; from pathlib import Path; from predmask.rundir import hold_run_lock\n"
              f"with hold_run_lock(Path({str(run_dir)!r})):\n    print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = sorted(p.name for p in run_dir.iterdir())
        proc = subprocess.run([sys.executable, "-m", "predmask.verl.launch", f"hydra.run.dir={run_dir}/hydra"],
                              capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path, check=False)
        assert proc.returncode == 1, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "being written by another trainer" in lines[0] and f"pid {holder.pid}" in lines[0]
        assert sorted(p.name for p in run_dir.iterdir()) == before
    finally:
        holder.kill()
        holder.wait()


def test_the_launcher_keeps_status_json_as_the_cpu_trainer_does(tmp_path) -> None:
    """status.json follows verl's metrics.jsonl while the run trains, then says how it ended (real files and a real
    thread; verl itself is replaced by the body of the ``with``)."""
    import json
    import time

    from predmask.rundir import METRICS_FILE, STATUS_FILE, metrics_line, read_status
    from predmask.verl.launch import kept_status, total_steps_of

    assert total_steps_of(["trainer.total_training_steps=7", "a=b"]) == 7 and total_steps_of(["a=b"]) == 0
    metrics = tmp_path / METRICS_FILE
    with kept_status(tmp_path, 3, every_s=0.05):
        assert read_status(tmp_path) | {"updated": 0} == {"status": "running", "step": 0, "total_steps": 3,
                                                          "updated": 0, "error": None}
        metrics.write_text(metrics_line(1, {"x": 1.0}) + metrics_line(2, {"x": 2.0}))
        deadline = time.monotonic() + 10
        while read_status(tmp_path)["step"] != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_status(tmp_path)["step"] == 2
    assert (read_status(tmp_path)["status"], read_status(tmp_path)["step"]) == ("completed", 2)
    for exc, error in ((RuntimeError("vLLM died\nmore"), "RuntimeError: vLLM died"), (KeyboardInterrupt(), "interrupted"),
                       (SystemExit(1), "SystemExit: 1")):
        with pytest.raises(type(exc)), kept_status(tmp_path, 3, every_s=0.05):
            raise exc
        assert (read_status(tmp_path)["status"], read_status(tmp_path)["error"]) == ("failed", error)
    with pytest.raises(SystemExit), kept_status(tmp_path, 3):
        raise SystemExit(0)  # Hydra's normal end
    assert json.loads((tmp_path / STATUS_FILE).read_text())["status"] == "completed"
