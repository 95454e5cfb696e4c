"""The variational stage runner end to end (predmask.rl.vr_runner) at test size: every stage in sibling run
directories as a sweep lays them out, the parquet files checked against independently computed log-probs and a
separately written weight normalisation, the metric names, resume of a SIGKILLed posterior (real subprocesses)."""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from vr_stage_helpers import cli, register_uniform, stage_config, write_stage

from predmask import metrics as M
from predmask.rl.base import load_base_model
from predmask.rl.model import build_policy
from predmask.rl.task import EVAL_SPLITS, make_split, reward
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.rl.vr_runner import (
    MODEL_FILE,
    PRIOR_LABEL,
    TRACES_COLUMNS,
    TRACES_FILE,
    WEIGHTS_FILE,
    run_stage,
)
from predmask.rundir import read_metrics
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.train_schema import BaseConfig
from predmask.vr_weights import weights_columns

#: final runs of the pipeline: run dir name -> (recipe, extra overrides)
FINALS = {"sft": ("sft", ()), "rft": ("rft", ()), "vr_acc": ("vr_acc", ()),
          "vr_acc_best": ("vr_acc", ("method.data=best_mixed",))}
VR_INPUTS = {"traces": "traces", "weights": "weights"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every stage once: prior through the CLI (a real subprocess), the others through run_stage."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sweep")
    cache = root.parent / f"{root.name}-cache"
    c = stage_config(cache, "prior", "prior", {})
    load_base_model(c["model"], TaskConfig.from_mapping(c["task"]), BaseConfig.from_mapping(c["base"]),
                    cache_dir=cache, progress=False)
    proc = cli(write_stage(root, "prior", c))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    run_stage(write_stage(root, "posterior", stage_config(cache, "posterior", "posterior", {})))
    run_stage(write_stage(root, "traces", stage_config(cache, "traces", "traces", {"posterior": "posterior"})))
    run_stage(write_stage(root, "weights", stage_config(cache, "weights", "weights",
                                                        {"prior": "prior", "traces": "traces"})))
    for name, (recipe, extra) in FINALS.items():
        inputs = VR_INPUTS if recipe.startswith("vr_") else {}
        run_stage(write_stage(root, name, stage_config(cache, "final", recipe, inputs, *extra)))
    return root


