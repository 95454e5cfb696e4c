"""Token-level study tests run single-threaded (the machine's cores are shared); the tiny pretrained policy."""

from pathlib import Path

import pytest
import torch
from token_level_helpers import TINY_MODEL, TINY_TASK


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny policy pretrained for a few seconds (so that some rollouts are correct), saved as a state dict."""
    from predmask.rl.base import pretrain
    from predmask.rl.model import build_policy
    from predmask.rl.tokenizer import ArithmeticTokenizer
    from predmask.schemas.train_schema import BaseConfig

    torch.set_num_threads(1)
    tok = ArithmeticTokenizer(TINY_TASK.max_number)
    model = build_policy(TINY_MODEL, tok.vocab_size, 0)
    pretrain(model, tok, TINY_TASK, BaseConfig(steps=300, batch_size=32, lr=1e-2, warmup=10), progress=False)
    path = tmp_path_factory.mktemp("ckpt") / "policy.pt"
    torch.save(model.state_dict(), path)
    return path
