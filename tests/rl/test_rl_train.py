"""The trainer (predmask.rl.train): run-directory contract, verl metric lines, resume after SIGKILL, determinism."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from predmask.config import ConfigError, compose, to_container
from predmask.methods import MethodParams
from predmask.metrics import metric, wall_clock
from predmask.precisions import get_precision
from predmask.rl.train import run
from predmask.rundir import CORRUPT_METRICS_FILE, read_metrics

REPO = Path(__file__).resolve().parents[2]

#: a run small enough for tests: 40-step base model, 4 prompts x 4 responses, 2 mini-batches
TINY = [
    "method=predmask_kl_agg", "model=cpu_s", "precision=bf16",
    "base.steps=40", "base.batch_size=16", "base.eval_problems=8",
    "task.eval_size=3", "rollout.n=4", "rollout.response_length=8",
    "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "trainer.val_n=2",
    "trainer.progress=false",
]

VERL_NAMES = ("critic/score/mean", "response_length/mean", "actor/ppo_kl", "actor/pg_clipfrac",
              "training/global_step", "actor/pg_loss", "actor/grad_norm")
MASK_NAMES = ("actor/mask/tokens", "actor/mask/divergence_mean", "actor/mask/divergence_max",
              "actor/mask/outside_frac", "actor/mask/mu_tail_clamped", "actor/mask/pi_tail_clamped",
              "actor/mask/direction_disagree")
VAL_NAMES = ("val-core/aime24_standin/acc/mean@2", "val-core/aime25_standin/acc/mean@2")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Builds the tiny base model once (in this process); every run below loads it from this cache."""
    from predmask.rl.engine import Engine

    d = tmp_path_factory.mktemp("cache")
    torch.set_num_threads(1)
    Engine(compose("train", [*TINY, f"cache_dir={d}"]), progress=False)
    return d


def _overrides(cache_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*TINY, f"cache_dir={cache_dir}", f"run_dir={run_dir}", *extra]


def _scientific(records: list[dict]) -> list[tuple[int, dict]]:
    return [(r["step"], {k: v for k, v in r["data"].items() if not wall_clock(k)})
            for r in records]


def test_run_directory_contract_and_metric_names(cache_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    summary = run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=4", "trainer.val_every=2",
                                                  "trainer.save_every=2")))
    assert summary["step"] == 4
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "completed" and status["step"] == 4 and status["total_steps"] == 4
    assert status["error"] is None and status["updated"] <= time.time()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]                    # every line is one JSON object
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert all(set(r) == {"step", "data"} for r in records)
    for r in records[1:]:
        d = r["data"]
        for name in (*VERL_NAMES, *MASK_NAMES, "rollout_corr/topk_kl", "rollout_corr/kl"):
            assert name in d, name
        assert d["training/global_step"] == r["step"]
        assert 0.0 <= d["critic/score/mean"] <= 1.0 and 1 <= d["response_length/mean"] <= 8
        assert all(isinstance(v, (int, float)) for v in d.values())
        assert all(metric(k) for k in d)                              # every name is in the catalogue
    for step in (0, 2, 4):
        for name in VAL_NAMES:
            assert 0.0 <= records[step]["data"][name] <= 1.0
    assert not any(n in records[1]["data"] for n in VAL_NAMES)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["method"]["name"] == "predmask_kl_agg" and cfg["trainer"]["steps"] == 4
    assert cfg["precision"]["emulates"] == get_precision("bf16").emulates and "stand-in" in cfg["model"]["label"]
    assert cfg["method"]["ratio_cap"] == MethodParams.ratio_cap and cfg["method"]["delta"] == 0.15
    assert "eps_low" not in cfg["method"]                              # only the parameters the method reads
    assert cfg["model"]["stands_in_for"] == "qwen3_4b_base" and "stand-in" in cfg["task"]["label"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002.pt", "step_000004.pt"]
    log = (run_dir / "train.log").read_text()
    assert "CPU emulation" in log and "stand-in" in log and "completed at step 4" in log
    # started again when complete: nothing is redone, nothing duplicated
    run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=4", "trainer.val_every=2",
                                        "trainer.save_every=2")))
    assert (run_dir / "metrics.jsonl").read_text().splitlines() == lines


