"""The study's bookkeeping: D_pre, r, A, Ddot, keep decisions and ΔD per mask against a direct recomputation.

The recomputation here shares no code with the study or with predmask: its own teacher-forced forward, the coarse
distributions and the top-K KL from the full softmax, Ddot written out from docs/math.md §3.1, the group-normalised
advantages, the masked DPPO loss, and each mask's AdamW step on its own copy of the model.
"""

from __future__ import annotations

import copy
import math

import polars as pl
import pytest
import torch
from token_level_helpers import TINY_VOCAB, perturbed, scored_batch, settings, tiny_backend

from analysis.token_level.compute.study import MASKS, StudySettings, study_batch
from analysis.token_level.summary.study_stats import seed_summary
from predmask.precisions import get_precision

V = TINY_VOCAB  # 3 specials + 6 symbols + 21 numbers = 30


def _logits(model: torch.nn.Module, batch) -> torch.Tensor:
    """Logits [B, R, V] that predict each response token (prompt left-padded, response right-padded)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    att = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    pos = (att.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()
    p = batch.prompt_ids.shape[1]
    return out[:, p - 1 : -1]


def _token(batch, probs: torch.Tensor, b: int, t: int) -> dict:
    """Support, mu, pi (float64 Python numbers) of one token; probs: full training softmax at that token."""
    k = int(batch.response_ids[b, t])
    ids = [int(i) for i in batch.topk_ids[b, t]]
    mu = {i: math.exp(float(lp)) for i, lp in zip(ids, batch.topk_logprobs[b, t])}
    mu.setdefault(k, math.exp(float(batch.sampled_logprobs[b, t])))
    pi = {i: float(probs[i]) for i in mu}
    mu_t = max(1.0 - sum(mu.values()), 1e-12)
    pi_t = max(1.0 - sum(pi.values()), 1e-12)
    q_exact = sum(float(probs[j]) ** 2 for j in range(probs.shape[0]) if j not in mu)
    return {"k": k, "mu": mu, "pi": pi, "mu_T": mu_t, "pi_T": pi_t, "q_exact": q_exact}


def _kl(x: dict) -> float:
    return sum(m * math.log(m / x["pi"][i]) for i, m in x["mu"].items()) + x["mu_T"] * math.log(
        x["mu_T"] / x["pi_T"]
    )


def _ddot(x: dict, q: float) -> float:
    k = x["k"]
    local = x["pi"][k] - x["mu"][k]
    coupling = sum(p * (x["mu"][i] - p) for i, p in x["pi"].items())
    return local + coupling - q * (1.0 - x["mu_T"] / x["pi_T"])


def _advantages(rewards: torch.Tensor, group: int) -> list[float]:
    out = []
    for g in range(0, rewards.shape[0], group):
        r = [float(v) for v in rewards[g : g + group]]
        mean = sum(r) / group
        std = math.sqrt(sum((v - mean) ** 2 for v in r) / (group - 1))
        out += [(v - mean) / (std + 1e-6) for v in r]
    return out


def _recompute(model: torch.nn.Module, batch, s: StudySettings) -> dict:
    """Every per-token quantity and each mask's ΔD, directly (staleness 0)."""
    adv = _advantages(batch.rewards, s.group_size)
    with torch.no_grad():
        probs = torch.softmax(_logits(model, batch).double(), -1)
    rows = {}
    for b, t in batch.response_mask.nonzero().tolist():
        x = _token(batch, probs[b, t], b, t)
        n_s = len(x["mu"])
        ddot = {
            "agg": _ddot(x, x["pi_T"] ** 2),
            "uniform": _ddot(x, x["pi_T"] ** 2 / (V - n_s)),
            "exact": _ddot(x, x["q_exact"]),
        }
        r = x["pi"][x["k"]] / x["mu"][x["k"]]
        rows[(b, t)] = {"x": x, "d_pre": _kl(x), "r": r, "a": adv[b], "ddot": ddot}
    keep = {}
    for name, (b, t) in ((n, bt) for n in ("ratio", "agg", "uniform", "exact") for bt in rows):
        row = rows[(b, t)]
        direction = row["r"] - 1.0 if name == "ratio" else row["ddot"][name]
        keep[(name, b, t)] = not (row["d_pre"] > s.delta and row["a"] * direction > 0)
    n_tokens = len(rows)
    dd = {}
    for name in ("ratio", "agg", "uniform", "exact", "all"):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(
            m.parameters(), lr=s.lr, betas=s.betas, eps=s.adam_eps, weight_decay=s.weight_decay
        )
        logp = torch.log_softmax(_logits(m, batch), -1)
        loss = torch.zeros(())
        for (b, t), row in rows.items():
            kept = True if name == "all" else keep[(name, b, t)]
            if kept:
                loss = loss - row["a"] * min(row["r"], s.ratio_cap) * logp[b, t, row["x"]["k"]]
        (loss / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), s.grad_clip)
        opt.step()
        with torch.no_grad():
            post = torch.softmax(_logits(m, batch).double(), -1)
        for (b, t), row in rows.items():
            x = _token(batch, post[b, t], b, t)
            dd[(name, b, t)] = _kl(x) - row["d_pre"]
    return {"rows": rows, "keep": keep, "dd": dd}


