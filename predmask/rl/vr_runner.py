"""`python -m predmask.rl.vr_runner RUN_DIR`: one stage of the variational-reasoning family on the CPU engine.

Stand-in scale throughout: the prompt x is an arithmetic problem of ``predmask.rl.task``, the trace z its worked
steps (the tokens before ``\\boxed{``), the answer y the ``\\boxed{<n>}`` and <eos>; pi_theta0 = the engine's cached
base model (``predmask.rl.base.load_base_model``), not a real reasoning model. The "original data" are the first
``data.questions`` problems of the task's train stream, each with one worked solution written with arithmetic slips
at rate ``data.noise`` (rng seeded by ``data.seed`` only). q_phi is the base model fine-tuned on hint prompts
(``hint.template``: the original solution's own final answer in a marked segment, then the question); traces are
sampled from q_phi with the hint = the correct answer.

RUN_DIR/config.yaml (written by the sweep) says the stage (``stage``) and, in ``inputs``, the run ids of the
upstream stages it reads (``predmask.vr_stages``; sibling run directories: ``RUN_DIR.parent / <run id>``):

- ``prior``     (no input)              ``model.pt`` = pi_theta0 + its evaluation (step 0)
- ``posterior`` (no input)              ``model.pt`` = q_phi: SFT of the base model on hint prompts
- ``traces``    (posterior)             ``traces.parquet``: K traces per question from q_phi (TRACES_COLUMNS)
- ``weights``   (prior, traces)         ``weights.parquet``: every trace's log-probs, answers and weights
                                        (``predmask.vr_weights.weights_columns``: one weight per estimator)
- ``final``     sft / rft: no input; vr_*: traces, weights. ``model.pt`` + its evaluation at the last step.

Every stage writes ``status.json`` and ``metrics.jsonl`` (verl file-logger lines) through ``predmask.rundir``,
``train.log`` and its output (atomically), holding ``.run.lock`` for its whole life. Supervised stages checkpoint
every ``sft.save_every`` steps to ``checkpoints/`` and resume after any death (metrics truncated to the checkpoint);
sampling stages are deterministic in ``seed`` and recompute on a rerun. A completed stage started again does
nothing. Bad config or a missing upstream output: one line, exit 2, nothing written in RUN_DIR.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn

from predmask import metrics as M
from predmask import vr_weights as V
from predmask.checkpoints import load_data
from predmask.io import atomic_write
from predmask.rl.base import load_base_model, sft_batch, single_thread, task_response_budget
from predmask.rl.engine import resolve_cpu_model, validation_metrics
from predmask.rl.model import build_policy
from predmask.rl.rollout import encode_prompts, generate, rollout_problems
from predmask.rl.task import EVAL_SPLITS, STANDIN_LABEL, Problem, extract_answer, make_split, reward
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.rl.train import failure_exit, record_failure, run_logging
from predmask.rl.vr_questions import (
    Question,
    answer_text,
    join_response,
    original_data,
    split_trace,
)
from predmask.rl.weighted_sft import Row, token_logprobs, train_sft
from predmask.rundir import (
    CONFIG_FILE,
    METRICS_FILE,
    MetricsWriter,
    cut_metrics,
    hold_run_lock,
    read_config,
    read_metrics,
    read_status,
    write_status,
)
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.train_schema import BaseConfig
from predmask.schemas.variational_schema import HintConfig, PosteriorConfig, VRConfig
from predmask.vr_stages import stage_inputs

MODEL_FILE = "model.pt"
TRACES_FILE = "traces.parquet"
WEIGHTS_FILE = "weights.parquet"
#: the output file of each stage
STAGE_OUTPUTS: dict[str, str] = {"prior": MODEL_FILE, "posterior": MODEL_FILE, "traces": TRACES_FILE,
                                 "weights": WEIGHTS_FILE, "final": MODEL_FILE}
#: how every output names pi_theta0
PRIOR_LABEL = "pi_theta0 = cached base model (predmask.rl.base; CPU stand-in, not a real reasoning model)"
TRACES_COLUMNS: tuple[str, ...] = ("question", "trace", "prompt", "hint", "trace_text", "answer_text",
                                   "posterior_correct", "trace_tokens", "log_posterior")
#: fixed sampling seed of every evaluation (paired across runs and seeds)
EVAL_SEED = 20_261_201
#: sequences per teacher-forced or sampled chunk
_CHUNK = 1024
#: a model's sampler (pi_theta0's or q_phi's): (prompts, salt of the draw) -> one response's token ids per prompt
Sampler = Callable[[Sequence[str], int], list[list[int]]]

log = logging.getLogger("predmask.rl.vr_runner")


# ----------------------------------------------------------------------------------------------- log-probs
@torch.no_grad()
def segment_logprobs(model: nn.Module, tokenizer: ArithmeticTokenizer, prompts: Sequence[str],
                     firsts: Sequence[str], seconds: Sequence[str]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Teacher-forced log-probs (temperature 1) of the response ``first second <eos>`` after each prompt:
    (Σ log p over the first segment [N], Σ over the second segment incl. <eos> [N], their token counts [N], [N])."""
    model.eval()
    out: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    for s in range(0, len(prompts), _CHUNK):
        p, f, t = prompts[s:s + _CHUNK], firsts[s:s + _CHUNK], seconds[s:s + _CHUNK]
        batch = sft_batch(tokenizer, p, [f"{a} {b}".strip() for a, b in zip(f, t)])
        token_logp = token_logprobs(model, batch)
        n_first = torch.tensor([len(tokenizer.encode(a)) for a in f], dtype=torch.long)
        total = batch.response_mask.sum(-1)
        pos = torch.arange(token_logp.shape[1]).unsqueeze(0)
        first_mask = pos < n_first.unsqueeze(1)
        second_mask = batch.response_mask & ~first_mask
        out.append((V.sequence_logprob(token_logp, first_mask), V.sequence_logprob(token_logp, second_mask),
                    n_first, total - n_first))
    model.train()
    return tuple(torch.cat([o[i] for o in out]) for i in range(4))  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------- the stage context
