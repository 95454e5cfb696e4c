"""Helpers of the variational stage tests: a test-sized config (a model much smaller than cpu_s, a 40-step base
model), stage run directories written as the sweep writes them (config.yaml in a sibling directory per stage), and
an extra estimator registered for one test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import predmask.vr_weights as vr
from predmask.config import compose, to_container

REPO = Path(__file__).resolve().parents[2]

#: test sizes: 24 questions, K=3 traces, M=3 answers, 2 questions per step, avg@4 on 3-problem eval splits
TINY = [
    "model.name=vr_tiny", "model.label='vr_tiny: test-sized stand-in model (not a real model)'",
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "base.steps=40", "base.batch_size=16", "base.eval_problems=8", "task.eval_size=3",
    "data.questions=24", "traces.k=3", "weights.m=3", "eval.n=4", "rft.samples=3",
    "sft.questions_per_step=2", "sft.save_every=2", "sft.warmup=2", "posterior.epochs=1", "final.epochs=1",
]


def stage_config(cache_dir: Path, stage: str, method: str, inputs: dict[str, str], *extra: str) -> dict:
    """The resolved config of one stage run: conf/variational.yaml with TINY, the stage's method name (a final
    recipe, or the stage's own name as the sweep sets it) and its inputs."""
    recipe = method if stage == "final" else "sft"
    c = to_container(compose("variational", [*TINY, f"cache_dir={cache_dir}", f"stage={stage}",
                                             f"vr_method@method={recipe}", *extra]))
    if stage != "final":
        c["method"] = {"name": stage, "label": stage}
    c["inputs"] = dict(inputs)
    return c


def write_stage(root: Path, name: str, config: dict) -> Path:
    """``root/name/config.yaml`` as the sweep writes it (yaml.safe_dump of the resolved config)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return d


def cli(run_dir: Path, **kw) -> subprocess.Popen:
    """``python -m predmask.rl.vr_runner RUN_DIR`` as a real subprocess."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "predmask.rl.vr_runner", str(run_dir)], cwd=run_dir.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _log_uniform(answer_logp: torch.Tensor | None, answer_tokens: torch.Tensor | None,
                 correct: torch.Tensor | None) -> torch.Tensor:
    """log P̂(correct) = 0 for every trace: the weights are the softmax of the log ratios alone."""
    assert correct is not None
    return torch.zeros(correct.shape[0], dtype=torch.float64)


def register_uniform(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimator ``uniform`` in ``predmask.vr_weights.ESTIMATORS`` for this test only."""
    monkeypatch.setitem(vr.ESTIMATORS, "uniform", vr.Estimator("uniform", "uniform", ("correct",), _log_uniform))