@pytest.mark.parametrize("path", ["direct", "split"])
def test_dd_bookkeeping_matches_direct_recomputation(path: str) -> None:
    backend = tiny_backend(precision="bf16", top_k=5, max_new_tokens=4)
    batch = scored_batch(backend, seed=2, sequences=8, group=4)  # a case with 4 direction disagreements
    s = settings(
        delta=0.05,
        group_size=4,
        vocab_size=V,
        staleness=0,
        lr=0.01,
        update_path=path,
        precision=get_precision("bf16"),
    )
    model = perturbed(backend.policy(), 0.5, seed=1)  # pi_pre far from mu without stale steps
    truth = _recompute(copy.deepcopy(model), batch, s)
    out = study_batch(model, batch, s)
    assert out.n_tokens == len(truth["rows"])
    studied = {(b, t) for (b, t), row in truth["rows"].items() if row["d_pre"] > s.delta}
    assert 0 < len(studied) < len(truth["rows"]), (
        "the case must have tokens inside and outside the trust region"
    )
    assert {(r["sequence"], r["position"]) for r in out.tokens.iter_rows(named=True)} == studied
    disagree = 0
    for r in out.tokens.iter_rows(named=True):
        key = (r["sequence"], r["position"])
        row = truth["rows"][key]
        assert r["d_pre"] == pytest.approx(row["d_pre"], rel=1e-4, abs=1e-6)
        assert r["r"] == pytest.approx(row["r"], rel=1e-4)
        assert r["a"] == pytest.approx(row["a"], rel=1e-5, abs=1e-6)
        for tail, col in (("agg", "ddot_agg"), ("uniform", "ddot_uniform"), ("exact", "ddot_exact")):
            assert r[col] == pytest.approx(row["ddot"][tail], rel=1e-3, abs=1e-6)
        for name, col in (
            ("ratio", "keep_ratio"),
            ("agg", "keep_pred_agg"),
            ("uniform", "keep_pred_uniform"),
            ("exact", "keep_pred_exact"),
        ):
            assert r[col] == truth["keep"][(name, *key)]
        disagree += r["keep_ratio"] != r["keep_pred_agg"]
        for name, col in (
            ("ratio", "dd_ratio"),
            ("agg", "dd_pred_agg"),
            ("uniform", "dd_pred_uniform"),
            ("exact", "dd_pred_exact"),
            ("all", "dd_all"),
        ):
            assert r[col] == pytest.approx(truth["dd"][(name, *key)], rel=2e-3, abs=2e-5), (col, key)
    assert disagree > 0, "the case must contain a disagreement token"


