"""``python -m predmask.verl.vr_sft``: verl 0.9.1's Ray SFT trainer with per-sample weights and a constant normaliser.

The job-side program of the variational family's SFT stages (prior, posterior, final) on a cluster; its argv
is :func:`predmask.verl.vr_cluster.stage_command`'s. It takes the ``predmask.*`` keys off the argv, then runs
verl's own Hydra app ``verl.trainer.sft_trainer_ray.main`` with the rest, after two changes that verl's SFT
trainer does not offer (docs/cluster.md): the loss becomes :func:`nested_weighted_sft_loss` (it replaces
``verl.workers.utils.losses.sft_loss``, which the trainer looks up when it builds its engine; the Ray workers
unpickle it from this module), and ``data.custom_cls`` names :class:`WeightedSFTDataset`.

For an ``rft`` or ``vr_*`` final (``predmask.recipe``) it first builds ``predmask.train_file``
(:func:`build_final_data`); a missing input -> exit 2, one line, nothing written. The data parts import no
verl; the loss and the dataset import it when called.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from predmask.verl.settings import PREFIX
from predmask.verl.vr_cluster import chat_messages, read_parquet, write_parquet
from predmask.vr_weights import best_trace, weight_column, weighted_sft_loss

#: the predmask keys this launcher reads (written by predmask.verl.vr_cluster)
KEYS: tuple[str, ...] = ("stage", "run_dir", "normaliser", "recipe", "estimator", "data", "weights_file",
                         "traces_file", "questions_file", "original_file", "train_file", "samples_file")
WEIGHT_COLUMN = "weight"
_DATASET = "WeightedSFTDataset"


def split_predmask_args(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """(verl's argv, predmask's keys): ``predmask.<key>=<value>`` entries off the argv, values parsed as Hydra does."""
    from omegaconf import OmegaConf

    verl_argv, ours = [], []
    for arg in argv:
        (ours if arg.startswith(PREFIX) else verl_argv).append(arg)
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist([a[len(PREFIX):] for a in ours])) if ours else {}
    unknown = sorted(set(parsed) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown key predmask.{unknown[0]}; allowed: {', '.join(PREFIX + k for k in KEYS)}")
    return verl_argv, dict(parsed)


def nested_weighted_sft_loss(config: Any, model_output: Mapping[str, Any], data: Any, dp_group: Any = None, *,
                             normaliser: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``sft_loss`` signature (no-padding mode): the weighted constant-normaliser loss of one micro-batch.

    ``model_output["log_probs"]`` and ``data["loss_mask"]`` / ``data["loss_weight"]`` are jagged [bsz, j]; the mask
    and weights are shifted left by one token to align with the log-probs, exactly as verl's ``sft_loss`` does."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    pad_mode = tu.get_non_tensor_data(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise ValueError(f"data.pad_mode={pad_mode!r} is not supported by the weighted SFT loss; allowed: no_padding")
    log_prob = model_output["log_probs"].values()
    mask = torch.roll(data["loss_mask"].values(), shifts=-1, dims=0).bool()
    weight = torch.roll(data["loss_weight"].values(), shifts=-1, dims=0)
    loss = weighted_sft_loss(log_prob[:, None], mask[:, None], weight.to(log_prob.dtype), normaliser)
    return loss * data["dp_size"], {}  # as verl's sft_loss: FSDP averages gradients over data-parallel ranks


def _sft_row(q: Mapping[str, Any], response: str, weight: float, trace: int) -> dict[str, Any]:
    """One SFT row: question ``q``'s reasoning prompt -> ``response``, with its weight."""
    return {"messages": chat_messages(str(q["system"]), str(q["prompt"]), response), WEIGHT_COLUMN: float(weight),
            "question": int(q["question"]), "trace": trace}


def final_rows(questions: Sequence[Mapping[str, Any]], traces: Sequence[Mapping[str, Any]],
               weights: Sequence[Mapping[str, Any]], *, estimator: str, data: str) -> list[dict[str, Any]]:
    """The final model's SFT rows: ``messages`` (reasoning prompt -> trace z then the reference answer y′) + ``weight``.

    ``all_weighted``: every trace with its normalised weight ``weight_<estimator>`` (weight-0 traces dropped: no
    gradient); ``best_mixed``: the highest-weight trace of each question (weight 1; none for a question whose
    weights are all zero) plus every original sample (weight 1)."""
    column = weight_column(estimator)
    by_q = {int(q["question"]): q for q in questions}
    text = {(int(t["question"]), int(t["trace"])): str(t["trace_text"]) for t in traces}
    rows: list[dict[str, Any]] = []

    def sample(qid: int, trace: int, w: float) -> dict[str, Any]:
        z = text.get((qid, trace))
        if z is None:
            raise ValueError(f"weights row question={qid} trace={trace} has no trace in the traces file")
        return _sft_row(by_q[qid], z + str(by_q[qid]["answer_text"]), w, trace)

    if data == "all_weighted":
        for w in weights:
            if float(w[column]) > 0:
                rows.append(sample(int(w["question"]), int(w["trace"]), float(w[column])))
        return rows
    if data != "best_mixed":
        raise ValueError(f"unknown method.data={data!r}; allowed: all_weighted, best_mixed")
    values = torch.tensor([float(w[column]) for w in weights], dtype=torch.float64)
    group = torch.tensor([int(w["question"]) for w in weights], dtype=torch.long)
    for index in best_trace(values, group).tolist():
        if values[index] > 0:
            rows.append(sample(int(weights[index]["question"]), int(weights[index]["trace"]), 1.0))
    rows += [_sft_row(by_q[qid], str(by_q[qid]["response"]), 1.0, -1) for qid in sorted(by_q)]
    return rows