@dataclass
class Stage:
    """Everything one stage run needs, checked before anything is written."""

    run_dir: Path
    config: dict[str, Any]
    vr: VRConfig
    model_cfg: dict[str, Any]
    task: TaskConfig
    base: BaseConfig
    tokenizer: ArithmeticTokenizer
    cache_dir: str
    inputs: dict[str, Path]

    @property
    def output(self) -> Path:
        return self.run_dir / STAGE_OUTPUTS[self.vr.stage]

    @property
    def questions(self) -> list[Question]:
        d = self.vr.data
        return original_data(self.task, d.questions, d.noise, d.seed)

    @property
    def response_budget(self) -> int:
        return task_response_budget(self.task)


def prepare_stage(run_dir: str | Path) -> Stage:
    """Read and check RUN_DIR/config.yaml and the upstream outputs it needs (ValueError, one line; writes nothing)."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist; the sweep writes a stage's config.yaml before it runs "
                         f"(python -m sweeps variational_reasoning)")
    c = read_config(path)
    vr = VRConfig.from_mapping(c)
    if vr.stage in ("traces", "weights"):
        V.check_counts(vr.traces.k, vr.weights.m)
    if vr.method.estimator is not None:
        V.get_estimator(vr.method.estimator)
    model_cfg = resolve_cpu_model(c.get("model") or {})
    task = TaskConfig.from_mapping(c.get("task") or {})
    base = BaseConfig.from_mapping(c.get("base") or {})
    tokenizer = ArithmeticTokenizer(task.max_number)
    example = make_split(task, "train", 1)[0]
    try:
        tokenizer.encode(vr.hint.prompt(example.prompt, example.answer))
    except ValueError as err:
        raise ValueError(f"hint.template = {vr.hint.template!r} does not tokenise: {err}") from None
    inputs: dict[str, Path] = {}
    for stage in stage_inputs(vr.stage, vr.method.name):
        run_id = vr.inputs.get(stage)
        if not run_id:
            raise ValueError(f"stage {vr.stage} ({vr.method.name}) needs inputs.{stage} (the run id of its "
                             f"{stage} stage) in {run_dir / CONFIG_FILE}; the sweep sets it")
        path = run_dir.parent / run_id / STAGE_OUTPUTS[stage]
        if not path.is_file():
            raise ValueError(f"stage {vr.stage} needs the {stage} output {path}, which is missing; produce "
                             f"it with python -m predmask.rl.vr_runner {path.parent}")
        inputs[stage] = path
    return Stage(run_dir, c, vr, model_cfg, task, base, tokenizer, str(c.get("cache_dir") or "results/cache"),
                 inputs)


# ----------------------------------------------------------------------------------------------- models
def _base_model(st: Stage) -> tuple[nn.Module, dict[str, Any]]:
    """The cached base model (pi_theta0, and every fine-tuned stage's start); built on first use, with progress."""
    log.info("loading the base model from %s (pretrained on first use, about a minute)", st.cache_dir)
    model, info = load_base_model(st.model_cfg, st.task, st.base, cache_dir=st.cache_dir, progress=True)
    log.info("base model %s (%s)", info.get("cache_path"), "built now" if info.get("built") else "from cache")
    return model, info


def load_model(st: Stage, path: Path) -> tuple[nn.Module, dict[str, Any]]:
    """A stage's ``model.pt`` as a policy of the run's model config, and its info
    (``predmask.checkpoints.load_data``: data only)."""
    blob = load_data(path)
    model = build_policy(st.model_cfg, st.tokenizer.vocab_size, st.base.seed)
    model.load_state_dict(blob["state_dict"])
    return model, dict(blob.get("info") or {})


def _save_model(path: Path, model: nn.Module, info: Mapping[str, Any]) -> None:
    blob = {"state_dict": model.state_dict(), "info": dict(info)}
    atomic_write(path, lambda tmp: torch.save(blob, tmp))


@torch.no_grad()
def evaluate(st: Stage, model: nn.Module) -> dict[str, float]:
    """avg@n, pass@1..n and response length on both stand-in eval splits at eval.temperature (fixed seed)."""
    model.eval()
    out: dict[str, float] = {}
    for i, split in enumerate(EVAL_SPLITS):
        gen = torch.Generator().manual_seed(EVAL_SEED + i)
        batch = rollout_problems(model, st.tokenizer, make_split(st.task, split), n=st.vr.eval.n,
                                 max_new_tokens=st.response_budget, temperature=st.vr.eval.temperature,
                                 generator=gen)
        out.update(validation_metrics(split, batch, st.vr.eval.n))
    model.train()
    return out


# ----------------------------------------------------------------------------------------------- stages
def _train(st: Stage, model: nn.Module, rows: Sequence[Row], epochs: int, final_metrics: Any = None) -> dict[str, Any]:
    """``train_sft`` of ``model`` on ``rows`` over the stage's questions, in its run directory."""
    return train_sft(model, rows, run_dir=st.run_dir, sft=st.vr.sft, tokenizer=st.tokenizer, seed=st.vr.seed,
                     n_questions=st.vr.data.questions, epochs=epochs, title=f"{st.vr.stage} {st.vr.method.name} SFT",
                     log=log, final_metrics=final_metrics)


def _log_metrics(st: Stage, data: Mapping[str, Any], step: int = 0) -> None:
    """One metrics line for a stage without training steps (a rerun replaces it)."""
    cut_metrics(st.run_dir, None, log)
    with closing(MetricsWriter(st.run_dir / METRICS_FILE)) as writer:
        writer.log(data, step)


def _summary_line(data: Mapping[str, Any]) -> str:
    parts = [f"{k.split('/')[1]} avg@{k.rsplit('@', 1)[1]}={v:.3f}" for k, v in data.items() if M.VAL_ACC_RE.match(k)]
    return ", ".join(parts)


def run_prior(st: Stage) -> dict[str, Any]:
    """pi_theta0 = the cached base model: model.pt and its evaluation at step 0."""
    model, info = _base_model(st)
    data = evaluate(st, model)
    _log_metrics(st, data, 0)
    _save_model(st.output, model, {**info, "role": PRIOR_LABEL, "stage": "prior"})
    log.info("prior evaluation: %s", _summary_line(data))
    return {"step": 0, **data}


def posterior_rows(tokenizer: ArithmeticTokenizer, hint: HintConfig, posterior: PosteriorConfig,
                   questions: Sequence[Question], max_number: int, *, prior: Sampler) -> list[Row]:
    """q_phi's training rows (``posterior.source``): each original solution with its own final answer as the hint,
    and/or ``posterior.samples`` responses per question drawn by ``prior`` (pi_theta0 on the bare question), the
    worked ones (a step before the box, an answer in 0..max_number) with their own final answer as the hint, each
    weighted 1/samples: fitting these is the forward KL to pi_theta0's posterior given the answer."""
    rows = [Row(q.index, hint.prompt(q.problem.prompt, q.original_answer), q.solution, 1.0)
            for q in questions] if posterior.source != "prior" else []
    if posterior.source != "original":
        n = posterior.samples
        for i, ids in enumerate(prior([q.problem.prompt for q in questions for _ in range(n)], 7)):
            z, a = split_trace(tokenizer, ids)
            y = extract_answer(tokenizer.decode(a))
            if z and y is not None and 0 <= y <= max_number:
                q = questions[i // n]
                rows.append(Row(q.index, hint.prompt(q.problem.prompt, y), tokenizer.decode(ids), 1.0 / n))
        if not rows:
            raise ValueError(f"posterior.source = {posterior.source!r}: none of pi_theta0's {len(questions) * n} "
                             f"samples is a worked response (a step before the box, an answer in 0..{max_number}); "
                             f"allowed here: posterior.source=original or original+prior")
    return rows


def run_posterior(st: Stage) -> dict[str, Any]:
    """q_phi: SFT of the base model on hint prompts (hint = the response's own final answer)."""
    model, info = _base_model(st)
    rows = posterior_rows(st.tokenizer, st.vr.hint, st.vr.posterior, st.questions, st.task.max_number,
                          prior=lambda p, salt: _sample(st, model, p, 1.0, salt))
    log.info("q_phi: base model fine-tuned on %d hint prompts (%s), e.g. %r -> %r", len(rows),
             st.vr.posterior.source, rows[-1].prompt, rows[-1].response)
    summary = _train(st, model, rows, st.vr.posterior.epochs)
    _save_model(st.output, model, {"base": info.get("cache_path"), "stage": "posterior",
                                   "role": "q_phi: base model fine-tuned on hint prompts"})
    return summary


def _generator(st: Stage, salt: int) -> torch.Generator:
    """The sampling rng of one draw of a stage: from the run's seed and the draw's own ``salt``."""
    return torch.Generator().manual_seed(st.vr.seed * 1_000_003 + salt)


def _sample(st: Stage, model: nn.Module, prompts: Sequence[str], temperature: float, salt: int) -> list[list[int]]:
    """The response ids of one sample per prompt (chunks drawn in order from ``_generator(st, salt)``)."""
    tok, gen = st.tokenizer, _generator(st, salt)
    out: list[list[int]] = []
    for s in range(0, len(prompts), _CHUNK):
        ids, mask = encode_prompts(tok, prompts[s:s + _CHUNK])
        out += generate(model, ids, mask, max_new_tokens=st.response_budget, eos_id=tok.eos_id, pad_id=tok.pad_id,
                        temperature=temperature, generator=gen).response_ids.tolist()
    return out


def run_traces(st: Stage) -> dict[str, Any]:
    """K traces per question sampled from q_phi with the hint = the correct answer; q_phi's log-prob of each z; the
    hint check (``hint_use``) against pi_theta0 on the same questions."""
    model, _ = load_model(st, st.inputs["posterior"])
    model.eval()
    prior, _ = _base_model(st)
    prior.eval()
    qs, k, tok = st.questions, st.vr.traces.k, st.tokenizer
    prompts = [st.vr.hint.prompt(q.problem.prompt, q.problem.answer) for q in qs for _ in range(k)]
    rows: list[dict[str, Any]] = []
    texts: list[str] = []
    for i, resp in enumerate(_sample(st, model, prompts, st.vr.traces.temperature, salt=11)):
        q = qs[i // k]
        z, a = split_trace(tok, resp)
        texts.append(tok.decode(z))
        rows.append({"question": q.index, "trace": i % k, "prompt": q.problem.prompt, "hint": q.problem.answer,
                     "trace_text": texts[-1], "answer_text": tok.decode(a),
                     "posterior_correct": bool(reward(tok.decode(a), q.problem.answer) > 0), "trace_tokens": len(z)})
    log_z, _, n_z, _ = segment_logprobs(model, tok, prompts, texts, [answer_text(r["hint"]) for r in rows])
    if not torch.equal(n_z, torch.tensor([r["trace_tokens"] for r in rows])):
        raise RuntimeError("trace token counts changed in a decode/encode round trip")
    for r, lp in zip(rows, log_z.tolist()):
        r["log_posterior"] = float(lp)
    frame = pd.DataFrame(rows, columns=list(TRACES_COLUMNS))
    temperature = st.vr.traces.temperature
    data = {M.VR_POSTERIOR_CORRECT: float(frame["posterior_correct"].mean()),
            M.VR_TRACE_TOKENS_MEAN: float(frame["trace_tokens"].mean()),
            **hint_use(tok, st.vr.hint, [q.problem for q in qs], k, st.task.max_number,
                       posterior=lambda p, salt: _sample(st, model, p, temperature, salt),
                       prior=lambda p, salt: _sample(st, prior, p, temperature, salt))}
    _log_metrics(st, data, 0)
    atomic_write(st.output, lambda tmp: frame.to_parquet(tmp, index=False))
    log.info("traces: %d (K=%d per question); seed %d %s", len(frame), k, st.vr.seed, hint_use_line(data))
    return {"step": 0, "rows": len(frame), **data}


#: the decoy hint of the traces stage's hint check: the correct answer plus this (minus it where that leaves the range)
DECOY_OFFSET = 3


@torch.no_grad()
def hint_use(tokenizer: ArithmeticTokenizer, hint: HintConfig, problems: Sequence[Problem], k: int, max_number: int,
             *, posterior: Sampler, prior: Sampler) -> dict[str, float]:
    """Whether q_phi uses its hint: pi_theta0's share of correct answers over ``k`` samples per problem (the plain
    question), and over one sample per problem from q_phi given a decoy hint (the answer +- DECOY_OFFSET, minus where
    plus leaves [0, max_number]) the share whose own answer is the decoy and the share that is correct."""
    answers = [p.answer for p in problems]
    decoys = [a + (DECOY_OFFSET if a + DECOY_OFFSET <= max_number else -DECOY_OFFSET) for a in answers]

    def answered(responses: list[list[int]], truth: Sequence[int]) -> float:
        texts = [tokenizer.decode(split_trace(tokenizer, r)[1]) for r in responses]
        return sum(reward(t, a) > 0 for t, a in zip(texts, truth)) / len(texts)

    decoyed = posterior([hint.prompt(p.prompt, d) for p, d in zip(problems, decoys)], 13)
    return {M.VR_PRIOR_CORRECT: answered(prior([p.prompt for p in problems for _ in range(k)], 17),
                                         [a for a in answers for _ in range(k)]),
            M.VR_DECOY_HIT: answered(decoyed, decoys), M.VR_DECOY_CORRECT: answered(decoyed, answers)}


def hint_use_line(data: Mapping[str, float]) -> str:
    """The traces stage's one-line summary of the hint check (percentages; the ratio of q_phi's rate to pi_theta0's)."""
    post, prior = data[M.VR_POSTERIOR_CORRECT], data[M.VR_PRIOR_CORRECT]
    ratio = f"{post / prior:.2f}" if prior > 0 else "inf"
    return (f"hint use: q_φ reaches the hinted answer in {100 * post:.1f}% (π_θ0 {100 * prior:.1f}%, ratio {ratio}×); "
            f"follows a decoy hint in {100 * data[M.VR_DECOY_HIT]:.1f}%")


@torch.no_grad()
def _answer_correctness(st: Stage, model: nn.Module, prompts: Sequence[str], answers: Sequence[int],
                        m: int) -> Tensor:
    """[N, M]: whether each of M answers sampled from pi_theta0(. | x, z) is correct (prompts are ``x z``)."""
    flat_p = [p for p in prompts for _ in range(m)]
    flat_a = [a for a in answers for _ in range(m)]
    responses = _sample(st, model, flat_p, st.vr.weights.temperature, salt=29)
    hits = [reward(st.tokenizer.decode(r), a) for r, a in zip(responses, flat_a)]
    return torch.tensor(hits, dtype=torch.float64).view(-1, m) > 0.5


def trace_weights(frame: pd.DataFrame, correct: Tensor) -> dict[str, Tensor]:
    """weight_<estimator> for every registered estimator, normalised over the K traces of each question."""
    group = torch.tensor(frame["question"].to_numpy(), dtype=torch.long)
    log_ratio = V.trace_log_ratio(torch.tensor(frame["log_prior"].to_numpy()),
                                  torch.tensor(frame["log_posterior"].to_numpy()),
                                  torch.tensor(frame["trace_tokens"].to_numpy(), dtype=torch.long))
    out = {"log_ratio": log_ratio}
    for name in V.ESTIMATORS:
        log_correct = V.log_correct_estimate(
            name, answer_logp=torch.tensor(frame["answer_logp"].to_numpy()),
            answer_tokens=torch.tensor(frame["answer_tokens"].to_numpy(), dtype=torch.long), correct=correct)
        out[V.weight_column(name)] = V.normalise_weights(V.trace_log_weights(log_ratio, log_correct), group)
    return out


def run_weights(st: Stage) -> dict[str, Any]:
    """For every trace: log pi_theta0(z|x), log q_phi(z|x,y'), log pi_theta0(y'|x,z), M answers' correctness,
    and the normalised weights of every estimator."""
    model, _ = load_model(st, st.inputs["prior"])
    traces = pd.read_parquet(st.inputs["traces"])
    m, tok = st.vr.weights.m, st.tokenizer
    log_z, log_y, n_z, n_y = segment_logprobs(model, tok, list(traces["prompt"]), list(traces["trace_text"]),
                                              [answer_text(int(h)) for h in traces["hint"]])
    if not torch.equal(n_z, torch.tensor(traces["trace_tokens"].to_numpy(), dtype=torch.long)):
        raise ValueError(f"{st.inputs['traces']}: trace_tokens do not match the trace texts' token counts")
    prompts = [f"{p} {z}".strip() for p, z in zip(traces["prompt"], traces["trace_text"])]
    correct = _answer_correctness(st, model, prompts, [int(h) for h in traces["hint"]], m)
    frame = traces[["question", "trace", "trace_tokens", "log_posterior", "posterior_correct"]].copy()
    frame["answer_tokens"] = n_y.numpy()
    frame["log_prior"] = log_z.numpy()
    frame["answer_logp"] = log_y.numpy()
    frame["acc"] = correct.double().mean(-1).numpy()
    for name, values in trace_weights(frame, correct).items():
        frame[name] = values.numpy()
    frame = frame[list(V.weights_columns())]
    data = {M.VR_ANSWER_ACC: float(frame["acc"].mean()), M.VR_LOG_RATIO_MEAN: float(frame["log_ratio"].mean()),
            M.VR_POSTERIOR_CORRECT: float(frame["posterior_correct"].mean()),
            M.VR_TRACE_TOKENS_MEAN: float(frame["trace_tokens"].mean())}
    _log_metrics(st, data, 0)
    atomic_write(st.output, lambda tmp: frame.to_parquet(tmp, index=False))
    log.info("weights: %d traces, mean acc of pi_theta0's answers after a trace %.3f", len(frame),
             data[M.VR_ANSWER_ACC])
    return {"step": 0, "rows": len(frame), **data}


def _rft_rows(st: Stage, model: nn.Module, qs: Sequence[Question]) -> list[Row]:
    """rft.samples responses per question from pi_theta0; the correct ones, each weighted 1/rft.samples."""
    n, tok = st.vr.rft.samples, st.tokenizer
    with torch.no_grad():
        model.eval()
        b = rollout_problems(model, tok, [q.problem for q in qs], n=n, max_new_tokens=st.response_budget,
                             temperature=1.0, generator=_generator(st, salt=43))
        model.train()
    rows = []
    for i, (resp, ok) in enumerate(zip(b.response_ids.tolist(), b.rewards.tolist())):
        if ok > 0.5:
            q = qs[i // n]
            rows.append(Row(q.index, q.problem.prompt, tok.decode(resp), 1.0 / n))
    return rows


def _vr_rows(st: Stage, qs: Sequence[Question]) -> list[Row]:
    """The vr_* training rows: all K traces with their weights, or the best trace per question + the original."""
    traces = pd.read_parquet(st.inputs["traces"])
    weights = pd.read_parquet(st.inputs["weights"])
    col = V.weight_column(st.vr.method.estimator)
    joined = traces.merge(weights[["question", "trace", col]], on=["question", "trace"], how="inner",
                          validate="one_to_one")
    if len(joined) != len(traces) or len(weights) != len(traces):
        raise ValueError(f"{st.inputs['weights']} and {st.inputs['traces']} hold different traces")
    if int(joined["question"].max()) >= len(qs):
        raise ValueError(f"{st.inputs['traces']} has questions beyond data.questions={len(qs)}")
    prompt = {q.index: q.problem.prompt for q in qs}
    if st.vr.method.data == "all_weighted":
        return [Row(int(r.question), prompt[int(r.question)], join_response(r.trace_text, int(r.hint)),
                    float(getattr(r, col))) for r in joined.itertuples() if getattr(r, col) > 0]
    group = torch.tensor(joined["question"].to_numpy(), dtype=torch.long)
    w = torch.tensor(joined[col].to_numpy())
    rows = [Row(q.index, q.problem.prompt, q.solution, 1.0) for q in qs]
    for i in V.best_trace(w, group).tolist():
        r = joined.iloc[i]
        if r[col] > 0:
            rows.append(Row(int(r["question"]), prompt[int(r["question"])],
                            join_response(r["trace_text"], int(r["hint"])), 1.0))
    return rows


def run_final(st: Stage) -> dict[str, Any]:
    """A final recipe from the base model: sft, rft or vr_*; evaluated at the last step."""
    model, info = _base_model(st)
    qs = st.questions
    name = st.vr.method.name
    extra: dict[str, float] = {}
    if name == "sft":
        rows = [Row(q.index, q.problem.prompt, q.solution, 1.0) for q in qs]
    elif name == "rft":
        rows = _rft_rows(st, model, qs)
        extra[M.VR_RFT_KEPT] = len(rows) / (len(qs) * st.vr.rft.samples)
    else:
        rows = _vr_rows(st, qs)
    log.info("final %s: %d training rows over %d questions", name, len(rows), len(qs))
    summary = _train(st, model, rows, st.vr.final.epochs, final_metrics=lambda mdl: {**evaluate(st, mdl), **extra})
    _save_model(st.output, model, {"base": info.get("cache_path"), "stage": "final", "recipe": name})
    log.info("final evaluation: %s", _summary_line(summary))
    return summary


_RUNNERS = {"prior": run_prior, "posterior": run_posterior, "traces": run_traces, "weights": run_weights,
            "final": run_final}


def _total_steps(st: Stage) -> int:
    s = st.vr.sft
    epochs = {"posterior": st.vr.posterior.epochs, "final": st.vr.final.epochs}.get(st.vr.stage)
    return 0 if epochs is None else epochs * math.ceil(st.vr.data.questions / s.questions_per_step)


def run_stage(run_dir: str | Path) -> dict[str, Any]:
    """Run the stage RUN_DIR/config.yaml names (resuming it; a completed one is left as it is)."""
    st = prepare_stage(run_dir)
    with hold_run_lock(st.run_dir):
        total = _total_steps(st)
        if read_status(st.run_dir).get("status") == "completed" and st.output.is_file():
            last = read_metrics(st.run_dir / METRICS_FILE)
            return {"step": total, "completed_before": True, **(last[-1]["data"] if last else {})}
        with run_logging(st.run_dir, log):
            try:
                torch.set_num_threads(1)
                write_status(st.run_dir, "running", 0, total)
                log.info("start: stage=%s method=%s seed=%s run_dir=%s", st.vr.stage, st.vr.method.name,
                         st.vr.seed, st.run_dir)
                log.info("model: %s", st.model_cfg.get("label", st.model_cfg.get("name")))
                log.info("pi_theta0: %s", PRIOR_LABEL)
                log.info("task: %s; eval splits: %s", st.task.label or "synthetic arithmetic", STANDIN_LABEL)
                with single_thread():
                    summary = _RUNNERS[st.vr.stage](st)
                write_status(st.run_dir, "completed", total, total)
                log.info("completed: %s", st.output)
                return summary
            except BaseException as exc:
                record_failure(st.run_dir, total, exc, log)
                raise


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m predmask.rl.vr_runner RUN_DIR``: exit 0 done, 2 bad input or a busy run directory, 130 Ctrl-C, 1 a
    full disk or a read-only file system (:func:`predmask.rl.train.failure_exit`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(args) != 1:
        print("usage: python -m predmask.rl.vr_runner RUN_DIR (a run directory holding config.yaml)",
              file=sys.stderr)
        return 2
    try:
        run_stage(args[0])
    except BaseException as exc:
        code = failure_exit(exc, Path(args[0]))
        if code is None:
            raise
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