def _config(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


def _model(run_dir: Path, path: Path) -> torch.nn.Module:
    c = _config(run_dir)
    tok = ArithmeticTokenizer(TaskConfig.from_mapping(c["task"]).max_number)
    model = build_policy(c["model"], tok.vocab_size, int(c["base"]["seed"]))
    model.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    return model.eval()


def _reference_logprob(model: torch.nn.Module, tok: ArithmeticTokenizer, prompt: str, response: str,
                       first: int, last: int) -> float:
    """Σ log p of response tokens [first, last) after ``prompt``: one plain full forward, no padding, no cache."""
    p = tok.encode(prompt, bos=True)
    r = tok.encode(response, eos=True)
    ids = torch.tensor([p + r])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    return float(sum(logp[len(p) - 1 + t, r[t]] for t in range(first, last)))


def test_every_stage_completes_with_its_files_and_labels(sweep: Path) -> None:
    outputs = {"prior": MODEL_FILE, "posterior": MODEL_FILE, "traces": TRACES_FILE, "weights": WEIGHTS_FILE,
               **{name: MODEL_FILE for name in FINALS}}
    for name, output in outputs.items():
        d = sweep / name
        assert json.loads((d / "status.json").read_text())["status"] == "completed", name
        assert (d / output).is_file() and (d / "metrics.jsonl").is_file(), name
        text = (d / "train.log").read_text()
        assert PRIOR_LABEL in text and "vr_tiny: test-sized stand-in model" in text and "not AIME" in text, name
    info = torch.load(sweep / "prior" / MODEL_FILE, weights_only=True)["info"]
    assert info["role"] == PRIOR_LABEL
    assert not list(sweep.glob("*/*.tmp*"))


def test_prior_is_the_cached_base_model(sweep: Path) -> None:
    c = _config(sweep / "prior")
    base, _ = load_base_model(c["model"], TaskConfig.from_mapping(c["task"]), BaseConfig.from_mapping(c["base"]),
                              cache_dir=c["cache_dir"], progress=False)
    saved = torch.load(sweep / "prior" / MODEL_FILE, weights_only=True)["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in base.state_dict().items())
    final = torch.load(sweep / "sft" / MODEL_FILE, weights_only=True)["state_dict"]
    assert any(not torch.equal(final[k], v) for k, v in base.state_dict().items())


def test_metric_names_are_the_catalogues(sweep: Path) -> None:
    n = 4
    evals = {name for s in EVAL_SPLITS for name in (M.val_acc(s, n), M.val_response_length(s),
                                                     *(M.val_pass(s, k) for k in range(1, n + 1)))}
    prior = read_metrics(sweep / "prior" / "metrics.jsonl")
    assert [r["step"] for r in prior] == [0] and evals <= set(prior[0]["data"])
    for s in EVAL_SPLITS:  # pass@k rises with k, pass@1 is avg@n
        curve = [prior[0]["data"][M.val_pass(s, k)] for k in range(1, n + 1)]
        assert curve == sorted(curve) and curve[0] == pytest.approx(prior[0]["data"][M.val_acc(s, n)])
    steps = 24 // 2  # data.questions / sft.questions_per_step, one epoch
    for name in ("posterior", *FINALS):
        recs = read_metrics(sweep / name / "metrics.jsonl")
        assert [r["step"] for r in recs] == list(range(1, steps + 1)), name
        assert all(M.TRAIN_LOSS in r["data"] for r in recs), name
        if name != "posterior":
            assert evals <= set(recs[-1]["data"]), name
    for path in sweep.glob("*/metrics.jsonl"):
        for rec in read_metrics(path):
            for key in rec["data"]:
                M.metric(key)  # every logged name is in the catalogue


def test_traces_file_holds_k_traces_per_question_and_q_phis_logprobs(sweep: Path) -> None:
    frame = pd.read_parquet(sweep / "traces" / TRACES_FILE)
    assert tuple(frame.columns) == TRACES_COLUMNS
    c = _config(sweep / "traces")
    task = TaskConfig.from_mapping(c["task"])
    tok = ArithmeticTokenizer(task.max_number)
    problems = make_split(task, "train", 24)
    assert sorted(zip(frame["question"], frame["trace"])) == [(q, k) for q in range(24) for k in range(3)]
    assert list(frame["hint"]) == [problems[q].answer for q in frame["question"]]
    assert list(frame["prompt"]) == [problems[q].prompt for q in frame["question"]]
    assert not frame["trace_text"].str.contains("boxed").any()
    assert list(frame["trace_tokens"]) == [len(tok.encode(t)) for t in frame["trace_text"]]
    assert list(frame["posterior_correct"]) == [reward(a, h) > 0 for a, h in zip(frame["answer_text"], frame["hint"])]
    q_phi = _model(sweep / "posterior", sweep / "posterior" / MODEL_FILE)
    template = c["hint"]["template"]
    for row in frame.iloc[::7].itertuples():
        response = f"{row.trace_text} \\boxed{{{row.hint}}}".strip()
        ref = _reference_logprob(q_phi, tok, template.format(prompt=row.prompt, hint=row.hint), response, 0,
                                 row.trace_tokens)
        assert row.log_posterior == pytest.approx(ref, abs=1e-4)


def _softmax_by_question(frame: pd.DataFrame, log_w: list[float]) -> list[float]:
    """A separately written per-question softmax (plain python); a question with no finite weight gets zeros."""
    out = [0.0] * len(frame)
    for idx in frame.groupby("question").indices.values():
        finite = [log_w[i] for i in idx if log_w[i] > -math.inf]
        if not finite:
            continue
        top = max(finite)
        total = sum(math.exp(log_w[i] - top) for i in idx if log_w[i] > -math.inf)
        for i in idx:
            out[i] = math.exp(log_w[i] - top) / total if log_w[i] > -math.inf else 0.0
    return out


def test_weights_file_columns_logprobs_and_normalisation(sweep: Path) -> None:
    frame = pd.read_parquet(sweep / "weights" / WEIGHTS_FILE)
    traces = pd.read_parquet(sweep / "traces" / TRACES_FILE)
    assert tuple(frame.columns) == weights_columns()
    assert list(frame["log_posterior"]) == list(traces["log_posterior"])
    assert (frame["answer_tokens"] == 4).all()  # \boxed{ n } <eos>
    assert set(frame["acc"] * 3) <= {0.0, 1.0, 2.0, 3.0}  # M = 3 answers per trace
    ratio = [(p - q) / z if z else 0.0 for p, q, z in zip(frame["log_prior"], frame["log_posterior"],
                                                          frame["trace_tokens"])]
    assert list(frame["log_ratio"]) == pytest.approx(ratio, abs=1e-9)
    estimates = {
        "acc": [math.log(a) if a > 0 else -math.inf for a in frame["acc"]],
        "gml": [lp / n for lp, n in zip(frame["answer_logp"], frame["answer_tokens"])],
        "likelihood": list(frame["answer_logp"]),
    }
    for name, log_p in estimates.items():
        expected = _softmax_by_question(frame, [r + e for r, e in zip(ratio, log_p)])
        assert list(frame[f"weight_{name}"]) == pytest.approx(expected, abs=1e-9), name
        sums = frame.groupby("question")[f"weight_{name}"].sum()
        assert all(s == pytest.approx(1.0) or s == 0.0 for s in sums), name
    c = _config(sweep / "weights")
    tok = ArithmeticTokenizer(TaskConfig.from_mapping(c["task"]).max_number)
    prior = _model(sweep / "prior", sweep / "prior" / MODEL_FILE)
    for (row, trace) in list(zip(frame.itertuples(), traces.itertuples()))[::9]:
        response = f"{trace.trace_text} \\boxed{{{trace.hint}}}".strip()
        z = row.trace_tokens
        assert row.log_prior == pytest.approx(_reference_logprob(prior, tok, trace.prompt, response, 0, z), abs=1e-4)
        assert row.answer_logp == pytest.approx(
            _reference_logprob(prior, tok, trace.prompt, response, z, z + 4), abs=1e-4)


def test_a_registered_estimator_gets_its_weight_column_in_the_weights_file(sweep: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    register_uniform(monkeypatch)
    for stage in ("prior", "traces"):
        (tmp_path / stage).symlink_to(sweep / stage)
    run_stage(write_stage(tmp_path, "weights", _config(sweep / "weights")))
    frame = pd.read_parquet(tmp_path / "weights" / WEIGHTS_FILE)
    assert tuple(frame.columns) == weights_columns() and tuple(frame.columns)[-1] == "weight_uniform"
    expected = _softmax_by_question(frame, list(frame["log_ratio"]))
    assert list(frame["weight_uniform"]) == pytest.approx(expected, abs=1e-9)
    before = pd.read_parquet(sweep / "weights" / WEIGHTS_FILE)
    pd.testing.assert_frame_equal(frame[list(before.columns)], before)


def test_final_recipes_train_on_the_same_steps_and_best_mixed_adds_the_original(sweep: Path) -> None:
    losses = {name: [r["data"][M.TRAIN_LOSS] for r in read_metrics(sweep / name / "metrics.jsonl")]
              for name in FINALS}
    assert len({len(v) for v in losses.values()}) == 1
    weights = pd.read_parquet(sweep / "weights" / WEIGHTS_FILE)
    useful = weights.groupby("question")["weight_acc"].max() > 0  # questions with a trace of nonzero weight
    # best_mixed = the original data + each useful question's best trace; all_weighted trains on weighted traces only
    assert (losses["vr_acc_best"] == losses["sft"]) == (not useful.any())
    assert all(v == 0.0 for v in losses["vr_acc"]) == (not useful.any())
    assert losses["sft"] != losses["rft"]
    rft = read_metrics(sweep / "rft" / "metrics.jsonl")[-1]["data"]
    assert 0.0 <= rft[M.VR_RFT_KEPT] <= 1.0
    best = read_metrics(sweep / "vr_acc_best" / "metrics.jsonl")
    assert all(r["data"][M.TRAIN_LOSS] > 0 for r in best)  # every step holds at least the original data


def test_a_completed_stage_started_again_changes_nothing(sweep: Path) -> None:
    path = sweep / "weights" / WEIGHTS_FILE
    before = (path.stat().st_mtime_ns, (sweep / "weights" / "metrics.jsonl").read_text())
    summary = run_stage(sweep / "weights")
    assert summary["completed_before"] is True
    assert (path.stat().st_mtime_ns, (sweep / "weights" / "metrics.jsonl").read_text()) == before


def test_sampling_stages_are_deterministic_in_the_seed(sweep: Path, tmp_path: Path) -> None:
    again = write_stage(tmp_path, "traces", _config(sweep / "traces"))
    (tmp_path / "posterior").symlink_to(sweep / "posterior")
    run_stage(again)
    pd.testing.assert_frame_equal(pd.read_parquet(again / TRACES_FILE), pd.read_parquet(sweep / "traces" / TRACES_FILE))


@pytest.mark.slow
def test_a_posterior_killed_after_a_checkpoint_resumes_with_each_step_once(sweep: Path, tmp_path: Path) -> None:
    """Real subprocess, SIGKILL once a checkpoint is written and a later step logged; the rerun resumes from the
    checkpoint, truncates metrics.jsonl to it, and ends with the uninterrupted run's loss at every step."""
    config = _config(sweep / "posterior")
    config["sft"] = {**config["sft"], "save_every": 3}
    d = write_stage(tmp_path, "posterior", config)
    proc = cli(d)
    deadline = time.time() + 240
    while time.time() < deadline:
        recs = read_metrics(d / "metrics.jsonl")
        if list((d / "checkpoints").glob("step_*.pt")) and recs and recs[-1]["step"] >= 4:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((d / "status.json").read_text())["status"] == "running"
    killed_at = read_metrics(d / "metrics.jsonl")[-1]["step"]
    assert killed_at < 12, "the run finished before it was killed"

    proc = cli(d)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resuming from" in (d / "train.log").read_text()
    recs = read_metrics(d / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 13))
    reference = [r["data"][M.TRAIN_LOSS] for r in read_metrics(sweep / "posterior" / "metrics.jsonl")]
    assert [r["data"][M.TRAIN_LOSS] for r in recs] == pytest.approx(reference, rel=1e-5)
