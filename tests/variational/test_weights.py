"""The trace weights and the weighted SFT loss of math.md §8 (predmask.vr_weights) against independent computations.

The reference never calls predmask.vr_weights: per-token log-probabilities come from a token-by-token loop of full
forwards of a tiny Qwen3 (one forward per prefix, softmax then log of the next token's probability), the weights are
formed in probability space with Python floats and divided by their sum, and the gradient of the weighted loss is
checked against the weighted sum of per-trace gradients, each from its own unpadded forward and backward.
Everything runs in float64. No mocks.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import predmask.vr_weights as vr
from predmask.rl.model import build_policy

EXAMPLES = settings(max_examples=40, deadline=None)
VOCAB = 13
TINY = {"name": "tiny", "backend": "cpu", "arch": "qwen3", "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1.0e-6, "max_position_embeddings": 32}

# Two questions, two traces each: (prompt x, hint segment y′ in the posterior's prompt, trace z, answer y′).
# The second trace of question 0 is empty (|z| = 0).
QUESTIONS = [([3, 4, 5], [9, 6]), ([7, 3], [9, 8])]
TRACES = [(0, [10, 11, 4]), (0, []), (1, [5, 5, 12, 10]), (1, [11])]
ANSWERS = {0: [6, 2], 1: [8, 8, 2]}  # 2 = <eos>


pytestmark = pytest.mark.usefixtures("float64_default")  # tests/conftest.py: float64, then restored


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """π_θ0 and q_φ: two differently seeded tiny Qwen3s in float64, eval mode."""
    prior = build_policy(TINY, VOCAB, seed=0).double().eval()
    posterior = build_policy(TINY, VOCAB, seed=1).double().eval()
    return prior, posterior


# ----------------------------------------------------------------------------------------------- the reference
def loop_token_probs(model: torch.nn.Module, context: list[int], target: list[int]) -> list[float]:
    """p(target_t | context, target_<t) for each t: one full forward per prefix, softmax of the last logits."""
    out = []
    with torch.no_grad():
        for t, token in enumerate(target):
            prefix = torch.tensor([context + target[:t]])
            logits = model(input_ids=prefix).logits[0, -1]
            out.append(float(torch.softmax(logits, -1)[token]))
    return out


@pytest.fixture(scope="module")
def reference(models) -> dict[str, list[list[float]]]:
    """Per trace, from the token loop: π_θ0's probs of z given x, q_φ's given x + hint, π_θ0's of y′ given x + z."""
    prior, posterior = models
    return {
        "prior": [loop_token_probs(prior, QUESTIONS[q][0], z) for q, z in TRACES],
        "posterior": [loop_token_probs(posterior, QUESTIONS[q][0] + QUESTIONS[q][1], z) for q, z in TRACES],
        "answer": [loop_token_probs(prior, QUESTIONS[q][0] + z, ANSWERS[q]) for q, z in TRACES],
    }


def reference_ratio(reference: dict[str, list[list[float]]]) -> list[float]:
    """The per-token geometric mean of p/q per trace, from the probabilities themselves (1 for an empty trace)."""
    return [math.prod(a / b for a, b in zip(p, r)) ** (1 / len(p)) if p else 1.0
            for p, r in zip(reference["prior"], reference["posterior"])]


