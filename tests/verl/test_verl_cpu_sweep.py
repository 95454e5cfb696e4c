"""verl 0.9.1's own trainer end to end on this CPU, through the project's sweep: ``python -m sweeps smoke
cluster=verl_cpu`` for 3 steps, the four main methods, then the real DuckDB file.

Nothing is mocked: submitit's local executor starts a Ray node, ``predmask.verl.launch`` runs verl's ``main_ppo``
(FSDP2 actor, vLLM's CPU build as the async rollout, the plugin's losses and top-K hook) in ``.venv-verl``, on the
CPU engine's stand-in model and task exported by the sweep, and the sweep ingests verl's metrics. Needs
``.venv-verl`` (``EXTRAS=verl-cpu bash scripts/install.sh``): skipped without it, except under ``CI=true``, where
.ci/run builds it and the test must run. About 10 minutes on 2 cores.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from launch.executor import CHECKOUT

pytestmark = [pytest.mark.verl_cpu, pytest.mark.slow]

VERL_PYTHON = CHECKOUT / ".venv-verl" / "bin" / "python"
METHODS = ("grpo_clip_higher", "dppo_topk_kl", "predmask_kl_agg", "predmask_kl_uniform")  # the smoke sweep's
STEPS = 3


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    if not VERL_PYTHON.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{VERL_PYTHON} is missing under CI=true: .ci/run must run EXTRAS=verl-cpu bash scripts/install.sh")
        pytest.skip(f"no {VERL_PYTHON}: EXTRAS=verl-cpu bash scripts/install.sh builds it")
    tmp = tmp_path_factory.mktemp("verl_cpu")
    env = {**os.environ, "PREDMASK_DB": str(tmp / "db.duckdb"), "PREDMASK_RUNS": str(tmp / "runs"),
           "PREDMASK_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "sweeps", "smoke", "cluster=verl_cpu", f"trainer.steps={STEPS}",
         f"trainer.val_every={STEPS}", f"trainer.save_every={STEPS}"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=1800, check=False)
    return tmp, proc


def _metrics(db: Path) -> dict[str, dict[str, dict[int, float]]]:
    """run method -> metric -> step -> value, from the database the sweep ingested into."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute("SELECT r.config, m.name, m.step, m.value FROM metrics m JOIN runs r USING (run_id)"
                           ).fetchall()
    finally:
        con.close()
    import json

    out: dict[str, dict[str, dict[int, float]]] = {}
    for config, name, step, value in rows:
        method = json.loads(config)["method"]["name"]
        out.setdefault(method, {}).setdefault(name, {})[int(step)] = float(value)
    return out


def test_every_method_trains_through_verl_and_lands_in_duckdb(swept) -> None:
    tmp, proc = swept
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    metrics = _metrics(tmp / "db.duckdb")
    assert sorted(metrics) == sorted(METHODS)
    for method, series in metrics.items():
        assert sorted(series["training/global_step"]) == list(range(1, STEPS + 1)), method
        # rewards vary within groups, so advantages are non-zero and the plugin's loss has a gradient
        assert max(series["critic/advantages/max"].values()) > 0, method
        assert max(series["actor/grad_norm"].values()) > 0, method
        assert all(math.isfinite(v) for v in series["actor/pg_loss"].values()), method
        # validation on the stand-in's held-out splits before training and at the end, as the CPU engine's
        assert {0, STEPS} <= set(series["val-core/aime24_standin/acc/mean@16"]), method
        if method != "grpo_clip_higher":  # the top-K methods: the hook's support reached the loss
            assert min(series["actor/mask/tokens"].values()) > 0, method
            # the support gather at the sampled token is verl's own log-prob (up to bf16 rounding)
            assert max(series["actor/mask/pi_sampled_gap"].values()) < 0.1, method
            # no old-log-prob forward: nothing compares pi_old with mu
            assert not any(name.startswith("rollout_corr/") for name in series), method


def test_the_runs_say_what_they_were(swept) -> None:
    tmp, proc = swept
    assert proc.returncode == 0, proc.stderr[-3000:]
    con = duckdb.connect(str(tmp / "db.duckdb"), read_only=True)
    try:
        configs = [row[0] for row in con.execute("SELECT config FROM runs").fetchall()]
    finally:
        con.close()
    import json

    for text in configs:
        cfg = json.loads(text)
        assert (cfg["cluster"]["name"], cfg["cluster"]["device"], cfg["cluster"]["standin"]) == (
            "verl_cpu", "cpu", "cpu_s32")
