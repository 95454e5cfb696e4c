"""The synthetic verifiable math task of the CPU engine: seeded multi-step integer arithmetic, boxed answers, 1/0 reward.

A problem is a left-to-right chain of additions and subtractions written as a fixed form of ``slots``
operation slots, unused ones blank, e.g. ``7 + 2 - 5 _ _ _ _ _ _ =`` (3 of 5 slots blank). The worked solution
writes every intermediate result, separated by commas, then the final answer in ``\\boxed{}``: ``9 , 4
\\boxed{4}``. Every number lies in ``[0, max_number]`` so that each number is one token of the task's
tokenizer. The fixed form keeps every operand at the same distance from the step that uses it, which is what
lets a two-layer policy learn the task in a minute of CPU pretraining.

Splits (``make_split``): ``train`` (``train_ops`` operations; the RL prompts), ``pretrain`` (the base model's
supervised data, ``pretrain_ops``; its solutions can be made noisy, as a web corpus is) and the harder
held-out ``aime24_standin`` / ``aime25_standin`` (``eval_ops``), stand-ins for the paper's AIME sets, named so
in configs and labelled so in outputs. Held-out problems never occur in ``train`` or ``pretrain``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from predmask.schemas.task_schema import TaskConfig

EVAL_SPLITS: tuple[str, ...] = ("aime24_standin", "aime25_standin")
SPLITS: tuple[str, ...] = ("train", "pretrain", *EVAL_SPLITS)
#: how every output labels the evaluation splits
STANDIN_LABEL = "synthetic arithmetic stand-in for the paper's AIME24/AIME25 (not the real benchmarks)"


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: ``numbers[0] ops[0] numbers[1] ops[1] ... =`` evaluated left to right.

    With ``slots`` > len(ops) the prompt ends with blank slots (``_ _`` each) before ``=``.
    """

    numbers: tuple[int, ...]
    ops: tuple[str, ...]
    steps: tuple[int, ...] = field(default=())
    slots: int = 0

    @property
    def answer(self) -> int:
        return self.steps[-1]

    @property
    def prompt(self) -> str:
        parts = [str(self.numbers[0])]
        for op, n in zip(self.ops, self.numbers[1:]):
            parts += [op, str(n)]
        parts += ["_", "_"] * max(0, self.slots - len(self.ops))
        return " ".join(parts) + " ="

    @property
    def solution(self) -> str:
        """The worked solution: intermediate results, then the boxed answer."""
        return format_solution(self.steps)


def make_problem(rng: random.Random, n_ops: int, operand_max: int, max_number: int, slots: int = 0) -> Problem:
    """Draw one problem whose intermediate results all stay in ``[0, max_number]`` (prompt form of ``slots``)."""
    numbers = [rng.randint(0, operand_max)]
    ops: list[str] = []
    steps: list[int] = []
    acc = numbers[0]
    for _ in range(n_ops):
        n = rng.randint(0, operand_max)
        choices = [op for op, v in (("+", acc + n), ("-", acc - n)) if 0 <= v <= max_number]
        if not choices:  # cannot happen while operand_max <= max_number, kept as a guard
            n, choices = 0, ["+"]
        op = rng.choice(choices)
        acc = acc + n if op == "+" else acc - n
        numbers.append(n)
        ops.append(op)
        steps.append(acc)
    return Problem(tuple(numbers), tuple(ops), tuple(steps), slots)


def noisy_steps(problem: Problem, rng: random.Random, noise: float, max_number: int, max_offset: int = 3) -> tuple[int, ...]:
    """The problem's intermediate results as a noisy corpus would write them: with probability ``noise`` per
    step the written result is off by 1..``max_offset`` (an arithmetic slip) and the chain continues from the
    wrong value, so the final answer is wrong too. Values stay in ``[0, max_number]``."""
    if not 0.0 <= noise < 1.0:
        raise ValueError(f"noise must lie in [0, 1), got {noise}")
    acc, steps = problem.numbers[0], []
    for op, n in zip(problem.ops, problem.numbers[1:]):
        acc = min(max(acc + n if op == "+" else acc - n, 0), max_number)
        if noise > 0 and rng.random() < noise:
            offsets = [d for d in range(-max_offset, max_offset + 1) if d and 0 <= acc + d <= max_number]
            acc += rng.choice(offsets)
        steps.append(acc)
    return tuple(steps)


