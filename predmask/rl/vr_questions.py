"""The variational family's data on the CPU stand-in: the original questions, q_phi's hint prompts, response texts.

What x, z, y and the original data are: ``python -m predmask.rl.vr_runner --help``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from predmask.rl.task import Problem, format_solution, make_split, noisy_steps
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.schemas.task_schema import TaskConfig


@dataclass(frozen=True)
class Question:
    """One question of the original data: its index, problem and the noisy worked solution written for it."""

    index: int
    problem: Problem
    steps: tuple[int, ...]

    @property
    def solution(self) -> str:
        return format_solution(self.steps)

    @property
    def original_answer(self) -> int:
        """The original solution's own final answer (wrong when a slip happened): q_phi's hint in training."""
        return self.steps[-1]


def original_data(task: TaskConfig, questions: int, noise: float, seed: int) -> list[Question]:
    """The first ``questions`` train problems, each with one solution with slips at rate ``noise`` (rng: ``seed``)."""
    rng = random.Random(seed)
    return [Question(i, p, noisy_steps(p, rng, noise, task.max_number))
            for i, p in enumerate(make_split(task, "train", questions))]


def answer_text(answer: int) -> str:
    """The answer segment y of a response (without <eos>, which the tokenizer appends)."""
    return f"\\boxed{{{answer}}}"


def join_response(trace_text: str, answer: int) -> str:
    """A response text: the trace z, then the boxed answer."""
    return f"{trace_text} {answer_text(answer)}" if trace_text else answer_text(answer)


def split_trace(tokenizer: ArithmeticTokenizer, ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(trace z, answer part) of a sampled response: z = the tokens before the first ``\\boxed{`` (all tokens
    before <eos> when there is none); the answer part is the rest up to <eos> (empty without a box)."""
    row = [int(i) for i in ids]
    if tokenizer.eos_id in row:
        row = row[: row.index(tokenizer.eos_id)]
    row = [i for i in row if i not in (tokenizer.pad_id, tokenizer.bos_id)]  # specials the text cannot hold
    box = tokenizer.token_id("\\boxed{")
    cut = row.index(box) if box in row else len(row)
    return row[:cut], row[cut:]