def rft_rows(questions: Sequence[Mapping[str, Any]], samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rft final's SFT rows: every correct sample of pi_theta0 (reasoning prompt -> its response), each weighted
    1 / (samples of its question), as the CPU engine weights them (``predmask.rl.vr_runner``)."""
    by_q = {int(q["question"]): q for q in questions}
    drawn = Counter(int(r["question"]) for r in samples)
    return [_sft_row(by_q[int(r["question"])], str(r["response"]), 1.0 / drawn[int(r["question"])], int(r["trace"]))
            for r in samples if bool(r["correct"])]


def build_final_data(keys: Mapping[str, Any]) -> Path:
    """Write ``predmask.train_file`` for an rft or vr_* final (atomically); FileNotFoundError names a missing input."""
    from predmask.command_text import command

    how = "prepare it: " + command("sweeps.datasets prepare --family variational --bespoke-file F --out DIR")
    if keys["recipe"] == "rft":
        samples = read_parquet(str(keys["samples_file"]), "final", "run the rft_samples stage first")
        rows = rft_rows(read_parquet(str(keys["questions_file"]), "final", how), samples)
        if not rows:
            raise ValueError("stage final: no sample of pi_theta0 is correct: nothing for rft to train on")
    else:
        weights = read_parquet(str(keys["weights_file"]), "final", "run the weights stage first")
        traces = read_parquet(str(keys["traces_file"]), "final", "run the traces stage first")
        questions = read_parquet(str(keys["questions_file"]), "final", how)
        rows = final_rows(questions, traces, weights, estimator=str(keys["estimator"]), data=str(keys["data"]))
        if not rows:
            raise ValueError(f"stage final: no trace has a positive {weight_column(str(keys['estimator']))}: nothing "
                             "to train on")
    out = Path(str(keys["train_file"]))
    write_parquet(rows, out)
    return out


def __getattr__(name: str) -> Any:
    """``WeightedSFTDataset`` is made on first use (it subclasses verl's dataset: verl is imported only then)."""
    if name != _DATASET:
        raise AttributeError(name)
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    class WeightedSFTDataset(MultiTurnSFTDataset):
        """verl's multi-turn SFT dataset plus ``loss_weight``: the row's ``weight`` (1 without the column) per token."""

        def __getitem__(self, item: int) -> dict[str, Any]:
            out = super().__getitem__(item)
            row = self.dataframe.iloc[item]
            weight = float(row[WEIGHT_COLUMN]) if WEIGHT_COLUMN in self.dataframe.columns else 1.0
            out["loss_weight"] = torch.full(out["loss_mask"].shape, weight, dtype=torch.float32)
            return out

    WeightedSFTDataset.__module__ = __name__
    globals()[_DATASET] = WeightedSFTDataset
    return WeightedSFTDataset


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        verl_argv, keys = split_predmask_args(argv)
        normaliser = float(keys.get("normaliser", 0))
        if not normaliser > 0:
            raise ValueError(f"predmask.normaliser={keys.get('normaliser')!r} is not allowed; allowed: a number > 0")
        if keys.get("recipe"):
            build_final_data(keys)
    except (ValueError, FileNotFoundError) as exc:
        print(f"predmask.verl.vr_sft: {exc}", file=sys.stderr)
        return 2
    from verl.trainer import sft_trainer_ray
    from verl.workers.utils import losses

    from predmask.rundir import METRICS_FILE, RunDirBusyError, hold_run_lock, keep_previous_attempt

    losses.sft_loss = partial(nested_weighted_sft_loss, normaliser=normaliser)
    sys.argv = [sft_trainer_ray.__file__, *verl_argv]
    if not keys.get("run_dir"):
        sft_trainer_ray.main()
        return 0
    run_dir = Path(str(keys["run_dir"]))
    logger_path = Path(os.environ.setdefault("VERL_FILE_LOGGER_PATH", str(run_dir / METRICS_FILE)))
    try:
        with hold_run_lock(run_dir):  # one attempt at a time writes the run directory
            keep_previous_attempt(logger_path)  # verl's file logger truncates its file: the last attempt's kept
            sft_trainer_ray.main()
    except RunDirBusyError as exc:
        print(f"predmask.verl.vr_sft: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