def test_a_different_config_in_the_same_run_dir_is_refused(cache_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=1")))
    with pytest.raises(ValueError, match="different config.*seed"):
        run(compose("train", _overrides(cache_dir, run_dir, "trainer.steps=1", "seed=5")))


def test_a_corrupt_line_in_the_middle_loses_no_valid_line_on_resume(cache_dir: Path, tmp_path: Path) -> None:
    """A bad line among valid ones (bad disk, hand edit): resuming keeps every valid line up to the checkpoint,
    moves the bad one to metrics.corrupt.jsonl and says so in train.log (the run it resumes is the real trainer)."""
    run_dir = tmp_path / "run"
    extra = ("trainer.steps=8", "trainer.save_every=4", "trainer.val_every=4")
    run(compose("train", _overrides(cache_dir, run_dir, *extra)))
    (run_dir / "checkpoints" / "step_000008.pt").unlink()  # the newest checkpoint is now step 4
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    original = [json.loads(line) for line in lines]
    lines[2] = "garbage from a bad disk\n"  # step 2 of 0..8
    path.write_text("".join(lines))
    run(compose("train", _overrides(cache_dir, run_dir, *extra)))
    after = read_metrics(path)
    assert [r["step"] for r in after] == [0, 1, *range(3, 9)]
    assert _scientific(after[:4]) == _scientific([original[i] for i in (0, 1, 3, 4)])  # the valid lines, untouched
    assert (run_dir / CORRUPT_METRICS_FILE).read_text() == "garbage from a bad disk\n"
    assert "1 unparseable line(s) of metrics.jsonl moved to metrics.corrupt.jsonl" in (run_dir / "train.log").read_text()


def _cli(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "predmask.rl.train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _kill_at_step(proc: subprocess.Popen, metrics: Path, step: int) -> None:
    """SIGKILL the trainer ``proc`` once ``metrics`` holds ``step`` (or after 240 s), and wait for it to die."""
    deadline = time.time() + 240
    while time.time() < deadline:
        recs = read_metrics(metrics)
        if recs and recs[-1]["step"] >= step:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_resume_after_sigkill_equals_an_uninterrupted_run(cache_dir: Path, tmp_path: Path) -> None:
    """Real subprocesses: one uninterrupted run; one killed with SIGKILL mid-way, then started again."""
    extra = ("trainer.steps=16", "trainer.save_every=4", "trainer.val_every=5")
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    full = _cli(_overrides(cache_dir, full_dir, *extra), cwd=tmp_path)
    out, _ = full.communicate(timeout=300)
    assert full.returncode == 0, out

    victim = _cli(_overrides(cache_dir, killed_dir, *extra), cwd=tmp_path)
    _kill_at_step(victim, killed_dir / "metrics.jsonl", 6)
    status = json.loads((killed_dir / "status.json").read_text())
    before = read_metrics(killed_dir / "metrics.jsonl")
    assert status["status"] == "running" and before[-1]["step"] < 16, "the run finished before it was killed"

    resumed = _cli(_overrides(cache_dir, killed_dir, *extra), cwd=tmp_path)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert "resumed from step_0000" in (killed_dir / "train.log").read_text()

    a = read_metrics(full_dir / "metrics.jsonl")
    b = read_metrics(killed_dir / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(17))                  # no duplicated, no missing step
    assert _scientific(a) == _scientific(b)                            # same seed + config -> same metrics
    assert json.loads((killed_dir / "status.json").read_text())["status"] == "completed"
    # Hydra changed no directory and wrote no outputs/.hydra/multirun directories
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "killed"]


@pytest.mark.slow
def test_one_trainer_per_run_dir_and_a_sigkilled_one_is_dead(cache_dir: Path, tmp_path: Path) -> None:
    """Real trainers: a second one on a live run_dir exits 2 with one line naming the first one's pid and writes
    nothing; the first one SIGKILLed leaves status.json at "running" with the lock free, which reads as dead in
    predmask.rundir.run_status and is stored as dead by ingest (a real DuckDB file)."""
    from analysis.store import connect, ingest_run_dir
    from predmask.rundir import run_status, run_writer_alive

    run_dir = tmp_path / "run"
    args = _overrides(cache_dir, run_dir, "trainer.steps=500", "trainer.save_every=0", "trainer.val_every=0")
    first = _cli(args, cwd=tmp_path)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (read_metrics(run_dir / "metrics.jsonl")[1:] or first.poll() is not None):
            time.sleep(0.05)
        assert first.poll() is None and run_writer_alive(run_dir), "the first trainer is not training"
        written = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.name in ("config.yaml", "train.log")}
        second = _cli(args, cwd=tmp_path)
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 2
        assert out.strip().splitlines() == [
            f"error: run_dir {run_dir} is being written by another trainer (pid {first.pid})"]
        assert (run_dir / "config.yaml").read_bytes() == written["config.yaml"]
        assert (run_dir / "train.log").read_bytes().count(b"start: run_dir") == 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "running" and not run_writer_alive(run_dir)
    assert run_status(run_dir, status["status"]) == "dead"
    con = connect(tmp_path / "db.duckdb")
    res = ingest_run_dir(con, run_dir)
    assert res.status == "dead" and res.rows_added > 0
    assert con.execute("SELECT status FROM runs").fetchall() == [("dead",)]
    con.close()


