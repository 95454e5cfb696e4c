"""The plugin's loss statistics and their merge: per-micro-batch lines written by LossStatsWriter, merged per step by
analysis.store.exact_metrics into the values one micro-batch holding the whole mini-batch gives.

Truth: the metrics written out here for token sets split at random (sums, maxima and token-weighted means of
per-token values), and predmask.policy_loss on a whole batch against the same batch split into micro-batches.
No verl needed (also run without it: test_verl_free.py).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

import predmask
from analysis.store.exact_metrics import exact_step_metrics, merge_records, read_records
from predmask.metrics import LOSS_STATS_DIR, MASK_ADV_TOKENS, merge_micro_batches, reduce_metrics
from predmask.verl.loss_stats import LossStatsWriter, checkpoint_step


def _per_token_metrics(values: list[float], adv_nonzero: list[bool], dropped: list[bool]) -> dict[str, float]:
    n, n_adv = len(values), sum(adv_nonzero)
    return {
        "actor/mask/tokens": float(n), MASK_ADV_TOKENS: float(n_adv),
        "actor/mask/divergence_mean": sum(values) / n if n else 0.0,
        "actor/mask/divergence_max": max(values) if values else 0.0,
        "actor/pg_clipfrac": sum(d for d, a in zip(dropped, adv_nonzero) if a) / n_adv if n_adv else 0.0,
        "actor/mask/direction_disagree": float(sum(dropped)),
    }


def test_merging_any_split_of_the_tokens_gives_the_whole_batch() -> None:
    rng = random.Random(4)
    tokens = [(rng.random(), rng.random() > 0.3, rng.random() > 0.7) for _ in range(97)]
    whole = _per_token_metrics(*map(list, zip(*tokens)))
    for _trial in range(5):
        cuts = sorted(rng.sample(range(1, len(tokens)), rng.randint(1, 6)))
        parts = [tokens[a:b] for a, b in zip([0, *cuts], [*cuts, len(tokens)])]
        merged = merge_micro_batches([_per_token_metrics(*map(list, zip(*p))) for p in parts])
        assert merged.keys() == whole.keys()
        for k, v in whole.items():
            assert merged[k] == pytest.approx(v, rel=1e-12), k
        # verl's mean over micro-batches is not the batch's value
        assert sum(_per_token_metrics(*map(list, zip(*p)))["actor/mask/tokens"] for p in parts) / len(parts) != \
            whole["actor/mask/tokens"]


def test_policy_loss_metrics_of_micro_batches_merge_to_the_whole_batch() -> None:
    """predmask.policy_loss on 6 sequences at once and on 1 + 2 + 3 of them: merged, the same metrics."""
    g = torch.Generator().manual_seed(0)
    b, length, k, vocab = 6, 9, 4, 30
    mu_full = torch.log_softmax(torch.randn(b, length, vocab, generator=g) * 2, -1)
    pi_full = torch.log_softmax(mu_full + 0.5 * torch.randn(b, length, vocab, generator=g), -1)
    sampled = torch.distributions.Categorical(logits=mu_full).sample()
    top = mu_full.topk(k, -1)
    support = predmask.build_support(top.indices, top.values, sampled, mu_full.gather(-1, sampled[..., None])[..., 0])
    pi = torch.where(support.valid, pi_full.gather(-1, support.ids), torch.tensor(float("-inf")))
    mask = torch.ones(b, length)
    mask[1, 4:] = 0
    mask[4, 2:] = 0
    adv = torch.randn(b, 1, generator=g).expand(b, length).clone()
    adv[2] = 0.0

    def metrics(rows: slice) -> dict[str, float]:
        _, m = predmask.policy_loss(
            "predmask_kl_agg", log_prob=support.sampled_logprob(pi)[rows], old_log_prob=support.sampled_logprob(
                support.mu_logprobs)[rows], advantages=adv[rows], response_mask=mask[rows],
            mu_logprobs=support.mu_logprobs[rows], pi_logprobs=pi[rows], valid=support.valid[rows],
            sampled_index=support.sampled_index[rows], delta=0.05)
        return {**m, MASK_ADV_TOKENS: float(((mask[rows] > 0) & (adv[rows] != 0)).sum())}

    whole = metrics(slice(0, 6))
    merged = merge_micro_batches([metrics(slice(0, 1)), metrics(slice(1, 3)), metrics(slice(3, 6))])
    assert whole["actor/mask/outside_frac"] > 0 and whole["actor/pg_clipfrac"] > 0
    for name, value in whole.items():
        assert merged[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name


def test_writer_lines_merge_per_step_latest_session_wins(tmp_path) -> None:
    folder = tmp_path / LOSS_STATS_DIR
    old = LossStatsWriter(folder, "00001", rank=0)
    for step in (1, 2):
        old.begin_step(step)
        old.begin_mini_batch()
        old.write({"actor/mask/tokens": 5.0, "actor/mask/divergence_max": 0.5})
    new = [LossStatsWriter(folder, "00002", rank=r) for r in (0, 1)]  # a restart from step 1, two ranks
    for w, tokens, dmax in ((new[0], 3.0, 0.1), (new[1], 4.0, 0.7)):
        w.begin_step(2)
        for mb in range(2):
            w.begin_mini_batch()
            w.write({"actor/mask/tokens": tokens + mb, "actor/mask/divergence_max": dmax * (mb + 1)})
    out = exact_step_metrics(tmp_path)
    assert out[1] == {"actor/mask/tokens": 5.0, "actor/mask/divergence_max": 0.5}
    # step 2 from session 00002 only: per mini-batch sum over ranks, then the catalogue's reduce over mini-batches
    assert out[2] == reduce_metrics([{"actor/mask/tokens": 7.0, "actor/mask/divergence_max": 0.7},
                                     {"actor/mask/tokens": 9.0, "actor/mask/divergence_max": 1.4}])
    assert out[2]["actor/mask/tokens"] == 16.0
    assert exact_step_metrics(tmp_path / "nothing") == {}


def test_a_torn_last_line_is_left_out_and_a_bad_line_is_named(tmp_path) -> None:
    w = LossStatsWriter(tmp_path, "1", rank=0)
    w.begin_step(1)
    w.begin_mini_batch()
    w.write({"actor/mask/tokens": 2.0})
    with open(w.path, "a") as fh:
        fh.write('{"session":"1","step":1,"mini')  # killed mid-line
    assert [r["metrics"] for r in read_records(w.path)] == [{"actor/mask/tokens": 2.0}]
    with open(w.path, "a") as fh:
        fh.write("\n")
    with pytest.raises(ValueError, match=r"\.jsonl:2: not a JSON line"):
        read_records(w.path)
    bad = tmp_path / "2.rank0.jsonl"
    bad.write_text(json.dumps({"session": "2", "step": 1}) + "\n")
    with pytest.raises(ValueError, match="lacks mini_batch, rank, micro_batch, metrics"):
        read_records(bad)
    with pytest.raises(ValueError, match="weighted by actor/mask/tokens"):
        merge_records([{"session": "1", "step": 1, "mini_batch": 0, "rank": 0, "micro_batch": 0,
                        "metrics": {"actor/ppo_kl": 0.1}}])


def test_checkpoint_step_reads_verls_folder_name() -> None:
    assert checkpoint_step("/ckpt/global_step_120/actor") == 120
    with pytest.raises(ValueError, match="global_step"):
        checkpoint_step("/ckpt/actor")
