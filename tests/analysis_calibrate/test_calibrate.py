"""The training-regime calibration (analysis.calibrate): its statistics against sums written out here, its target
checks on made-up rows, and the command end to end on tiny real runs (subprocesses, resumable)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.calibrate import RunRegime, SettingRegime, check_targets, next_step, run_regime, setting_regime
from predmask import metrics as M
from predmask.rl.task import EVAL_SPLITS

REPO = Path(__file__).resolve().parents[2]
VAL_A, VAL_B = (M.val_acc(split, 16) for split in EVAL_SPLITS)


def _records(steps: list[dict], vals: dict[int, tuple[float, float]]) -> list[dict]:
    out = [{"step": 0, "data": {VAL_A: vals[0][0], VAL_B: vals[0][1]}}]
    for i, d in enumerate(steps, start=1):
        data = dict(d)
        if i in vals:
            data.update({VAL_A: vals[i][0], VAL_B: vals[i][1]})
        out.append({"step": i, "data": data})
    return out


def _step(tokens: float, outside: float, clip: float, disagree: float | None = None, dmax: float = 0.1) -> dict:
    d = {M.MASK_TOKENS: tokens, M.MASK_OUTSIDE_FRAC: outside, M.CLIPFRAC: clip, M.MASK_DIVERGENCE_MAX: dmax,
         M.TIMING_STEP: 1.0}
    if disagree is not None:
        d[M.MASK_DIRECTION_DISAGREE] = disagree
    return d


def test_run_regime_weights_the_share_outside_by_tokens() -> None:
    steps = [_step(1000, 0.0, 0.0, 0, 0.05), _step(500, 0.02, 0.01, 3, 0.4), _step(250, 0.04, 0.03, 2, 0.2)]
    r = run_regime(_records(steps, {0: (0.2, 0.4), 3: (0.5, 0.7)}))
    assert r.steps == 3 and r.tokens == 1750
    assert r.outside_share == pytest.approx((500 * 0.02 + 250 * 0.04) / 1750)  # 20 of 1750 tokens
    assert r.clipfrac == pytest.approx(0.04 / 3)
    assert r.disagreement == 5 and r.divergence_max == 0.4
    assert (r.val_start, r.val_end) == (pytest.approx(0.3), pytest.approx(0.6))
    assert r.gain == pytest.approx(0.3)


def test_run_regime_without_direction_metric_has_no_disagreement() -> None:
    r = run_regime(_records([_step(10, 0.1, 0.1)], {0: (0.0, 0.0), 1: (0.5, 0.5)}))
    assert r.disagreement is None


def test_run_regime_refuses_a_run_without_final_validation() -> None:
    with pytest.raises(ValueError, match="validation at step 0 and at its end"):
        run_regime(_records([_step(10, 0.1, 0.1)], {0: (0.0, 0.0)}))


def test_identical_runs_are_detected_and_a_single_step_difference_is_not_identical() -> None:
    steps = [_step(100, 0.01, 0.01, 1)]
    a = _records(steps, {0: (0.1, 0.1), 1: (0.2, 0.2)})
    b = _records(steps, {0: (0.1, 0.1), 1: (0.2, 0.2)})
    c = _records(steps, {0: (0.1, 0.1), 1: (0.2, 0.2000001)})
    assert setting_regime("s", "bf16", a, b).identical
    assert not setting_regime("s", "bf16", a, c).identical


def _row(setting: str, precision: str, share: float, disagree: float, gain: float = 0.1,
         identical: bool = False) -> SettingRegime:
    run = RunRegime(10, 1000, share, share, None, 0.3, 0.2, 0.2 + gain, 1.0)
    pred = RunRegime(10, 1000, share, share, disagree, 0.3, 0.2, 0.2 + gain, 1.0)
    return SettingRegime(setting, precision, run, pred, identical)


def test_targets_met_and_missed() -> None:
    good = [_row("a", "bf16", 0.001, 5), _row("b", "bf16", 0.004, 9), _row("c", "fp8_e2e", 0.01, 20)]
    assert all(ok for _, ok, _ in check_targets(good))
    bad = [_row("a", "bf16", 0.0001, 0, identical=True), _row("c", "fp8_e2e", 0.00005, 2, gain=-0.1)]
    checks = {name: ok for name, ok, _ in check_targets(bad)}
    assert not any(checks.values()), checks


TINY = [
    "base.steps=40", "base.batch_size=16", "base.eval_problems=8", "task.eval_size=3", "rollout.n=4",
    "rollout.response_length=8", "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=1", "trainer.val_n=2",
    "trainer.steps=4", "trainer.val_every=2", "trainer.save_every=2", "trainer.lr=3e-3",
]


def _calibrate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PREDMASK_CACHE"}  # the default, relative to the cwd
    env["PREDMASK_PROGRESS_INTERVAL_S"] = "0"  # a progress line whenever the runs' step count moves
    return subprocess.run([sys.executable, "-m", "analysis", "calibrate", *args], cwd=tmp_path, env=env,
                          check=False, capture_output=True, text=True, timeout=600)


def test_calibrate_end_to_end_then_resumes_without_training(tmp_path: Path) -> None:
    out = tmp_path / "cal"
    first = _calibrate(tmp_path, "--settings", "qwen3_4b_bf16", "--out", str(out), *TINY)
    assert first.returncode in (0, 3), first.stderr[-2000:]  # 3: some target missed on a 4-step toy run
    table = json.loads((out / "calibration.json").read_text())
    (row,) = table["rows"]
    assert row["setting"] == "qwen3_4b_bf16" and row["precision"] == "bf16"
    run_dirs = sorted(p for p in out.iterdir() if (p / "metrics.jsonl").exists())
    assert len(run_dirs) == 2
    # both runs share the one base model of the default cache under the cwd (the jobs run in their run dirs)
    assert len(list((tmp_path / "results" / "cache").glob("base-cpu_s-*.pt"))) == 1
    assert not any((p / "results").exists() for p in run_dirs)
    # the printed share outside is the token-weighted one of the DPPO-TopK-KL run's own metrics file
    methods = {json.loads((p / "exit_status.json").read_text())["command"][4]: p for p in run_dirs}
    ref = [json.loads(line) for line in (methods["method=dppo_topk_kl"] / "metrics.jsonl").read_text().splitlines()]
    tok = sum(r["data"][M.MASK_TOKENS] for r in ref if r["step"] > 0)
    out_tok = sum(r["data"][M.MASK_OUTSIDE_FRAC] * r["data"][M.MASK_TOKENS] for r in ref if r["step"] > 0)
    assert row["reference"]["outside_share"] == pytest.approx(out_tok / tok)
    assert "| target | met | measured |" in first.stdout and "calibration.md" in first.stdout
    # piped: plain progress lines of the runs' steps, the last one complete; the last line names the next command
    shape = re.compile(
        r"^calibration: 2 runs: (\d+)/8 steps \(\d+%\) (\d)/2 runs done \[elapsed [0-9hms]+(, eta [0-9hms]+)?\]$"
    )
    progress = [m.groups()[:2] for m in map(shape.match, first.stdout.splitlines()) if m]
    assert progress and progress[-1] == ("8", "2"), first.stdout
    assert [int(n) for n, _ in progress] == sorted(int(n) for n, _ in progress)
    logged = [m.groups()[:2] for m in map(shape.match, (out / "calibrate.log").read_text().splitlines()) if m]
    assert logged == progress  # the calibration's log file holds the same lines
    last = first.stdout.splitlines()[-1]
    assert last.startswith("next: ") and "python -m sweeps main_comparison" in last, last
    stamps = {p: (p / "metrics.jsonl").stat().st_mtime_ns for p in run_dirs}
    again = _calibrate(tmp_path, "--settings", "qwen3_4b_bf16", "--out", str(out), *TINY)
    assert again.returncode == first.returncode
    assert {p: (p / "metrics.jsonl").stat().st_mtime_ns for p in run_dirs} == stamps  # read, not retrained
    assert json.loads((out / "calibration.json").read_text())["rows"] == table["rows"]


def test_the_last_line_says_what_to_do_with_the_targets() -> None:
    met = [("bf16 share outside", True, "a 0.1%"), ("every run learns", True, "a +0.1")]
    assert next_step(met, []) == "next: every target met by conf/train.yaml's defaults; python -m sweeps main_comparison"
    assert next_step(met, ["trainer.lr=2e-4", "x=a b"]) == (
        "next: every target met with trainer.lr=2e-4 'x=a b'; python -m sweeps main_comparison trainer.lr=2e-4 "
        "'x=a b' (or make them the defaults in conf/train.yaml)"
    )
    missed = next_step([met[0], ("every run learns", False, "a -0.1")], ["trainer.lr=2e-4"])
    assert missed.startswith("next: 1 target(s) missed (every run learns); try other overrides, e.g. python -m ")
    assert "python -m analysis calibrate" in missed and "python -m sweeps main_comparison" in missed


@pytest.mark.parametrize(("args", "message"), [
    (["--settings", "nope"], "unknown setting 'nope'"),
    (["method=grpo_clip_higher"], "sets method, setting, seed and run_dir itself"),
    (["trainer.lr=abc"], "trainer.lr"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "cal"
    res = _calibrate(tmp_path, "--out", str(out), *args)
    assert res.returncode == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()