def test_cli_bad_input_is_one_line(cache_dir: Path, tmp_path: Path) -> None:
    proc = _cli(_overrides(cache_dir, tmp_path / "r", "trainer.train_batch_size=3"), cwd=tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "error: trainer.train_batch_size (3) must be a multiple of trainer.ppo_mini_batch_size (2)" in out
    assert "Traceback" not in out
    assert not (tmp_path / "r").exists()  # rejected before anything is written, run_dir included


@pytest.mark.parametrize(("bad", "message"), [
    ("trainer.steps=0", "error: trainer.steps must be >= 1, got 0"),
    ("top_k=1000", "error: top_k"),
    ("rollout.n=1", "error: rollout.n must be >= 2: GRPO's advantage is a reward minus the mean of its group"),
])
def test_a_bad_config_exits_2_in_one_line_and_creates_no_run_dir(cache_dir: Path, tmp_path: Path, bad: str,
                                                                  message: str) -> None:
    """A real CLI process; the run directory does not exist afterwards, nor anything in the working directory."""
    work = tmp_path / "cwd"
    work.mkdir()
    proc = _cli(_overrides(cache_dir, tmp_path / "r", bad), cwd=work)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), out
    assert "Traceback" not in out
    assert not (tmp_path / "r").exists() and not any(work.iterdir())


def test_cluster_model_maps_to_its_cpu_standin_and_unknown_names_fail() -> None:
    from predmask.rl.engine import prepare_config

    c = prepare_config(compose("train", ["+setting=qwen3_30b_a3b_fp8_rollout"]))
    assert c["model"]["name"] == "cpu_moe" and c["model"]["resolved_from"] == "qwen3_30b_a3b_base"
    assert c["precision"]["name"] == "fp8_rollout"
    with pytest.raises(ConfigError, match="nonexistent_method"):
        compose("train", ["method=nonexistent_method"])
    bad = to_container(compose("train", []))
    bad["model"]["backend"] = "hf"
    with pytest.raises(ValueError, match="not a CPU model"):
        prepare_config(bad)


def _prompts_seen(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every prompt the real trainer hands to the real ``Engine.train_step``, in order (a spy: the step runs)."""
    from predmask.rl.engine import Engine

    seen: list[str] = []
    real = Engine.train_step

    def spy(self: Engine, problems: list, generator: torch.Generator) -> dict:
        seen.extend(p.prompt for p in problems)
        return real(self, problems, generator)

    monkeypatch.setattr(Engine, "train_step", spy)
    return seen


def test_seeds_are_replicates_with_their_own_prompt_order(cache_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two seeds of one cell train on different prompt streams; one seed twice sees the same prompts and the same
    metrics; a seed-1 run stopped at step 2 and resumed to step 3 sees the prompts of an uninterrupted one."""
    seen = _prompts_seen(monkeypatch)

    def prompts(name: str, *extra: str) -> tuple[list[str], list]:
        start = len(seen)
        run(compose("train", _overrides(cache_dir, tmp_path / name, "trainer.val_every=0", *extra)))
        return seen[start:], _scientific(read_metrics(tmp_path / name / "metrics.jsonl"))

    s0, m0 = prompts("s0", "trainer.steps=3", "seed=0")
    s0_again, m0_again = prompts("s0-again", "trainer.steps=3", "seed=0")
    s1, m1 = prompts("s1", "trainer.steps=3", "seed=1")
    assert len(s0) == len(s1) == 3 * 4
    assert s0_again == s0 and m0_again == m0
    assert s1 != s0 and s1[:4] != s0[:4]
    assert m1 != m0
    cut, _ = prompts("s1-resumed", "trainer.steps=2", "trainer.save_every=1", "seed=1")
    rest, m1_resumed = prompts("s1-resumed", "trainer.steps=3", "trainer.save_every=1", "seed=1")
    assert cut + rest == s1

    def training(records: list) -> list:  # the stopped run validated at its last step (2) too
        return [(step, {k: v for k, v in d.items() if not k.startswith("val-")}) for step, d in records]

    assert training(m1_resumed) == training(m1)
