"""Bad input to a variational stage (predmask.rl.vr_runner): one line on stderr, exit 2, nothing written in the
run directory (real subprocesses for the command line, ``main`` in-process for the rest)."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from vr_stage_helpers import cli, stage_config, write_stage

from predmask.rl.vr_runner import main, run_stage


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_a_missing_upstream_output_names_the_stage_the_path_and_the_fix(tmp_path: Path) -> None:
    """The weights stage's traces run directory exists but holds no traces.parquet (real subprocess)."""
    (tmp_path / "traces").mkdir()
    (tmp_path / "prior").mkdir()
    (tmp_path / "prior" / "model.pt").write_bytes(b"")
    d = write_stage(tmp_path, "weights", stage_config(tmp_path / "cache", "weights", "weights",
                                                      {"prior": "prior", "traces": "traces"}))
    before = _snapshot(d)
    proc = cli(d)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "stage weights" in lines[0] and str(tmp_path / "traces" / "traces.parquet") in lines[0]
    assert f"python -m predmask.rl.vr_runner {tmp_path / 'traces'}" in lines[0]
    assert _snapshot(d) == before
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    ("stage", "method", "inputs", "extra", "message"),
    [
        ("traces", "traces", {"posterior": "posterior"}, ("traces.k=0",), "traces.k = 0 is not allowed"),
        ("weights", "weights", {"prior": "prior", "traces": "traces"}, ("weights.m=0",),
         "weights.m = 0 is not allowed"),
        ("final", "vr_acc", {"traces": "traces", "weights": "weights"}, ("method.estimator=mean",),
         "unknown estimator 'mean'"),
        ("final", "vr_acc", {"traces": "traces", "weights": "weights"}, ("method.data=everything",),
         "method.data = 'everything' is not allowed; allowed: all_weighted, best_mixed"),
        ("final", "vr_acc", {}, (), "needs inputs.traces"),
        ("final", "sft", {}, ("data.noise=1.5",), "data.noise = 1.5 is not allowed"),
        ("final", "sft", {}, ("stage=sampling",), "stage = 'sampling' is not allowed"),
        ("posterior", "posterior", {}, ('hint.template="{prompt} hint {hint}"',),
         "token 'h' is not in the vocabulary"),
    ],
)
def test_bad_config_is_one_line_and_exit_2_with_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stage: str, method: str, inputs: dict, extra: tuple,
    message: str,
) -> None:
    d = write_stage(tmp_path, "run", stage_config(tmp_path / "cache", stage, method, inputs, *extra))
    before = _snapshot(d)
    assert main([str(d)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert _snapshot(d) == before
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", ".")):
        run_stage(d)


def test_a_run_dir_without_config_and_a_wrong_family_are_refused(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    assert "config.yaml does not exist" in capsys.readouterr().err
    c = stage_config(tmp_path / "cache", "prior", "prior", {})
    c["family"] = "grpo"
    d = write_stage(tmp_path, "run", c)
    assert main([str(d)]) == 2
    assert "family = 'grpo' is not allowed here" in capsys.readouterr().err
    assert sorted(p.name for p in d.iterdir()) == ["config.yaml"]
    assert main([]) == 2 and "usage:" in capsys.readouterr().err


def _wait_for_metrics(proc, run_dir: Path, timeout: float = 240) -> None:
    """Until the stage has written a training step (or the process ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().count("\n") >= 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"the stage wrote no step (exit {proc.poll()}): {proc.communicate()}")


@pytest.mark.slow
def test_ctrl_c_stops_a_stage_with_one_line_and_exit_130(tmp_path: Path) -> None:
    """SIGINT in the posterior's SFT (real subprocess): no traceback, the trainer's one resume line on stderr and in
    status.json, exit 130."""
    d = write_stage(tmp_path, "posterior", stage_config(tmp_path / "cache", "posterior", "posterior", {},
                                                        "posterior.epochs=200"))
    proc = cli(d, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for_metrics(proc, d)
        time.sleep(0.5)  # past the first checkpoint (sft.save_every=2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(("interrupted:", "error:"))]  # not the progress lines
    assert len(lines) == 1 and re.fullmatch(rf"interrupted: run_dir {re.escape(str(d))} stopped at step \d+ \(newest "
                                            r"checkpoint: step_\d{6}\.pt\); rerun the same command to resume it",
                                            lines[0]), err
    status = json.loads((d / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == lines[0]
    assert "Traceback" not in (d / "train.log").read_text()