def test_split_and_micro_batched_paths_equal_direct() -> None:
    backend = tiny_backend(precision="bf16")
    batch = scored_batch(backend, seed=5, sequences=32, group=4)
    base = {"delta": 0.01, "group_size": 4, "vocab_size": V, "staleness": 2, "minibatches": 2, "lr": 0.02}
    frames = {}
    for name, extra in (
        ("direct", {"update_path": "direct"}),
        ("split", {"update_path": "split"}),
        ("split_mb", {"update_path": "split", "micro_batch": 5}),
        ("direct_mb", {"update_path": "direct", "micro_batch": 7}),
    ):
        frames[name] = study_batch(backend.policy(), batch, settings(**base, **extra)).tokens
    ref = frames["direct"]
    assert ref.height > 0
    for name, f in frames.items():
        assert f.select("sequence", "position").equals(ref.select("sequence", "position")), name
        for col in ("keep_ratio", "keep_pred_agg", "keep_pred_uniform", "keep_pred_exact"):
            assert f[col].equals(ref[col]), (name, col)
        for col in (
            "d_pre",
            "r",
            "ddot_agg",
            "ddot_exact",
            "dd_ratio",
            "dd_pred_agg",
            "dd_pred_exact",
            "dd_all",
        ):
            assert (f[col] - ref[col]).abs().max() < 1e-4, (name, col)


def test_split_path_falls_back_to_direct_when_a_sub_batch_decides_otherwise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sub-batch forward can flip a keep decision that sits at rounding level of zero (seen on some CPUs for the
    exact tail); the seed is then taken on the direct path, whose rows equal a direct run's, with a warning."""
    from analysis.token_level.compute import study

    backend = tiny_backend(precision="bf16")
    batch = scored_batch(backend, seed=5, sequences=32, group=4)
    base = {"delta": 0.01, "group_size": 4, "vocab_size": V, "staleness": 2, "minibatches": 2, "lr": 0.02}
    ref = study_batch(backend.policy(), batch, settings(**base, update_path="direct")).tokens
    real = study.accumulate_gradient

    def flips_on_sub_batches(*args, **kwargs):
        lp, dropped = real(*args, **kwargs)
        return lp, dropped + (1 if kwargs.get("tokens") is not None else 0)

    monkeypatch.setattr(study, "accumulate_gradient", flips_on_sub_batches)
    with caplog.at_level("WARNING", logger=study.__name__):
        got = study_batch(backend.policy(), batch, settings(**base, update_path="split")).tokens
    assert any("direct path" in r.getMessage() for r in caplog.records)
    assert ref.height > 0 and got.columns == ref.columns
    for col in ref.columns:
        assert got[col].equals(ref[col]), col


def test_different_masks_make_different_updates() -> None:
    """Where the keep sets differ the parameter updates differ; where they coincide the updates are identical."""
    from analysis.token_level.compute.study import _snapshot, make_optimizer, masked_update, token_quantities
    from predmask.rl.algo import grpo_advantages, support_logprobs, token_advantages

    backend = tiny_backend(precision="bf16")
    batch = scored_batch(backend, seed=7, sequences=32, group=4)
    s = settings(delta=0.05, group_size=4, vocab_size=V, staleness=0, lr=0.02, update_path="direct")
    model = perturbed(backend.policy(), 0.5, seed=1)
    support = batch.support()
    adv = token_advantages(grpo_advantages(batch.rewards, 4), batch.response_mask)
    with torch.no_grad():
        lp = support_logprobs(model, batch, support)
    q = token_quantities(batch, support, lp, adv, s)
    snap = _snapshot(model, make_optimizer(model, s))
    params = {}
    for name, method in MASKS.items():
        model.load_state_dict(snap[0])
        opt = make_optimizer(model, s)
        masked_update(model, opt, batch, support, adv, method, s)
        params[name] = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    keeps = {
        "ratio": q["keep_ratio"],
        "pred_agg": q["keep_pred_agg"],
        "pred_uniform": q["keep_pred_uniform"],
        "pred_exact": q["keep_pred_exact"],
    }
    assert not torch.equal(keeps["ratio"], keeps["pred_agg"]), "the case needs a disagreement"
    for a in MASKS:
        for b in MASKS:
            same_keep = torch.equal(keeps[a], keeps[b])
            same_update = torch.equal(params[a], params[b])
            assert same_keep == same_update, (a, b)


