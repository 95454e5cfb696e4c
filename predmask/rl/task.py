"""The synthetic verifiable math task of the CPU engine: seeded multi-step integer arithmetic, boxed answers, 1/0 reward.

A problem is a left-to-right chain of additions and subtractions, e.g. ``37 + 12 - 5 =``. The worked solution
writes every intermediate result, separated by commas, then the final answer in ``\\boxed{}``:
``49 , 44 \\boxed{44}``. Every number (operands, intermediate results, answers) lies in ``[0, max_number]`` so
that each number is one token of the task's tokenizer (``predmask.rl.tokenizer``).

Splits (``make_split``):

- ``train``: 1..``train_max_ops`` operations, operands in ``[0, operand_max]``; the RL prompts.
- ``aime24_standin``: harder held-out problems (``eval_ops[0]`` operations), stand-in for AIME 2024.
- ``aime25_standin``: harder held-out problems (``eval_ops[1]`` operations, wider operands), stand-in for AIME 2025.
- ``pretrain``: the supervised data of the base model (1..``pretrain_max_ops`` operations).

Held-out problems never occur in ``train`` or ``pretrain`` (their expressions are excluded by construction).
The evaluation splits are stand-ins for the paper's AIME sets, named so in configs and labelled so in outputs.

Reward (``reward``): 1.0 when the last ``\\boxed{...}`` of the response holds an integer equal to the answer,
else 0.0; ``extract_answer`` is tolerant of spaces, signs, ``\\boxed {`` spacing, and surrounding text, and
returns None for a missing, empty, unclosed or non-integer box.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

__all__ = [
    "SPLITS",
    "EVAL_SPLITS",
    "STANDIN_LABEL",
    "TaskConfig",
    "Problem",
    "make_problem",
    "make_split",
    "extract_answer",
    "reward",
    "iter_train_prompts",
]

EVAL_SPLITS: tuple[str, ...] = ("aime24_standin", "aime25_standin")
SPLITS: tuple[str, ...] = ("train", "pretrain", *EVAL_SPLITS)
#: how every output labels the evaluation splits
STANDIN_LABEL = "synthetic arithmetic stand-in for the paper's AIME24/AIME25 (not the real benchmarks)"


@dataclass(frozen=True)
class TaskConfig:
    """Shape of the arithmetic task; every field changes the data (and so the base-model cache key)."""

    max_number: int = 255
    operand_max: int = 49
    train_max_ops: int = 3
    pretrain_max_ops: int = 4
    eval_ops: tuple[int, int] = (3, 4)
    eval_operand_max: tuple[int, int] = (49, 49)
    eval_size: int = 30
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.max_number < 20:
            raise ValueError(f"task.max_number must be >= 20, got {self.max_number}")
        if not 1 <= self.operand_max <= self.max_number:
            raise ValueError(f"task.operand_max must lie in [1, max_number={self.max_number}], got {self.operand_max}")
        if self.train_max_ops < 1 or self.pretrain_max_ops < 1:
            raise ValueError("task.train_max_ops and task.pretrain_max_ops must be >= 1")
        if len(self.eval_ops) != 2 or len(self.eval_operand_max) != 2:
            raise ValueError("task.eval_ops and task.eval_operand_max need one value per eval split (2)")
        if min(self.eval_ops) < 1 or not all(1 <= m <= self.max_number for m in self.eval_operand_max):
            raise ValueError(f"bad eval_ops {self.eval_ops} or eval_operand_max {self.eval_operand_max}")
        if self.eval_size < 1:
            raise ValueError(f"task.eval_size must be >= 1, got {self.eval_size}")

    @classmethod
    def from_mapping(cls, values: dict) -> TaskConfig:
        """Build from a config mapping (lists become tuples); unknown keys raise a one-line error."""
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(values) - known)
        if bad:
            raise ValueError(f"unknown task keys {bad}; allowed: {sorted(known)}")
        v = dict(values)
        for k in ("eval_ops", "eval_operand_max"):
            if k in v:
                v[k] = tuple(int(x) for x in v[k])
        return cls(**v)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: ``numbers[0] ops[0] numbers[1] ops[1] ... =`` evaluated left to right."""

    numbers: tuple[int, ...]
    ops: tuple[str, ...]
    steps: tuple[int, ...] = field(default=())

    @property
    def answer(self) -> int:
        return self.steps[-1]

    @property
    def prompt(self) -> str:
        parts = [str(self.numbers[0])]
        for op, n in zip(self.ops, self.numbers[1:]):
            parts += [op, str(n)]
        return " ".join(parts) + " ="

    @property
    def solution(self) -> str:
        """The worked solution: intermediate results, then the boxed answer."""
        return " , ".join(str(s) for s in self.steps) + f" \\boxed{{{self.answer}}}"


def _evaluate(numbers: tuple[int, ...], ops: tuple[str, ...]) -> tuple[int, ...]:
    acc, steps = numbers[0], []
    for op, n in zip(ops, numbers[1:]):
        acc = acc + n if op == "+" else acc - n
        steps.append(acc)
    return tuple(steps)


def make_problem(rng: random.Random, n_ops: int, operand_max: int, max_number: int) -> Problem:
    """Draw one problem whose intermediate results all stay in ``[0, max_number]``."""
    numbers = [rng.randint(0, operand_max)]
    ops: list[str] = []
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
    return Problem(tuple(numbers), tuple(ops), _evaluate(tuple(numbers), tuple(ops)))


def _split_seed(cfg: TaskConfig, split: str) -> int:
    return cfg.seed * 1_000_003 + SPLITS.index(split) * 7919


def make_split(cfg: TaskConfig, split: str, size: int | None = None) -> list[Problem]:
    """The problems of one evaluation split (deterministic for ``cfg``); ``size`` defaults to ``cfg.eval_size``.

    For ``train`` and ``pretrain`` use ``iter_train_prompts`` (an endless stream); ``make_split`` on them returns
    the first ``size`` problems of that stream.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    if split in EVAL_SPLITS:
        i = EVAL_SPLITS.index(split)
        rng = random.Random(_split_seed(cfg, split))
        n = cfg.eval_size if size is None else size
        seen: set[Problem] = set()
        out: list[Problem] = []
        while len(out) < n:
            p = make_problem(rng, cfg.eval_ops[i], cfg.eval_operand_max[i], cfg.max_number)
            if p not in seen:
                seen.add(p)
                out.append(p)
        return out
    it = iter_train_prompts(cfg, split=split)
    return [next(it) for _ in range(cfg.eval_size if size is None else size)]


def _heldout(cfg: TaskConfig) -> frozenset[Problem]:
    return frozenset(p for s in EVAL_SPLITS for p in make_split(cfg, s))


def iter_train_prompts(cfg: TaskConfig, split: str = "train", start: int = 0) -> Iterator[Problem]:
    """Endless deterministic stream of ``train`` (or ``pretrain``) problems, skipping held-out ones.

    ``start`` skips that many problems (the data position of a resumed run).
    """
    if split not in ("train", "pretrain"):
        raise ValueError(f"iter_train_prompts takes split 'train' or 'pretrain', got {split!r}")
    max_ops = cfg.train_max_ops if split == "train" else cfg.pretrain_max_ops
    heldout = _heldout(cfg)
    rng = random.Random(_split_seed(cfg, split))
    i = 0
    while True:
        p = make_problem(rng, rng.randint(1, max_ops), cfg.operand_max, cfg.max_number)
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
    thousands separators (``1,234``).
    """
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
    """1.0 when the extracted final answer equals ``answer``, else 0.0."""
    got = extract_answer(response_text)
    return 1.0 if got is not None and got == answer else 0.0
