"""Fixtures of the CPU engine tests: one torch thread, the task's tokenizer, a tiny peaked random policy."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import peaked_policy

from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.schemas.task_schema import TaskConfig


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer() -> ArithmeticTokenizer:
    return ArithmeticTokenizer(TaskConfig().max_number)


@pytest.fixture(scope="session")
def policy(tokenizer: ArithmeticTokenizer) -> torch.nn.Module:
    return peaked_policy(tokenizer)
