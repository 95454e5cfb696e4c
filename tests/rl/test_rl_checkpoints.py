"""Checkpoints (predmask.checkpoints) on real files: data-only loading refuses a pickle that would run code, and an
unreadable newest checkpoint is moved aside (kept) while the newest readable one is used."""

from __future__ import annotations

import logging
import os
import pickle
import random
from pathlib import Path

import pytest
import torch

from predmask.checkpoints import (
    CheckpointRefusedError,
    checkpoint_files,
    checkpoint_path,
    latest_valid_checkpoint,
    load_data,
    save_checkpoint,
)
from predmask.rundir import DamagedFileError

LOG = logging.getLogger("test.checkpoints")


class _RunsCode:
    """Pickles as a call of os.system: loading it with pickle's full unpickler would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _real_blob(seed: int) -> dict[str, object]:
    """What a trainer saves: a model's and an AdamW optimiser's state after one step, the RNG states, a data plan."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "plan": [[0, 2], [1]],
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}


@pytest.mark.parametrize("form", ["torch zip", "bare pickle"])
def test_a_checkpoint_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path, form: str) -> None:
    marker = tmp_path / "ran"
    path = checkpoint_path(tmp_path, 4)
    path.parent.mkdir(parents=True)
    payload = {"step": 4, "model": _RunsCode(marker)}
    if form == "torch zip":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))  # torch's own pickle protocol
    # independent truth that the file is live: the unrestricted unpickler does run it (in a copy, then undone)
    if form == "torch zip":
        probe = tmp_path / "probe.pt"
        probe.write_bytes(path.read_bytes())
        torch.load(probe, weights_only=False)
    else:
        pickle.loads(path.read_bytes())
    assert marker.exists()
    marker.unlink()

    with pytest.raises(CheckpointRefusedError) as info:
        latest_valid_checkpoint(tmp_path, LOG)
    line = str(info.value)
    assert line.startswith(f"refused: {path} holds Python objects beyond tensors and plain containers (")
    assert "GLOBAL posix.system" in line and "\n" not in line
    assert not marker.exists()
    assert checkpoint_files(tmp_path) == [path]  # refused, not moved or deleted: the user decides


def test_a_saved_checkpoint_loads_back_equal_as_data(tmp_path: Path) -> None:
    blob = _real_blob(0)
    path = save_checkpoint(tmp_path, 3, blob, keep=2)
    assert path == tmp_path / "checkpoints" / "step_000003.pt"
    assert [p.name for p in path.parent.iterdir()] == ["step_000003.pt"]  # no temporary file left
    loaded = load_data(path)
    assert loaded["step"] == 3 and loaded["plan"] == blob["plan"]
    assert loaded["rng"]["python"] == blob["rng"]["python"]
    assert torch.equal(loaded["rng"]["torch"], blob["rng"]["torch"])
    for key, value in blob["model"].items():
        assert torch.equal(loaded["model"][key], value)
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], blob["optimizer"]["state"][0]["exp_avg"])


def test_keep_deletes_all_but_the_newest_checkpoints(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8, 999_999, 1_000_000):  # past six digits too: ordered by step, not by name
        save_checkpoint(tmp_path, step, {"x": torch.ones(1)}, keep=2)
    assert [p.name for p in checkpoint_files(tmp_path)] == ["step_999999.pt", "step_1000000.pt"]


@pytest.mark.parametrize("cut", ["half", "first 100 bytes", "empty", "not torch"])
def test_a_truncated_newest_checkpoint_is_kept_aside_and_the_older_one_used(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: str) -> None:
    older, newer = _real_blob(1), _real_blob(2)
    save_checkpoint(tmp_path, 4, older, keep=3)
    newest = save_checkpoint(tmp_path, 8, newer, keep=3)
    whole = newest.read_bytes()
    damaged = {"half": whole[: len(whole) // 2], "first 100 bytes": whole[:100], "empty": b"",
               "not torch": b"step: 8\n"}[cut]
    newest.write_bytes(damaged)

    with caplog.at_level(logging.WARNING, logger=LOG.name):
        found = latest_valid_checkpoint(tmp_path, LOG)

    assert found is not None and found.step == 4 and found.path.name == "step_000004.pt"
    for key, value in older["model"].items():
        assert torch.equal(found.blob["model"][key], value)
    aside = newest.with_name("step_000008.pt.damaged")
    assert aside.read_bytes() == damaged and not newest.exists()  # moved aside byte for byte, never deleted
    assert checkpoint_files(tmp_path) == [found.path]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"damaged: {newest}, unreadable (")
    assert warnings[0].endswith("moved aside to step_000008.pt.damaged (kept, not deleted); trying the next older "
                                "checkpoint")


def test_a_second_damaged_copy_of_a_step_does_not_replace_the_first(tmp_path: Path) -> None:
    for round_ in (1, 2):
        save_checkpoint(tmp_path, 2, {"x": torch.ones(1)}, keep=3)
        checkpoint_path(tmp_path, 2).write_bytes(f"garbage {round_}".encode())
        assert latest_valid_checkpoint(tmp_path, LOG) is None
    d = tmp_path / "checkpoints"
    assert (d / "step_000002.pt.damaged").read_bytes() == b"garbage 1"
    assert (d / "step_000002.pt.damaged-2").read_bytes() == b"garbage 2"


def test_a_torch_file_without_a_step_is_not_a_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = checkpoint_path(tmp_path, 5)
    path.parent.mkdir(parents=True)
    torch.save({"model": {}}, path)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert latest_valid_checkpoint(tmp_path, LOG) is None
    assert path.with_name("step_000005.pt.damaged").is_file()
    assert [r.getMessage().split(": moved")[0] for r in caplog.records] == [
        f"damaged: {path}, not a checkpoint (no integer 'step')"]


def test_a_model_file_that_is_not_a_torch_file_is_damaged_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(DamagedFileError, match=rf"^damaged: {path}, unreadable \(") as info:
        load_data(path)
    assert "\n" not in str(info.value)
