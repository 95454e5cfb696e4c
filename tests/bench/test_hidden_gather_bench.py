"""The hidden-states benchmark (predmask/hidden_gather_bench.py) measures what it says: its profiler peak counts a
known allocation, and its logits and hidden-states steps compute the same loss gradients."""

from __future__ import annotations

import pytest
import torch

from predmask.hidden_gather_bench import (
    PATHS,
    bench_hidden,
    make_hidden_inputs,
    peak_extra_bytes_profiled,
    step_fn,
)


def test_profiled_peak_counts_the_tensors_live_at_once() -> None:
    n = 1 << 20  # float32: 4 MiB each

    def step() -> None:
        a = torch.ones(n)
        b = torch.ones(n)  # two live at once
        del a, b
        c = torch.ones(n)  # one again: the peak stays two
        del c

    peak = peak_extra_bytes_profiled(step)
    assert 2 * 4 * n <= peak < 2 * 4 * n + (1 << 16)


def test_the_logits_and_hidden_steps_compute_the_same_gradients() -> None:
    x = make_hidden_inputs(64, 300, 16, 5, seed=3)
    grad_logits = step_fn("logits", x)()
    grad_hidden = step_fn("hidden", x)()
    for ref, got in zip(grad_logits, grad_hidden, strict=True):
        assert ref.abs().max() > 0
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="unknown path 'other'; allowed: " + ", ".join(PATHS)):
        step_fn("other", x)


def test_bench_record_holds_the_ratio_and_both_targets() -> None:
    r = bench_hidden(32, vocab=200, dim=8, topk=4, repeats=1, memory=True)
    assert r["time_ratio"] == pytest.approx(r["median_s"]["hidden"] / r["median_s"]["logits"])
    assert [t["limit"] for t in r["targets"]] == [1.5, 0.25]
    assert r["peak_extra"]["logits"] >= 1.0  # the logits and their gradient are [tokens, vocab] each
