"""Token-level study tests run single-threaded (the machine's cores are shared)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
