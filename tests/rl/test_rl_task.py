"""The arithmetic task, its splits, the reward's answer extraction and the tokenizer (predmask.rl.task/tokenizer)."""

from __future__ import annotations

import random

import pytest

from predmask.rl.task import (
    EVAL_SPLITS,
    extract_answer,
    format_solution,
    guess_solution,
    iter_train_prompts,
    make_split,
    noisy_steps,
    reward,
)
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.schemas.task_schema import TaskConfig


def _python_value(prompt: str) -> int:
    """Independent truth: evaluate the prompt left to right with Python integers."""
    toks = [t for t in prompt.rstrip("=").split() if t != "_"]
    acc = int(toks[0])
    for op, n in zip(toks[1::2], toks[2::2]):
        acc = acc + int(n) if op == "+" else acc - int(n)
    return acc


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("49 , 44 \\boxed{44}", 44),
        ("\\boxed{ 7 }", 7),
        ("\\boxed {12}", 12),
        ("\\boxed{-3}", -3),
        ("\\boxed{ - 3 }", -3),
        ("\\boxed{+5}", 5),
        ("\\boxed{1,234}", 1234),
        ("first \\boxed{1} then \\boxed{2}", 2),          # the last box counts
        ("\\boxed{5 \\boxed{7}", 7),                       # an unclosed earlier box does not hide a closed last one
        ("the answer is \\boxed{{8}}", None),              # nested braces: not an integer
        ("\\boxed{}", None),
        ("\\boxed{3.5}", None),
        ("\\boxed{x}", None),
        ("\\boxed{12", None),                              # unclosed
        ("12", None),                                      # no box
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: int | None) -> None:
    assert extract_answer(text) == expected


def test_reward_is_one_only_for_the_right_answer() -> None:
    assert reward("3 , 9 \\boxed{9}", 9) == 1.0
    assert reward("3 , 9 \\boxed{8}", 9) == 0.0
    assert reward("3 , 9", 9) == 0.0
    assert reward("\\boxed{09}", 9) == 1.0


def test_problems_are_correct_and_in_range() -> None:
    cfg = TaskConfig()
    probs = make_split(cfg, "train", 300) + make_split(cfg, "aime24_standin") + make_split(cfg, "aime25_standin")
    for p in probs:
        assert p.answer == _python_value(p.prompt)
        assert all(0 <= s <= cfg.max_number for s in p.steps)
        assert reward(p.solution, p.answer) == 1.0
        assert len(p.steps) == len(p.ops)


def test_split_shapes_and_determinism() -> None:
    cfg = TaskConfig()
    # every prompt is the same fixed form: 5 operation slots, unused ones blank
    prompts = [p.prompt for p in make_split(cfg, "train", 50)]
    assert {len(p.split()) for p in prompts} == {2 * cfg.slots + 2}
    one = next(p for p in make_split(cfg, "train", 50) if len(p.ops) == 1)
    assert one.prompt.endswith(" _ _" * (cfg.slots - 1) + " =")
    assert make_split(TaskConfig(slots=0), "aime24_standin")[0].prompt.count("_") == 0
    a24, a25 = (make_split(cfg, s) for s in EVAL_SPLITS)
    assert len(a24) == len(a25) == cfg.eval_size
    assert {len(p.ops) for p in a24} == {cfg.eval_ops[0]}
    assert {len(p.ops) for p in a25} == {cfg.eval_ops[1]}
    assert make_split(cfg, "aime24_standin") == a24
    train_ops = {len(p.ops) for p in make_split(cfg, "train", 400)}
    assert train_ops == set(range(cfg.train_ops[0], cfg.train_ops[1] + 1))
    assert make_split(TaskConfig(seed=1), "aime24_standin") != a24


