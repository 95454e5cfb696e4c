"""verl's real actor worker with the plugin on, on the CPU: ``ActorRolloutRefWorker(role="actor")``, its FSDP2
engine, ``compute_log_prob`` then ``update_actor`` on a batch prepared as verl's trainer prepares it (two
mini-batches, shuffled, dynamic batch size), remove-padding on and off in one process, and Ulysses sequence
parallel 2 in two processes (gloo).

Truth: the loss runs and every parameter changes; every sample is trained once; at every response token of every
micro-batch, the plugin's support gather at the sampled token equals verl's own ``log_probs`` exactly (float32,
``torch.equal``): the support is aligned with verl's tokens in every layout verl splits a batch into; and the
plugin's loss statistics, merged as ingest merges them, give the same exact metrics in every layout.

Stand-ins, because this machine has no GPU: verl's platform is the CPU one of predmask.verl.cpu (device
``cpu``, gloo instead of NCCL); attention is transformers' ``sdpa`` because flash-attention needs a GPU. With
remove-padding, verl packs the sequences of a micro-batch into one row and relies on flash-attention's varlen
kernel to keep them apart, and its Ulysses all-to-all is a patch of the flash-attention path: under ``sdpa`` the
packed sequences attend across their boundaries and each sequence-parallel rank attends within its own slice. The
logits are therefore not those of the model on a GPU, but verl's log-probs and the plugin's gather read the same
logits, which is what is checked. Ray is not used: the test calls the worker's methods directly, as the single
controller would on each rank (tests/verl/verl_cpu_worker.py runs one rank).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from verl_helpers import require_verl

require_verl("verl.plugin.platform")

import verl_cpu_worker as cpu_worker

pytestmark = [pytest.mark.verl, pytest.mark.slow]

#: a run that takes longer than this is stuck (a gloo collective waiting for a rank that died)
DEADLINE_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(out: Path, model_dir: Path, world_size: int, sp: int,
                layouts: tuple[bool, ...]) -> dict[tuple[int, bool], Any]:
    """Run :func:`verl_cpu_worker.run_rank` in ``world_size`` fresh processes; their results by (rank, rmpad)."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(cpu_worker.run_rank, nprocs=world_size, join=False, start_method="spawn",
                                 args=(world_size, _free_port(), sp, layouts, str(model_dir), str(out)))
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=max(deadline - time.monotonic(), 1.0)):  # False while a rank still runs
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"verl's worker did not finish within {DEADLINE_S} s")
    return {(rank, rmpad): torch.load(out / f"rank{rank}-rmpad{int(rmpad)}.pt", weights_only=False)
            for rank in range(world_size) for rmpad in layouts}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cpu_worker.save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[tuple[int, bool], Any]:
    return spawn_ranks(tmp_path_factory.mktemp("ws1"), model_dir, world_size=1, sp=1, layouts=(True, False))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[tuple[int, bool], Any]:
    return spawn_ranks(tmp_path_factory.mktemp("ws2"), model_dir, world_size=2, sp=2, layouts=(True,))


@pytest.fixture(scope="module")
def batch_responses() -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's responses and response mask, rebuilt here from the same seed."""
    batch = cpu_worker.rollout_batch()
    return batch.batch["responses"], batch.batch["response_mask"].bool()


def sample_order(run: dict[str, Any], responses: torch.Tensor) -> list[int]:
    """Indices of the samples in the order the loss saw them (a response identifies its sample)."""
    order = []
    for micro in run["micro_batches"]:
        width = micro["responses"].shape[1]
        for row in micro["responses"]:
            hits = [i for i in range(len(responses)) if torch.equal(responses[i, :width], row)]
            assert len(hits) == 1, hits
            order.append(hits[0])
    return order


def check_run(run: dict[str, Any], responses: torch.Tensor, mask: torch.Tensor) -> None:
    assert run["actor_cls"] == "PredmaskTrainingWorker"  # the plugin's worker hook is on
    assert run["engine_cls"] == "FSDPEngineWithLMHead" and run["module_cls"] == "FSDPQwen3ForCausalLM"  # FSDP2
    # the loss ran and the optimizer stepped: every parameter moved, none became non-finite
    assert run["before"].keys() == run["after"].keys() and len(run["before"]) > 10
    for name, before in run["before"].items():
        after = run["after"][name]
        assert torch.isfinite(after).all() and not torch.equal(before, after), name
    # two shuffled mini-batches, split further by the dynamic batch size; every sample trained once
    micro_batches = run["micro_batches"]
    assert len(micro_batches) > 2
    order = sample_order(run, responses)
    assert sorted(order) == list(range(len(responses))) and order != sorted(order)
    # the support gather at the sampled token is verl's log-prob, bit for bit, at every response token
    tokens = 0
    for micro in micro_batches:
        ok = micro["mask"]
        assert micro["log_prob"].dtype == torch.float32 and torch.isfinite(micro["log_prob"][ok]).all()
        assert torch.equal(micro["pi_sampled"][ok], micro["log_prob"][ok])
        tokens += int(ok.sum())
    assert tokens == int(mask.sum())


@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
def test_update_actor_one_process(one_process, batch_responses, remove_padding: bool) -> None:
    check_run(one_process[(0, remove_padding)], *batch_responses)


def test_update_actor_ulysses_sp2_two_processes(two_processes, batch_responses) -> None:
    runs = [two_processes[(rank, True)] for rank in (0, 1)]
    for run in runs:
        check_run(run, *batch_responses)
    # data parallel size 1: both sequence-parallel ranks train the same micro-batches and see the whole sequences
    # after verl's all-gather, and FSDP2 keeps one set of parameters
    first, second = runs
    assert len(first["micro_batches"]) == len(second["micro_batches"])
    for a, b in zip(first["micro_batches"], second["micro_batches"], strict=True):
        assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["log_prob"], b["log_prob"])
    assert all(torch.equal(first["after"][n], second["after"][n]) for n in first["after"])


def test_exact_metrics_do_not_depend_on_the_layout(one_process, two_processes, batch_responses) -> None:
    """The plugin's per-micro-batch statistics, merged by ingest, give each mini-batch's token count and the
    largest gather gap whatever the split (verl's own mean over micro-batches and ranks does not). One training
    step of two mini-batches; the truth is the response lengths of the samples each mini-batch held."""
    from analysis.store.exact_metrics import exact_step_metrics
    from predmask.metrics import MASK_PI_SAMPLED_GAP, MASK_TOKENS, reduce_metrics

    responses, mask = batch_responses
    runs = {"rmpad": one_process[(0, True)], "padded": one_process[(0, False)], "sp2": two_processes[(0, True)]}
    for layout, run in runs.items():
        order = sample_order(run, responses)  # the first mini-batch's micro-batches come first
        counts = [{MASK_TOKENS: float(mask[order[i:i + cpu_worker.MINI_BATCH]].sum())}
                  for i in range(0, len(order), cpu_worker.MINI_BATCH)]
        steps = exact_step_metrics(Path(run["run_dir"]))
        assert list(steps) == [1], layout
        assert steps[1][MASK_TOKENS] == reduce_metrics(counts)[MASK_TOKENS], layout
        assert steps[1][MASK_PI_SAMPLED_GAP] == 0.0, layout
