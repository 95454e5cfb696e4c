"""The traces stage's hint check (predmask.rl.vr_runner.hint_use): stub samplers whose behaviour is known by
construction (they copy the hint, ignore it, or answer correctly on a fixed share) give the rates worked out by hand;
the ``hint.use=false`` ablation end to end at test size (q_phi trained and sampled on the question alone, its trace
log-probs those of a plain full forward on the bare question)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pytest
import torch
from vr_stage_helpers import stage_config, write_stage

from predmask import metrics as M
from predmask.rl.model import build_policy
from predmask.rl.task import Problem, extract_answer, make_split
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.rl.vr_questions import original_data, split_trace
from predmask.rl.vr_runner import MODEL_FILE, TRACES_FILE, hint_use, hint_use_line, posterior_rows, run_stage
from predmask.rl.weighted_sft import Row
from predmask.rundir import read_metrics
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.variational_schema import HintConfig, PosteriorConfig

TASK = TaskConfig()
TOK = ArithmeticTokenizer(TASK.max_number)
#: two ordinary problems and one whose answer + 3 leaves [0, 255], so its decoy is the answer - 3
PROBLEMS = [*make_split(TASK, "train", 2), Problem((250, 4), ("+",), (254,), TASK.slots)]
K = 4


def _respond(value: int) -> list[int]:
    return TOK.encode(f"{value} \\boxed{{{value}}}", eos=True)


def _question(prompt: str) -> Problem:
    """The problem whose question a (hinted or plain) prompt holds."""
    return next(p for p in PROBLEMS if prompt.endswith(p.prompt))


def copies_hint(prompts: Sequence[str], salt: int) -> list[list[int]]:
    """A posterior that writes its hint as the trace's last step and the answer."""
    return [_respond(extract_answer(p)) for p in prompts]


def ignores_hint(prompts: Sequence[str], salt: int) -> list[list[int]]:
    """A posterior that solves the question whatever the hint says."""
    return [_respond(_question(p).answer) for p in prompts]


def half_right(prompts: Sequence[str], salt: int) -> list[list[int]]:
    """A prior correct on every second sample and one off on the others."""
    return [_respond(_question(p).answer + i % 2) for i, p in enumerate(prompts)]


def test_hint_check_rates_match_the_hand_worked_cases() -> None:
    hint = HintConfig()
    seen: list[str] = []

    def recording(prompts: Sequence[str], salt: int) -> list[list[int]]:
        seen.extend(prompts)
        return copies_hint(prompts, salt)

    rates = hint_use(TOK, hint, PROBLEMS, K, TASK.max_number, posterior=recording, prior=half_right)
    assert rates == {M.VR_PRIOR_CORRECT: 0.5, M.VR_DECOY_HIT: 1.0, M.VR_DECOY_CORRECT: 0.0}
    decoys = [extract_answer(p) for p in seen]
    assert decoys == [PROBLEMS[0].answer + 3, PROBLEMS[1].answer + 3, 251]  # 254 + 3 > 255: 254 - 3
    assert seen == [f"\\boxed{{{d}}} {p.prompt}" for d, p in zip(decoys, PROBLEMS)]
    rates = hint_use(TOK, hint, PROBLEMS, K, TASK.max_number, posterior=ignores_hint, prior=ignores_hint)
    assert rates == {M.VR_PRIOR_CORRECT: 1.0, M.VR_DECOY_HIT: 0.0, M.VR_DECOY_CORRECT: 1.0}


def test_without_hint_conditioning_the_decoy_never_reaches_the_prompt() -> None:
    """hint.use=false: q_phi's prompt is the bare question, so even a hint-copying posterior cannot follow a decoy."""
    off = HintConfig(use=False)
    assert off.prompt(PROBLEMS[0].prompt, 7) == PROBLEMS[0].prompt
    assert HintConfig().prompt(PROBLEMS[0].prompt, 7) == f"\\boxed{{7}} {PROBLEMS[0].prompt}"

    def answer_or_zero(prompts: Sequence[str], salt: int) -> list[list[int]]:
        return [_respond(extract_answer(p) or 0) for p in prompts]

    rates = hint_use(TOK, off, PROBLEMS, K, TASK.max_number, posterior=answer_or_zero, prior=ignores_hint)
    assert rates[M.VR_DECOY_HIT] == 0.0


def test_the_summary_line_is_percentages_and_the_ratio() -> None:
    data = {M.VR_POSTERIOR_CORRECT: 0.8, M.VR_PRIOR_CORRECT: 0.4, M.VR_DECOY_HIT: 0.35}
    assert hint_use_line(data) == ("hint use: q_φ reaches the hinted answer in 80.0% (π_θ0 40.0%, ratio 2.00×); "
                                   "follows a decoy hint in 35.0%")
    assert "ratio inf×" in hint_use_line({**data, M.VR_PRIOR_CORRECT: 0.0})


