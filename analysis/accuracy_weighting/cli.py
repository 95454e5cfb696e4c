"""`python -m analysis accuracy_weighting`: measured vs predicted accuracy weights of RFT, REINFORCE, GRPO and VR.

Composes conf/accuracy_weighting.yaml (key=value overrides on top), measures the exact bandit and the real model's
batches (``analysis.accuracy_weighting.measure``), stores the rows in the DuckDB tables ``accuracy_weighting`` and
``accuracy_weighting_analyses`` (one upsert per analysis id = the config's stable id: a rerun changes nothing), and
prints accuracy bins with the mean measured and predicted weight per method. The model is the CPU stand-in.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from analysis.accuracy_weighting.theory import METHODS, check_eps
from predmask.config import cpu_models
from predmask.console import error, make_console

PRIMARY = "accuracy_weighting"
#: bump when a code change alters what the analysis computes (it is part of the analysis id)
ANALYSIS_VERSION = 1
#: keys that say where things live, not what is computed: excluded from the analysis id
PATH_KEYS: tuple[str, ...] = ("paths",)


class AnalysisInputError(ValueError):
    """Bad input; the message is one line naming the bad value and what is allowed."""


def build_parser() -> argparse.ArgumentParser:
    from predmask.command_text import python_command
    from predmask.rundir import add_db_option

    p = argparse.ArgumentParser(
        prog=f"{python_command()} -m analysis accuracy_weighting",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "The weight each objective's gradient puts on ∇ log p(x) as a function of the accuracy p (docs/math.md "
            "§9): exactly on a one-question softmax bandit (every G-tuple enumerated) and on real batches of the "
            "CPU stand-in model (the engine's cached base model π_θ0 unless checkpoint=...), against the closed forms."
        ),
        epilog=(
            "overrides (key=value, composed on conf/accuracy_weighting.yaml):\n"
            "  questions=Q samples=N group_size=G   the real-model measurement (N a multiple of G)\n"
            "  checkpoint=PATH                      a posterior stage's model.pt or run directory\n"
            f"  {'model=' + '|'.join(cpu_models()):<36} the CPU model whose cached base model is measured\n"
            "  bandit.group_sizes=[2,4] bandit.accuracies=[0.1,0.5]   the exact bandit's cases\n"
        ),
    )
    add_db_option(p)
    p.add_argument("--bandit-only", action="store_true", help="measure only the exact bandit (no model, seconds)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
    return p


def validate(cfg: Mapping[str, Any]) -> None:
    """One AnalysisInputError line for the first bad value of ``cfg``: the sizes and every bandit case are checked
    where the measurement defines them (``check_sampling``, ``BanditCase``)."""
    from analysis.accuracy_weighting.measure import BanditCase, check_sampling

    bandit = cfg["bandit"]
    try:
        check_sampling(cfg["questions"], cfg["samples"], cfg["group_size"])
        check_eps(cfg["eps"])
        for g, p in itertools.product(bandit["group_sizes"], bandit["accuracies"]):
            BanditCase(p=p, group_size=g, arms=bandit["arms"], correct=bandit["correct"], seed=bandit["seed"])
    except ValueError as err:
        raise AnalysisInputError(str(err)) from None
    if not isinstance(cfg["temperature"], (int, float)) or not cfg["temperature"] > 0:
        raise AnalysisInputError(f"temperature = {cfg['temperature']!r} is not allowed; allowed: a number > 0")
    bad = [m for m in cfg["methods"] if m not in METHODS]
    if bad or not cfg["methods"]:
        raise AnalysisInputError(f"methods = {cfg['methods']} is not allowed; allowed: a non-empty subset of {', '.join(METHODS)}")
    if cfg["model"].get("backend") != "cpu":
        raise AnalysisInputError(f"model = {cfg['model'].get('name')!r} is not allowed; allowed: a CPU model ({', '.join(cpu_models())})")
    if cfg.get("checkpoint") is not None:
        path = _checkpoint_file(cfg["checkpoint"])
        if not path.is_file():
            raise AnalysisInputError(
                f"checkpoint = {cfg['checkpoint']!r}: {path} does not exist; allowed: a posterior stage's model.pt or "
                "its run directory (python -m predmask.rl.vr_runner RUN_DIR writes it)")


def _checkpoint_file(value: str) -> Path:
    path = Path(value)
    return path / "model.pt" if path.is_dir() else path


def load_model(cfg: Mapping[str, Any]) -> tuple[Any, str]:
    """The model to measure and its label: the checkpoint's weights, else the engine's cached base model π_θ0."""
    import torch

    from predmask.rl.base import load_base_model
    from predmask.rl.model import build_policy
    from predmask.rl.tokenizer import ArithmeticTokenizer
    from predmask.schemas.task_schema import TaskConfig
    from predmask.schemas.train_schema import BaseConfig

    task = TaskConfig.from_mapping(cfg["task"])
    base = BaseConfig.from_mapping(cfg["base"])
    name = cfg["model"]["name"]
    if cfg.get("checkpoint") is None:
        model, _info = load_base_model(cfg["model"], task, base, cache_dir=cfg["paths"]["cache_dir"])
        return model, f"{name} (cached base model π_θ0, CPU stand-in)"
    path = _checkpoint_file(cfg["checkpoint"])
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = build_policy(cfg["model"], ArithmeticTokenizer(task.max_number).vocab_size, base.seed)
    model.load_state_dict(blob["state_dict"])  # a stage's model.pt: {"state_dict", "info"}
    return model, f"{name} ({path}, CPU stand-in)"


def print_summary(rows: Sequence[Mapping[str, Any]], console: Console) -> None:
    from analysis.accuracy_weighting.measure import summarise

    table = Table(title="accuracy weight on ∇ log p: mean measured vs predicted per accuracy bin")
    for col in ("source", "method", "accuracy", "rows", "measured", "predicted"):
        table.add_column(col, justify="left" if col in ("source", "method") else "right")
    for s in summarise(rows):
        fmt = lambda v: "—" if v is None else f"{v:.4f}"
        rows_text = str(s["rows"]) if s["measured_rows"] == s["rows"] else f"{s['measured_rows']}/{s['rows']}"
        table.add_row(s["source"], s["method"], s["bin"], rows_text, fmt(s["measured"]), fmt(s["predicted"]))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    from predmask.config import ConfigError, compose, to_container

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    console = make_console()
    try:
        cfg = to_container(compose(PRIMARY, list(args.overrides)))
        validate(cfg)
    except (ConfigError, AnalysisInputError) as err:
        error(str(err))
        return 2
    return _run(cfg, args, console)


def _run(cfg: dict[str, Any], args: argparse.Namespace, console: Console) -> int:
    from analysis.accuracy_weighting.measure import bandit_rows, model_rows
    from analysis.store import StoreError, check_db_path, connect, upsert_accuracy_weighting
    from predmask.command_text import command, with_db
    from predmask.config import stable_id
    from predmask.progress import progress
    from predmask.rl.base import single_thread
    from predmask.rundir import db_or_default
    from predmask.schemas.task_schema import TaskConfig

    db = db_or_default(args.db)
    try:
        check_db_path(db)
    except StoreError as err:
        error(str(err))
        return 2
    run_cfg = {**cfg, "bandit_only": bool(args.bandit_only)}
    analysis_id = stable_id({**run_cfg, "version": ANALYSIS_VERSION}, exclude=PATH_KEYS)  # what it computes
    bandit = cfg["bandit"]
    cases = len(bandit["group_sizes"]) * len(bandit["accuracies"])
    questions = 0 if args.bandit_only else cfg["questions"]
    console.print(f"accuracy-weighting analysis {analysis_id}: {cases} bandit case(s), {questions} question(s) × "
                  f"{cfg['samples']} samples of {cfg['model'].get('label', cfg['model']['name'])}", markup=False)
    with single_thread(), progress(f"accuracy weighting {analysis_id}", cases + questions, unit="cases",
                                   stream=sys.stdout) as bar:
        rows = bandit_rows(bandit["accuracies"], bandit["group_sizes"], arms=bandit["arms"],
                           correct=bandit["correct"], seed=bandit["seed"], eps=cfg["eps"],
                           methods=cfg["methods"], on_case=lambda what: bar.advance(status=f"bandit {what}"))
        no_correct = 0
        if questions:
            model, label = load_model(cfg)
            task = TaskConfig.from_mapping(cfg["task"])
            measured = model_rows(model, task, questions=questions, samples=cfg["samples"],
                                  group_size=cfg["group_size"], temperature=cfg["temperature"], seed=cfg["seed"],
                                  eps=cfg["eps"], label=label, methods=cfg["methods"],
                                  on_question=lambda q: bar.advance(status=f"question {q}"))
            rows += measured.rows
            no_correct = measured.no_correct
    try:
        with connect(db) as con:
            written = upsert_accuracy_weighting(con, analysis_id, run_cfg, rows)
    except StoreError as err:
        error(str(err))
        return 1
    print_summary(rows, console)
    if questions:
        console.print(f"{no_correct} of {questions} question(s) had no correct sample among {cfg['samples']}: their "
                      "measured weights are stored as NULL (no estimate of ∇ log p)", markup=False)
        console.print(f"model: {label}; questions: {task.label or 'arithmetic task'} "
                      "(a CPU stand-in, not the paper's models or data)", markup=False)
    console.print(f"stored {written.rows} row(s) of analysis {analysis_id} in {db} "
                  f"({'changed' if written.changed else 'unchanged'}; analysis row {written.analysis})", markup=False)
    console.print(f"next: {with_db(command('reports variational'), args.db)}", markup=False)
    return 0