def test_same_seed_same_rows_and_other_seed_other_rows() -> None:
    s = settings(delta=0.01, group_size=4, vocab_size=V, staleness=2, minibatches=2, lr=0.02)

    def once(seed: int) -> pl.DataFrame:
        backend = tiny_backend(precision="bf16")
        return study_batch(
            backend.policy(), scored_batch(backend, seed=seed, sequences=16, group=4), s
        ).tokens

    first, again, other = once(11), once(11), once(12)
    assert first.height > 0
    assert first.equals(again)
    assert not (first.height == other.height and first.equals(other))


def test_seed_summary_counts_by_hand() -> None:
    t = pl.DataFrame(
        {
            "keep_ratio": [True, False, True, False, True],
            "keep_pred_agg": [False, True, True, False, False],
            "keep_pred_uniform": [True, True, True, False, False],
            "keep_pred_exact": [False, False, True, False, True],
            "dd_ratio": [0.1, -0.2, 0.3, 0.0, -0.1],
            "dd_pred_agg": [0.2, -0.1, 0.0, 0.1, 0.5],
            "dd_pred_uniform": [0.0, 0.4, 0.0, 0.0, 0.0],
            "dd_pred_exact": [0.0, 0.3, 0.0, 0.0, 0.0],
        }
    )
    row = seed_summary(t, n_tokens=100)
    # agg disagreement set: rows 0, 1, 4. ratio keeps 0 (dd +0.1) and 4 (dd -0.1); predictive keeps 1 (dd -0.1)
    assert (row["n_outside"], row["n_disagree"]) == (5, 3)
    assert (row["n_keep_ratio"], row["n_unsafe_ratio"], row["n_corrective_ratio"]) == (2, 1, 1)
    assert (row["n_keep_predictive"], row["n_unsafe_predictive"], row["n_corrective_predictive"]) == (1, 0, 1)
    assert row["unsafe_keep_ratio"] == 0.5 and row["unsafe_keep_predictive"] == 0.0
    # uniform disagreement: rows 1 (pred keeps, dd +0.4), 4 (ratio keeps)
    assert (
        row["n_disagree_uniform"],
        row["n_keep_predictive_uniform"],
        row["n_unsafe_predictive_uniform"],
    ) == (2, 1, 1)
    # exact disagreement: row 0 only, which exact drops -> no kept token, rate undefined
    assert (row["n_disagree_exact"], row["n_keep_predictive_exact"]) == (1, 0)
    assert row["unsafe_keep_predictive_exact"] is None


def test_fp8_training_takes_each_step_on_its_own() -> None:
    """FP8 training scales activations per tensor, so a row's logits depend on the rows beside it: the shared-work
    path would be inexact; auto picks the direct path, and asking for split is refused."""
    backend = tiny_backend(precision="fp8_e2e")
    batch = scored_batch(backend, seed=2, sequences=16, group=4)
    fp8 = get_precision("fp8_e2e")
    s = settings(delta=0.01, group_size=4, vocab_size=V, staleness=2, minibatches=2, lr=0.05, precision=fp8)
    assert s.update_path_resolved == "direct"
    assert study_batch(backend.policy(), batch, s).tokens.height > 0
    with pytest.raises(ValueError, match="update_path=split"):
        settings(precision=fp8, update_path="split")