@pytest.mark.parametrize(("section", "values", "message"), [
    (HintConfig, {"use": "yes"}, "hint.use = 'yes' is not allowed; allowed: true, false"),
    (PosteriorConfig, {"source": "web"}, "posterior.source = 'web' is not allowed; allowed: original, prior, original+prior"),
    (PosteriorConfig, {"samples": 0}, "posterior.samples = 0 is not allowed"),
])
def test_bad_hint_and_posterior_settings_are_one_line(section: type, values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        section.from_mapping(values)
    assert "\n" not in str(err.value)


def test_posterior_rows_are_the_originals_and_pi_theta0s_worked_samples_hinted_with_their_own_answer() -> None:
    """posterior.source: pi_theta0's samples (stubbed, two per question) enter with their own final answer as the hint
    and weight 1/samples; a response without a step before the box, or without an answer in its box, is dropped;
    original+prior adds the original solutions (weight 1); none left: one line naming the setting."""
    canned = ["3 , 9 \\boxed{9}", "\\boxed{4}", "5 , 6", "7 \\boxed{}"]
    seen: list[tuple[str, int]] = []

    def prior(prompts: Sequence[str], salt: int) -> list[list[int]]:
        seen.extend((p, salt) for p in prompts)
        return [TOK.encode(canned[i % len(canned)], eos=True) for i in range(len(prompts))]

    qs, hint = original_data(TASK, 2, 0.1, 0), HintConfig()
    rows = posterior_rows(TOK, hint, PosteriorConfig(source="original+prior", samples=2), qs, TASK.max_number,
                          prior=prior)
    prompts = [p for p, _ in seen]
    assert prompts == [qs[0].problem.prompt] * 2 + [qs[1].problem.prompt] * 2  # the bare question, `samples` times
    originals = [Row(q.index, f"\\boxed{{{q.original_answer}}} {q.problem.prompt}", q.solution, 1.0) for q in qs]
    assert rows == [*originals, Row(0, f"\\boxed{{9}} {qs[0].problem.prompt}", "3 , 9 \\boxed{9}", 0.5)]
    only_prior = PosteriorConfig(source="prior", samples=2)
    assert posterior_rows(TOK, hint, only_prior, qs, TASK.max_number, prior=prior) == rows[-1:]
    assert posterior_rows(TOK, hint, PosteriorConfig(), qs, TASK.max_number, prior=prior) == originals
    assert len(seen) == 8  # source=original draws nothing
    canned[0] = "\\boxed{9}"
    with pytest.raises(ValueError, match=re.escape("posterior.source = 'prior': none of pi_theta0's 4 samples is a "
                                                   "worked response")) as err:
        posterior_rows(TOK, hint, only_prior, qs, TASK.max_number, prior=prior)
    assert "\n" not in str(err.value)


def test_hint_use_false_trains_and_samples_q_phi_on_the_bare_question(tmp_path: Path) -> None:
    """Posterior and traces stages at test size with hint.use=false (q_phi fitted to the originals and pi_theta0's own
    samples): every trace's log q_phi(z|x) is the log-prob of a plain full forward of q_phi on the bare question."""
    torch.set_num_threads(1)
    cache, extra = tmp_path / "cache", ("hint.use=false", "posterior.source=original+prior",
                                            "posterior.samples=2")
    run_stage(write_stage(tmp_path, "posterior", stage_config(cache, "posterior", "posterior", {}, *extra)))
    c = stage_config(cache, "traces", "traces", {"posterior": "posterior"}, *extra)
    run_stage(write_stage(tmp_path, "traces", c))
    frame = pd.read_parquet(tmp_path / "traces" / TRACES_FILE)
    tok = ArithmeticTokenizer(TaskConfig.from_mapping(c["task"]).max_number)
    model = build_policy(c["model"], tok.vocab_size, int(c["base"]["seed"]))
    model.load_state_dict(torch.load(tmp_path / "posterior" / MODEL_FILE, weights_only=True)["state_dict"])
    model.eval()
    for row in frame.head(6).itertuples():
        p = tok.encode(row.prompt, bos=True)
        z = split_trace(tok, tok.encode(f"{row.trace_text} {row.answer_text}".strip()))[0]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + z])).logits[0].double(), -1)
        expected = float(sum(logp[len(p) - 1 + t, z[t]] for t in range(len(z))))
        assert row.log_posterior == pytest.approx(expected, abs=1e-4)
    data = read_metrics(tmp_path / "traces" / "metrics.jsonl")[-1]["data"]
    assert {M.VR_PRIOR_CORRECT, M.VR_POSTERIOR_CORRECT, M.VR_DECOY_HIT} <= set(data)
    assert all(0.0 <= data[k] <= 1.0 for k in (M.VR_PRIOR_CORRECT, M.VR_POSTERIOR_CORRECT, M.VR_DECOY_HIT))
    log_text = (tmp_path / "traces" / "train.log").read_text()
    assert hint_use_line(data) in log_text
