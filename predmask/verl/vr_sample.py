"""``python -m predmask.verl.vr_sample``: the variational family's vLLM stages (traces, weights, rft samples, eval) on a cluster.

The job-side program of :func:`predmask.verl.vr_cluster.stage_command` for the vLLM stages, on the head node of
the stage's job (docs/cluster.md, "Sampling"); it imports vLLM only in its ``--replicas`` engine subprocesses.
Correctness is :func:`predmask.verl.vr_cluster.answers_match`; every weight formula is :mod:`predmask.vr_weights`'s.
``eval`` writes one ``metrics.jsonl`` line at step 0 under the names the CPU engine's evaluation logs
(:func:`eval_metrics`).

A missing input (questions file, model export, traces file) -> exit 2 with one line naming the stage, the path
and how to produce it; nothing written. Outputs are written atomically under the run directory's lock.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from predmask.command_text import command
from predmask.evaluation import split_metrics
from predmask.io import atomic_write_text
from predmask.rundir import RunDirBusyError, hold_run_lock, metrics_line
from predmask.verl.vr_cluster import (
    STAGE_OUTPUTS,
    MissingInput,
    answers_match,
    chat_messages,
    cut_trace,
    read_parquet,
    write_parquet,
)
from predmask.vr_weights import (
    ESTIMATORS,
    check_counts,
    log_correct_estimate,
    normalise_weights,
    trace_log_ratio,
    trace_log_weights,
    weight_column,
    weights_columns,
)

TRACE_COLUMNS: tuple[str, ...] = ("question", "trace", "prompt", "hint", "trace_text", "answer_text",
                                  "posterior_correct", "trace_tokens", "log_posterior")
RFT_COLUMNS: tuple[str, ...] = ("question", "trace", "response", "correct")
#: mode -> its stage (names the one-line errors; its output: ``predmask.verl.vr_cluster.STAGE_OUTPUTS``)
STAGE_OF = {"traces": "traces", "weights": "weights", "rft": "rft_samples", "eval": "eval"}
_STEP = re.compile(r"^global_step_(\d+)$")


# -- pure helpers (no vLLM) -----------------------------------------------------------------------------------------

def resolve_model(path: Path, stage: str, upstream: str) -> Path:
    """The HF model directory of an SFT stage's output: ``path`` itself when it has ``config.json``, else the
    ``huggingface`` export of verl's latest checkpoint under it (``latest_checkpointed_iteration.txt``, else the
    highest ``global_step_<n>``)."""
    if (path / "config.json").is_file():
        return path
    steps = sorted((int(m.group(1)), p) for p in (path.iterdir() if path.is_dir() else ())
                   if (m := _STEP.match(p.name)))
    latest = path / "latest_checkpointed_iteration.txt"
    if latest.is_file() and latest.read_text().strip().isdigit():
        steps = [(n, p) for n, p in steps if n == int(latest.read_text().strip())] or steps
    for _, step_dir in reversed(steps):
        for candidate in sorted(step_dir.rglob("huggingface")):
            if (candidate / "config.json").is_file():
                return candidate
    raise MissingInput(f"stage {stage}: missing the {upstream} model under {path} (no config.json, no "
                       f"global_step_<n>/huggingface export); run the {upstream} stage first")


def summed_prompt_logprob(prompt_logprobs: Sequence[Mapping[int, Any] | None], token_ids: Sequence[int],
                          start: int, end: int) -> float:
    """Σ log p(token_i | tokens_<i) for i in [start, end) from vLLM's ``prompt_logprobs`` (entry i: a dict keyed by
    token id whose value has ``.logprob``; the prompt's own token is always in it)."""
    total = 0.0
    for i in range(start, end):
        entry = prompt_logprobs[i]
        if entry is None or token_ids[i] not in entry:
            raise ValueError(f"vLLM returned no prompt log-prob for position {i} (token {token_ids[i]})")
        value = entry[token_ids[i]]
        total += float(getattr(value, "logprob", value))
    return total