# ----------------------------------------------------------------------------------------------- batched inputs
def batched_token_logp(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    """One right-padded forward of context + target rows: (token log-probs [B, T-1], mask of the target tokens)."""
    seqs = [c + t for c, t in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for b, (c, t) in enumerate(rows):
        ids[b, : len(c) + len(t)] = torch.tensor(c + t)
        mask[b, len(c) - 1 : len(c) - 1 + len(t)] = True
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return logp, mask


def trace_rows(hint: bool) -> list[tuple[list[int], list[int]]]:
    rows = []
    for q, z in TRACES:
        x, h = QUESTIONS[q]
        rows.append((x + h if hint else x, z))
    return rows


# ----------------------------------------------------------------------------------------------- the tests
def test_sequence_logprob_and_trace_log_ratio_match_the_token_loop(models, reference) -> None:
    prior, posterior = models
    with torch.no_grad():
        lp_tok, mask = batched_token_logp(prior, trace_rows(hint=False))
        lq_tok, mask_q = batched_token_logp(posterior, trace_rows(hint=True))
    lp_tok = lp_tok.masked_fill(~mask, float("nan"))  # padding must not leak in
    log_prior = vr.sequence_logprob(lp_tok, mask)
    log_posterior = vr.sequence_logprob(lq_tok, mask_q)
    ref_prior = [sum(math.log(p) for p in probs) for probs in reference["prior"]]
    ref_post = [sum(math.log(p) for p in probs) for probs in reference["posterior"]]
    torch.testing.assert_close(log_prior, torch.tensor(ref_prior), rtol=0, atol=1e-10)
    torch.testing.assert_close(log_posterior, torch.tensor(ref_post), rtol=0, atol=1e-10)

    lengths = torch.tensor([len(z) for _, z in TRACES])
    ratio = vr.trace_log_ratio(log_prior, log_posterior, lengths)
    ref_ratio = [math.log(r) for r in reference_ratio(reference)]
    torch.testing.assert_close(ratio, torch.tensor(ref_ratio), rtol=0, atol=1e-10)
    assert ratio[1] == 0.0


def test_every_estimator_and_the_weights_match_probability_space(models, reference) -> None:
    prior, posterior = models
    with torch.no_grad():
        lp_tok, mask = batched_token_logp(prior, trace_rows(hint=False))
        lq_tok, mask_q = batched_token_logp(posterior, trace_rows(hint=True))
        ans_rows = [(QUESTIONS[q][0] + z, ANSWERS[q]) for q, z in TRACES]
        la_tok, mask_a = batched_token_logp(prior, ans_rows)
    answer_logp = vr.sequence_logprob(la_tok, mask_a)
    answer_tokens = torch.tensor([len(ANSWERS[q]) for q, _ in TRACES])
    lengths = torch.tensor([len(z) for _, z in TRACES])
    ratio = vr.trace_log_ratio(vr.sequence_logprob(lp_tok, mask), vr.sequence_logprob(lq_tok, mask_q), lengths)
    # M = 5 answers sampled from π_θ0(· | x, z) (first answer token), correct when it is the hint's token
    gen = torch.Generator().manual_seed(0)
    correct = torch.zeros(len(TRACES), 5, dtype=torch.bool)
    for i, (q, z) in enumerate(TRACES):
        with torch.no_grad():
            probs = torch.softmax(prior(input_ids=torch.tensor([QUESTIONS[q][0] + z])).logits[0, -1], -1)
        correct[i] = torch.multinomial(probs, 5, replacement=True, generator=gen) == ANSWERS[q][0]
    correct[0] = False  # a trace with no correct answer: acc weight 0

    answer_probs = reference["answer"]
    ref_p = {
        "likelihood": [math.prod(p) for p in answer_probs],
        "gml": [math.prod(p) ** (1 / len(p)) for p in answer_probs],
        "acc": [sum(bool(c) for c in row) / 5 for row in correct.tolist()],
    }
    ref_ratio = reference_ratio(reference)
    group = torch.tensor([q for q, _ in TRACES])
    assert set(vr.ESTIMATORS) == {"acc", "gml", "likelihood"}
    for name in vr.ESTIMATORS:
        log_p = vr.log_correct_estimate(name, answer_logp=answer_logp, answer_tokens=answer_tokens, correct=correct)
        expected = [math.log(p) if p > 0 else float("-inf") for p in ref_p[name]]
        torch.testing.assert_close(log_p, torch.tensor(expected), rtol=0, atol=1e-10)
        weights = vr.normalise_weights(vr.trace_log_weights(ratio, log_p), group)
        raw = [r * p for r, p in zip(ref_ratio, ref_p[name])]
        totals = {q: sum(w for (qq, _), w in zip(TRACES, raw) if qq == q) for q, _ in TRACES}
        ref_w = [w / totals[q] if totals[q] > 0 else 0.0 for (q, _), w in zip(TRACES, raw)]
        torch.testing.assert_close(weights, torch.tensor(ref_w), rtol=1e-9, atol=1e-12)
        best = vr.best_trace(weights, group)
        ref_best = [max((i for i, (qq, _) in enumerate(TRACES) if qq == q), key=lambda i: (ref_w[i], -i))
                    for q in (0, 1)]
        assert best.tolist() == ref_best


def assert_grad_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within float32 rounding of the gradient's scale: transformers' Qwen3RMSNorm computes in float32 even in a
    float64 model, so a sum of gradients differs from the gradient of a sum by ~1e-7 relative (a wrong weight would
    differ by O(1))."""
    scale = float(want.abs().max()) + 1e-30
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def test_weighted_sft_loss_gradient_is_the_weighted_sum_of_per_trace_gradients(models) -> None:
    model = build_policy(TINY, VOCAB, seed=2).double().eval()
    rows = [(QUESTIONS[q][0], z + ANSWERS[q]) for q, z in TRACES]
    weights = torch.tensor([0.7, 0.3, 0.25, 0.75])
    normaliser = 6.0
    params = [p for p in model.parameters() if p.requires_grad]

    logp, mask = batched_token_logp(model, rows)
    loss = vr.weighted_sft_loss(logp, mask, weights, normaliser)
    grads = torch.autograd.grad(loss, params)

    expected = [torch.zeros_like(p) for p in params]
    ref_loss = 0.0
    for w, (c, t) in zip(weights.tolist(), rows):
        seq = torch.tensor([c + t])
        lp = torch.log_softmax(model(input_ids=seq).logits[0, len(c) - 1 : -1], -1)
        one = -lp.gather(-1, torch.tensor(t)[:, None]).sum() / normaliser
        ref_loss += w * float(one.detach())
        for acc, g in zip(expected, torch.autograd.grad(one, params)):
            acc.add_(w * g)
    assert float(loss.detach()) == pytest.approx(ref_loss, rel=1e-12)
    for g, e in zip(grads, expected):
        assert_grad_close(g, e)
    # a zero weight removes a trace's gradient entirely
    logp, mask = batched_token_logp(model, rows)
    zero = vr.weighted_sft_loss(logp, mask, torch.tensor([0.0, 0.0, 0.0, 1.0]), normaliser)
    last = torch.autograd.grad(zero, params)
    seq = torch.tensor([rows[3][0] + rows[3][1]])
    lp = torch.log_softmax(model(input_ids=seq).logits[0, len(rows[3][0]) - 1 : -1], -1)
    alone = torch.autograd.grad(-lp.gather(-1, torch.tensor(rows[3][1])[:, None]).sum() / normaliser, params)
    for g, e in zip(last, alone):
        assert_grad_close(g, e)


@st.composite
def extreme_groups(draw):
    """Up to 5 questions of 1..6 traces: log ratios in ±1e4 (as summed log-probs over lengths 0..1000)."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    group = [g for g, s in enumerate(sizes) for _ in range(s)]
    n = len(group)
    big = st.floats(-1e4, 1e4, allow_nan=False)
    log_prior = draw(st.lists(big, min_size=n, max_size=n))
    log_post = draw(st.lists(big, min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    hits = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    answer_logp = draw(st.lists(st.floats(-1e4, 0.0, allow_nan=False), min_size=n, max_size=n))
    answer_tokens = draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    return group, log_prior, log_post, lengths, hits, answer_logp, answer_tokens


@EXAMPLES
@given(extreme_groups())
def test_weights_are_finite_and_sum_to_one_per_group_under_extreme_ratios(case) -> None:
    group, log_prior, log_post, lengths, hits, answer_logp, answer_tokens = case
    group_t = torch.tensor(group)
    ratio = vr.trace_log_ratio(torch.tensor(log_prior), torch.tensor(log_post), torch.tensor(lengths))
    assert bool(torch.isfinite(ratio).all())
    correct = torch.tensor([[j < h for j in range(4)] for h in hits])
    for name in vr.ESTIMATORS:
        log_p = vr.log_correct_estimate(name, answer_logp=torch.tensor(answer_logp),
                                        answer_tokens=torch.tensor(answer_tokens), correct=correct)
        log_w = vr.trace_log_weights(ratio, log_p)
        w = vr.normalise_weights(log_w, group_t)
        assert bool(torch.isfinite(w).all()) and bool((w >= 0).all()) and bool((w <= 1).all())
        for g in set(group):
            sel = group_t == g
            if bool(torch.isfinite(log_w[sel]).any()):
                assert float(w[sel].sum()) == pytest.approx(1.0, abs=1e-12)
                torch.testing.assert_close(w[sel], torch.softmax(log_w[sel], 0), rtol=1e-9, atol=1e-300)
            else:  # acc: no trace of the question has a correct answer
                assert name == "acc" and bool((w[sel] == 0).all())


def test_an_all_zero_accuracy_group_gets_zero_weights_and_others_are_untouched() -> None:
    correct = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1]])
    log_p = vr.log_correct_estimate("acc", correct=correct)
    assert log_p[:2].tolist() == [float("-inf")] * 2
    log_w = vr.trace_log_weights(torch.tensor([5e3, -5e3, 1e4, -1e4]), log_p)
    w = vr.normalise_weights(log_w, torch.tensor([7, 7, 3, 3]))
    assert w[:2].tolist() == [0.0, 0.0]
    assert w[2:].tolist() == pytest.approx([1.0, 0.0])
    assert vr.best_trace(w, torch.tensor([7, 7, 3, 3])).tolist() == [2, 0]  # groups ascending: 3, then 7


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: vr.get_estimator("naive"), ["'naive'", "acc", "gml", "likelihood"]),
        (lambda: vr.log_correct_estimate("bogus", correct=torch.ones(2, 2)), ["'bogus'", "acc"]),
        (lambda: vr.check_counts(0, 8), ["K", "0", ">= 1"]),
        (lambda: vr.check_counts(8, 0), ["M", "0", ">= 1"]),
        (lambda: vr.check_counts(True, 8), ["True", ">= 1"]),
        (lambda: vr.log_correct_estimate("acc", correct=torch.ones(3, 0)), ["M", "0", ">= 1"]),
        (lambda: vr.log_correct_estimate("gml", answer_logp=torch.zeros(2)), ["answer_tokens"]),
        (lambda: vr.log_correct_estimate("gml", answer_logp=torch.zeros(2), answer_tokens=torch.tensor([1, 0])),
         ["answer_tokens", "0", ">= 1"]),
        (lambda: vr.trace_log_ratio(torch.zeros(2), torch.zeros(2), torch.tensor([3, -1])), ["trace_tokens", "-1"]),
        (lambda: vr.weighted_sft_loss(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1), 0.0), ["normaliser", "0.0"]),
        (lambda: vr.normalise_weights(torch.tensor([float("nan")]), torch.tensor([0])), ["NaN"]),
    ],
)
def test_bad_input_is_one_line_naming_the_value(call, names) -> None:
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    for name in names:
        assert name in message
