"""Bad input to a variational stage (predmask.rl.vr_runner): one line on stderr, exit 2, nothing written in the
run directory (real subprocesses for the command line, ``main`` in-process for the rest)."""

from __future__ import annotations

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