def weight_rows(raw: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``weights.parquet`` rows from the scored traces (``correct``: the M answers' correctness per trace),
    every formula from :mod:`predmask.vr_weights`."""
    t = {k: torch.tensor([r[k] for r in raw], dtype=torch.float64)
         for k in ("log_prior", "log_posterior", "answer_logp")}
    trace_tokens = torch.tensor([int(r["trace_tokens"]) for r in raw], dtype=torch.long)
    answer_tokens = torch.tensor([int(r["answer_tokens"]) for r in raw], dtype=torch.long)
    correct = torch.tensor([[bool(c) for c in r["correct"]] for r in raw], dtype=torch.bool)
    group = torch.tensor([int(r["question"]) for r in raw], dtype=torch.long)
    log_ratio = trace_log_ratio(t["log_prior"], t["log_posterior"], trace_tokens)
    weights = {}
    for name in ESTIMATORS:
        log_correct = log_correct_estimate(name, answer_logp=t["answer_logp"], answer_tokens=answer_tokens,
                                           correct=correct)
        weights[name] = normalise_weights(trace_log_weights(log_ratio, log_correct), group)
    acc = correct.to(torch.float64).mean(dim=1)
    out = []
    for i, r in enumerate(raw):
        out.append({
            "question": int(r["question"]), "trace": int(r["trace"]), "trace_tokens": int(trace_tokens[i]),
            "answer_tokens": int(answer_tokens[i]), "log_prior": float(t["log_prior"][i]),
            "log_posterior": float(t["log_posterior"][i]), "log_ratio": float(log_ratio[i]),
            "answer_logp": float(t["answer_logp"][i]), "acc": float(acc[i]),
            "posterior_correct": bool(r["posterior_correct"]),
            **{weight_column(name): float(w[i]) for name, w in weights.items()},
        })
    return out


def eval_metrics(split: str, correct: Sequence[Sequence[bool]], lengths: Sequence[Sequence[int]]) -> dict[str, float]:
    """One split's evaluation from ``correct`` [problems, n] and the responses' token ``lengths`` [problems, n]:
    :func:`predmask.evaluation.split_metrics`, the CPU engine's evaluation."""
    hits = torch.tensor([[bool(c) for c in row] for row in correct], dtype=torch.bool)
    if hits.ndim != 2 or hits.numel() == 0:
        raise ValueError(f"split {split}: no evaluated problems")
    return split_metrics(split, hits, torch.tensor(lengths, dtype=torch.float64))


def eval_problems(rows: Sequence[Mapping[str, Any]], path: Path) -> list[dict[str, Any]]:
    """The problems of one evaluation file (the RL family's verl RLHF rows): split, index, problem, reference."""
    out = []
    for i, row in enumerate(rows):
        problem = (row.get("extra_info") or {}).get("raw_problem")
        reference = (row.get("reward_model") or {}).get("ground_truth")
        if not problem or reference in (None, "") or not row.get("data_source"):
            raise ValueError(f"{path} row {i}: needs data_source, extra_info.raw_problem and "
                             "reward_model.ground_truth (python -m sweeps.datasets prepare writes them)")
        out.append({"split": str(row["data_source"]), "question": i, "problem": str(problem),
                    "reference": str(reference)})
    return out


def system_prompt(questions: Sequence[Mapping[str, Any]]) -> str:
    """The training data's system prompt (the most common one of the questions file) for the evaluation prompts."""
    counts = Counter(str(q.get("system") or "") for q in questions)
    return max(counts, key=lambda k: counts[k]) if counts else ""


def engine_args(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """vllm.LLM's keyword arguments: the model, its GPUs' share, and the bound on a step's tokens
    (``max_num_batched_tokens``, chunked prefill on): the prompt log-probs of a step materialise [tokens, vocab]
    logits outside vLLM's memory budget (``predmask.verl.vr_cluster.prompt_logprob_tokens``)."""
    return {"model": str(model), "tensor_parallel_size": args.tensor_parallel, "seed": args.seed + args.shard,
            "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "enable_chunked_prefill": True}


# -- the vLLM side ----------------------------------------------------------------------------------------------------

class _Engine:
    """One vLLM engine (imported here, on the job's node) plus its tokenizer."""

    def __init__(self, model: Path, args: argparse.Namespace) -> None:
        import vllm

        self.vllm = vllm
        self.llm = vllm.LLM(**engine_args(model, args))
        self.tok = self.llm.get_tokenizer()

    def prompt_text(self, system: str, user: str) -> str:
        messages = chat_messages(system, user)
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, system: str, user: str) -> list[int]:
        return self.ids(self.prompt_text(system, user))

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def sample(self, prompts: Sequence[list[int]], n: int, args: argparse.Namespace) -> list[list[str]]:
        return [[text for text, _ in row] for row in self.sample_lengths(prompts, n, args)]

    def sample_lengths(self, prompts: Sequence[list[int]], n: int,
                       args: argparse.Namespace) -> list[list[tuple[str, int]]]:
        """n completions per prompt: (text, generated tokens)."""
        params = self.vllm.SamplingParams(n=n, temperature=args.temperature, top_p=args.top_p,
                                          max_tokens=args.max_tokens, seed=args.seed + args.shard)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[(c.text, len(c.token_ids)) for c in o.outputs] for o in outs]

    def score(self, sequences: Sequence[list[int]]) -> list[Sequence[Mapping[int, Any] | None]]:
        params = self.vllm.SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        return [o.prompt_logprobs for o in outs]


def _traces_shard(engine: _Engine, args: argparse.Namespace,
                  questions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    hint_ids = [engine.prompt_ids(q["system"], q["hint_prompt"]) for q in questions]
    samples = engine.sample(hint_ids, args.k, args)
    rows, sequences = [], []
    for q, prompt, texts in zip(questions, hint_ids, samples, strict=True):
        x = engine.prompt_text(q["system"], q["prompt"])
        for k, text in enumerate(texts):
            cut = cut_trace(text)
            z, answer = cut if cut is not None else (text, "")
            z_ids = engine.ids(z)
            sequences.append(prompt + z_ids)
            rows.append({"question": int(q["question"]), "trace": k, "prompt": x, "hint": q["hint"], "trace_text": z,
                         "answer_text": answer, "trace_tokens": len(z_ids), "_start": len(prompt),
                         "posterior_correct": bool(q["checkable"]) and answers_match(answer, q["reference_answer"])})
    for row, seq, lp in zip(rows, sequences, engine.score(sequences), strict=True):
        row["log_posterior"] = summed_prompt_logprob(lp, seq, row.pop("_start"), len(seq))
    return rows


def _weights_shard(engine: _Engine, args: argparse.Namespace, questions: list[dict[str, Any]],
                   traces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_q = {int(q["question"]): q for q in questions}
    eos = engine.tok.eos_token_id
    rows, sequences, contexts = [], [], []
    for t in traces:
        q = by_q[int(t["question"])]
        x_ids = engine.prompt_ids(q["system"], q["prompt"])
        z_ids = engine.ids(t["trace_text"])
        y_ids = engine.ids(q["answer_text"]) + ([eos] if eos is not None else [])
        sequences.append(x_ids + z_ids + y_ids)
        contexts.append(x_ids + z_ids)
        rows.append({"question": int(t["question"]), "trace": int(t["trace"]), "trace_tokens": len(z_ids),
                     "answer_tokens": len(y_ids), "log_posterior": float(t["log_posterior"]),
                     "posterior_correct": bool(t["posterior_correct"]), "_bounds": (len(x_ids), len(x_ids) + len(z_ids)),
                     "_q": q})
    for row, seq, lp in zip(rows, sequences, engine.score(sequences), strict=True):
        a, b = row.pop("_bounds")
        row["log_prior"] = summed_prompt_logprob(lp, seq, a, b)
        row["answer_logp"] = summed_prompt_logprob(lp, seq, b, len(seq))
    for row, answers in zip(rows, engine.sample(contexts, args.m, args), strict=True):
        q = row.pop("_q")
        row["correct"] = [bool(q["checkable"]) and answers_match(a, q["reference_answer"]) for a in answers]
    return rows


def _rft_shard(engine: _Engine, args: argparse.Namespace,
               questions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    prompts = [engine.prompt_ids(q["system"], q["prompt"]) for q in questions]
    rows = []
    for q, texts in zip(questions, engine.sample(prompts, args.samples, args), strict=True):
        rows += [{"question": int(q["question"]), "trace": j, "response": text,
                  "correct": bool(q["checkable"]) and answers_match(text, q["reference_answer"])}
                 for j, text in enumerate(texts)]
    return rows


def _eval_shard(engine: _Engine, args: argparse.Namespace, problems: list[dict[str, Any]],
                system: str) -> list[dict[str, Any]]:
    prompts = [engine.prompt_ids(system, p["problem"]) for p in problems]
    rows = []
    for p, made in zip(problems, engine.sample_lengths(prompts, args.n, args), strict=True):
        rows.append({"split": p["split"], "question": p["question"], "trace": 0,
                     "correct": [answers_match(text, p["reference"]) for text, _ in made],
                     "lengths": [length for _, length in made]})
    return rows


def eval_lines(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The metrics of every split from the merged per-problem rows (split, correct [n], lengths [n])."""
    out: dict[str, float] = {}
    for split in dict.fromkeys(str(r["split"]) for r in rows):
        mine = [r for r in rows if r["split"] == split]
        out.update(eval_metrics(split, [r["correct"] for r in mine], [r["lengths"] for r in mine]))
    return out


# -- the driver ---------------------------------------------------------------------------------------------------------

def _shard(rows: list[dict[str, Any]], index: int, count: int) -> list[dict[str, Any]]:
    return [r for r in rows if int(r["question"]) % count == index]


def _run_replicas(args: argparse.Namespace, argv: Sequence[str], parts: Path) -> list[dict[str, Any]]:
    """One subprocess per replica (its GPUs in CUDA_VISIBLE_DEVICES), each writing its part; the parts merged."""
    shutil.rmtree(parts, ignore_errors=True)  # a previous attempt's parts
    procs = []
    for i in range(args.replicas):
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # vLLM's own workers, not the job's Ray
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * args.tensor_parallel + g) for g in range(args.tensor_parallel))
        part = parts / f"{args.mode}.{i}.json"
        cmd = [sys.executable, "-m", "predmask.verl.vr_sample", *argv, "--shard", str(i), "--part-out", str(part)]
        procs.append((i, part, subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)))
    rows, failed = [], []
    for i, part, proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            last = (err or "").strip().splitlines()[-1:]
            failed.append(f"replica {i} exited {proc.returncode}: {last[0] if last else 'no output'}")
        else:
            rows.extend(json.loads(part.read_text()))
    shutil.rmtree(parts, ignore_errors=True)
    if failed:
        raise RuntimeError("; ".join(failed))
    return sorted(rows, key=lambda r: (str(r.get("split", "")), int(r["question"]), int(r["trace"])))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m predmask.verl.vr_sample", description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=tuple(STAGE_OF))
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--questions", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the most tokens of one vLLM step (bounds the prompt log-probs' memory; required)")
    p.add_argument("--posterior", help="traces: the posterior stage's checkpoints (or an HF model directory)")
    p.add_argument("--prior", help="weights: the prior stage's checkpoints (or an HF model directory)")
    p.add_argument("--traces", type=Path, help="weights: the traces stage's traces.parquet")
    p.add_argument("--model", help="eval: the evaluated stage's checkpoints (or an HF model directory)")
    p.add_argument("--eval-file", type=Path, action="append", default=[], help="eval: a problems file (repeat)")
    p.add_argument("--samples", type=int, default=8, help="rft: responses per question")
    p.add_argument("--n", type=int, default=16, help="eval: samples per problem")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--m", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    return p


def _check(args: argparse.Namespace) -> None:
    check_counts(args.k, args.m)
    if args.max_num_batched_tokens is None:
        raise ValueError("--max-num-batched-tokens is required (the bound on the prompt log-probs' memory: "
                         "predmask.verl.vr_cluster.prompt_logprob_tokens)")
    for name in ("tensor_parallel", "replicas", "max_tokens", "max_num_batched_tokens", "samples", "n"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} = {getattr(args, name)} is not allowed; allowed: >= 1")
    if args.mode == "traces" and not args.posterior:
        raise ValueError("traces needs --posterior (the posterior stage's checkpoints)")
    if args.mode == "weights" and not (args.prior and args.traces):
        raise ValueError("weights needs --prior (the prior stage's checkpoints) and --traces (traces.parquet)")
    if args.mode == "rft" and not args.prior:
        raise ValueError("rft needs --prior (the prior stage's checkpoints)")
    if args.mode == "eval" and not (args.model and args.eval_file):
        raise ValueError("eval needs --model (the evaluated stage's checkpoints) and at least one --eval-file")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        _check(args)
        how = "prepare it: " + command("sweeps.datasets prepare --family variational --bespoke-file F --out DIR")
        stage = STAGE_OF[args.mode]
        questions = read_parquet(args.questions, stage, how)
        traces = (read_parquet(args.traces, "weights", "run the traces stage first")
                  if args.mode == "weights" else [])
        problems = [p for f in args.eval_file for p in eval_problems(
            read_parquet(f, stage, "prepare it: " + command("sweeps.datasets prepare --out DIR")), f)]
        model, upstream = {"traces": (args.posterior, "posterior"), "eval": (args.model, "evaluated")}.get(
            args.mode, (args.prior, "prior"))
        model = resolve_model(Path(model), stage, upstream)
    except (ValueError, MissingInput) as exc:
        print(f"predmask.verl.vr_sample: {exc}", file=sys.stderr)
        return 2
    if args.part_out is not None:  # one replica: its share of the questions, raw rows as JSON
        engine = _Engine(model, args)
        mine = _shard(questions, args.shard, args.replicas)
        if args.mode == "traces":
            rows = _traces_shard(engine, args, mine)
        elif args.mode == "weights":
            rows = _weights_shard(engine, args, questions, _shard(traces, args.shard, args.replicas))
        elif args.mode == "rft":
            rows = _rft_shard(engine, args, mine)
        else:
            problems = _shard(problems, args.shard, args.replicas)
            rows = _eval_shard(engine, args, problems, system_prompt(questions))
        args.part_out.parent.mkdir(parents=True, exist_ok=True)
        args.part_out.write_text(json.dumps(rows))
        return 0
    try:
        with hold_run_lock(args.run_dir):
            rows = _run_replicas(args, argv, args.run_dir / ".vr_sample_parts")
            out = args.run_dir / STAGE_OUTPUTS[STAGE_OF[args.mode]]
            if args.mode == "eval":  # one metrics line at step 0 (a rerun replaces it)
                atomic_write_text(out, metrics_line(0, eval_lines(rows)))
            else:
                columns = {"traces": TRACE_COLUMNS, "weights": weights_columns(), "rft": RFT_COLUMNS}[args.mode]
                write_parquet(weight_rows(rows) if args.mode == "weights" else rows, out, columns)
    except RunDirBusyError as exc:
        print(f"predmask.verl.vr_sample: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"predmask.verl.vr_sample: stage {STAGE_OF[args.mode]}: {exc}", file=sys.stderr)
        return 1
    print(f"predmask.verl.vr_sample: wrote {out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