def guess_solution(problem: Problem, rng: random.Random, spread: int, max_number: int) -> str:
    """A bare answer without working, as a careless author writes it: the answer off by up to ``spread``."""
    value = min(max(problem.answer + rng.randint(-spread, spread), 0), max_number)
    return f"\\boxed{{{value}}}"


def format_solution(steps: tuple[int, ...]) -> str:
    """Solution text of a list of intermediate results (the last one is the boxed answer)."""
    return " , ".join(str(s) for s in steps) + f" \\boxed{{{steps[-1]}}}"


def _split_seed(cfg: TaskConfig, split: str) -> int:
    return cfg.seed * 1_000_003 + SPLITS.index(split) * 7919


#: a prime far above every split seed: streams of different (task seed, split, replicate) never share a seed
_REPLICATE_STRIDE = 2**61 - 1


def _stream_seed(cfg: TaskConfig, split: str, replicate: int) -> int:
    """The seed of one replicate's stream of ``split``; replicate 0 is the split's own seed. Replicates map to
    0, 1, 2, ... as 0, 1, -1, 2, -2, ... (``random.Random`` drops an int seed's sign, so -r would repeat r)."""
    rank = 2 * replicate - 1 if replicate > 0 else -2 * replicate
    return _split_seed(cfg, split) + rank * _REPLICATE_STRIDE


def make_split(cfg: TaskConfig, split: str, size: int | None = None) -> list[Problem]:
    """The problems of one split (deterministic for ``cfg``; ``size`` defaults to ``cfg.eval_size``): for
    ``train`` and ``pretrain`` the first ``size`` problems of ``iter_train_prompts``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    n = cfg.eval_size if size is None else size
    if split in EVAL_SPLITS:
        i = EVAL_SPLITS.index(split)
        rng = random.Random(_split_seed(cfg, split))
        seen: set[Problem] = set()
        out: list[Problem] = []
        while len(out) < n:
            p = make_problem(rng, cfg.eval_ops[i], cfg.operand_max, cfg.max_number, cfg.slots)
            if p not in seen:
                seen.add(p)
                out.append(p)
        return out
    it = iter_train_prompts(cfg, split=split)
    return [next(it) for _ in range(n)]


def _heldout(cfg: TaskConfig) -> frozenset[Problem]:
    return frozenset(p for s in EVAL_SPLITS for p in make_split(cfg, s))


def iter_train_prompts(cfg: TaskConfig, split: str = "train", start: int = 0,
                       replicate: int = 0) -> Iterator[Problem]:
    """Endless deterministic stream of ``train`` (or ``pretrain``) problems, skipping held-out ones, from data
    position ``start``. ``replicate`` (an RL run's ``seed``) draws that replicate's own stream from the same
    distribution; replicate 0 is the split's stream as the task seed alone gives it."""
    if split not in ("train", "pretrain"):
        raise ValueError(f"iter_train_prompts takes split 'train' or 'pretrain', got {split!r}")
    lo, hi = cfg.train_ops if split == "train" else cfg.pretrain_ops
    heldout = _heldout(cfg)
    rng = random.Random(_stream_seed(cfg, split, replicate))
    i = 0
    while True:
        p = make_problem(rng, rng.randint(lo, hi), cfg.operand_max, cfg.max_number, cfg.slots)
        if p in heldout:
            continue
        if i >= start:
            yield p
        i += 1


_BOXED = re.compile(r"\\boxed\s*\{")
_INT = re.compile(r"^\s*([+-]?)\s*(\d+)\s*$")


def extract_answer(text: str) -> int | None:
    """The integer in the last ``\\boxed{...}`` of ``text``; None when absent, unclosed, empty or not an integer.
    Accepts spaces inside the box and around a sign (``\\boxed{ - 7 }`` -> -7), ``\\boxed {`` spacing, and
    thousands separators (``1,234``)."""
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    body_start = starts[-1].end()
    depth, end = 1, None
    for j in range(body_start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                end = j
                break
    if end is None:
        return None
    body = text[body_start:end].replace(",", "")
    m = _INT.match(body)
    if m is None:
        return None
    value = int(m.group(2))
    return -value if m.group(1) == "-" else value


def reward(response_text: str, answer: int) -> float:
    """1.0 when the extracted final answer (``extract_answer``) equals ``answer``, else 0.0."""
    got = extract_answer(response_text)
    return 1.0 if got is not None and got == answer else 0.0