def test_heldout_problems_never_in_train_streams() -> None:
    cfg = TaskConfig(eval_ops=(1, 2), eval_size=40)  # short problems: collisions with train would be frequent
    held = set(make_split(cfg, "aime24_standin")) | set(make_split(cfg, "aime25_standin"))
    for split in ("train", "pretrain"):
        it = iter_train_prompts(cfg, split=split)
        stream = [next(it) for _ in range(3000)]
        assert not held & set(stream)


def test_stream_start_is_the_data_position() -> None:
    cfg = TaskConfig()
    it = iter_train_prompts(cfg)
    first = [next(it) for _ in range(50)]
    resumed = iter_train_prompts(cfg, start=20)
    assert [next(resumed) for _ in range(30)] == first[20:]


def test_noisy_and_guess_solutions() -> None:
    cfg = TaskConfig()
    rng = random.Random(0)
    probs = make_split(cfg, "train", 500)
    clean = [noisy_steps(p, rng, 0.0, cfg.max_number) for p in probs]
    assert all(c == p.steps for c, p in zip(clean, probs))
    noisy = [noisy_steps(p, rng, 0.5, cfg.max_number) for p in probs]
    wrong = sum(n[-1] != p.answer for n, p in zip(noisy, probs))
    assert 0.3 * len(probs) < wrong < len(probs)
    for p in probs[:100]:
        g = extract_answer(guess_solution(p, rng, 10, cfg.max_number))
        assert g is not None and abs(g - p.answer) <= 10
    assert format_solution((3, 9)) == "3 , 9 \\boxed{9}"


def test_bad_task_config_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown task keys"):
        TaskConfig.from_mapping({"nope": 1})
    with pytest.raises(ValueError, match="operand_max"):
        TaskConfig(operand_max=0)
    with pytest.raises(ValueError, match="slots"):
        TaskConfig(slots=3)
    with pytest.raises(ValueError, match="unknown split"):
        make_split(TaskConfig(), "aime26")
    assert TaskConfig.from_mapping({"label": "ignored", "eval_ops": [2, 3]}).eval_ops == (2, 3)


def test_tokenizer_round_trip_and_vocabulary() -> None:
    tok = ArithmeticTokenizer(255)
    assert tok.vocab_size == 266 and tok.vocab_size > 10 * 20
    p = make_split(TaskConfig(), "aime25_standin")[0]
    ids = tok.encode(p.solution, eos=True)
    assert ids[-1] == tok.eos_id
    assert tok.decode(ids) == p.solution
    assert all(tok.tokens[tok.number_id(n)] == str(n) for n in (0, 7, 255))
    assert tok.encode(p.prompt, bos=True)[0] == tok.bos_id
    assert tok.decode([tok.number_id(5), tok.eos_id, tok.number_id(6)]) == "5"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("256")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("3 * 4")


def test_each_replicate_draws_its_own_stream_of_the_same_distribution() -> None:
    """An RL run's seed is a replicate: its stream holds other problems (not a shift of another replicate's),
    replicate 0 is the task's own stream, a replicate's stream is the same on every call and resumes at its data
    position, held-out problems stay out, and every replicate covers the same operation counts."""
    cfg = TaskConfig(eval_ops=(1, 2), eval_size=40)
    held = set(make_split(cfg, "aime24_standin")) | set(make_split(cfg, "aime25_standin"))

    def first(n: int, **kw: int) -> list:
        it = iter_train_prompts(cfg, **kw)
        return [next(it) for _ in range(n)]

    streams = {r: first(2000, replicate=r) for r in (0, 1, 2, -1)}
    assert streams[0] == first(2000)
    assert first(2000, replicate=1) == streams[1]
    for a in streams:
        for b in streams:
            if a != b:  # not the same sequence, nor one offset against the other
                assert streams[a][:20] != streams[b][:20]
                assert not any(streams[a][k:k + 20] == streams[b][:20] for k in range(1, 1000))
    for s in streams.values():
        assert not held & set(s)
        assert {len(p.ops) for p in s} == set(range(cfg.train_ops[0], cfg.train_ops[1] + 1))
    assert first(30, replicate=2, start=20) == streams[2][20:50]
