"""The Hugging Face export of a CPU stand-in base model (``predmask.rl.hf_export``), checked against the engine itself.

The exported directory reloads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` alone (offline, no predmask code)
and gives the engine's logits on the same ids; its tokenizer gives the engine's ids for the engine's text and the
engine's prompt ids through its chat template (the truth: ``predmask.rl.rollout.encode_prompts``); its decoded text
is the engine's and scores the same reward. cpu_s32, the model option exported for vLLM, trains in the engine; a
model whose head_dim vLLM's CPU attention does not serve (cpu_s) is refused in one line.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from predmask.config import compose, group_entry, to_container
from predmask.rl.base import base_cache_path, load_base_model
from predmask.rl.engine import Engine
from predmask.rl.hf_export import (
    EXPORT_INFO,
    VERL_QWEN_TOKENS,
    VLLM_CPU_HEAD_SIZES,
    export_base_model,
    head_dim,
    hf_export_dir,
    main,
    vllm_cpu_problem,
)
from predmask.rl.rollout import encode_prompts
from predmask.rl.task import EVAL_SPLITS, iter_train_prompts, make_split, reward
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.schemas.task_schema import TaskConfig
from predmask.schemas.train_schema import BaseConfig

REPO = Path(__file__).resolve().parents[2]
#: a test-sized base model (the export does not depend on how well it learned)
TINY_BASE = ["base.steps=20", "base.batch_size=8", "base.eval_problems=4", "task.eval_size=3"]


def _sections(overrides: list[str]) -> tuple[dict, TaskConfig, BaseConfig]:
    c = to_container(compose("train", overrides))
    return c["model"], TaskConfig.from_mapping(c["task"]), BaseConfig.from_mapping(c["base"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict, TaskConfig, BaseConfig]:
    cache = tmp_path_factory.mktemp("cache")
    model_cfg, task, base = _sections(["model=cpu_s32", *TINY_BASE])
    path, written = export_base_model(model_cfg, task, base, cache_dir=cache, progress=False)
    assert written
    return path, cache, model_cfg, task, base


def test_the_export_lies_beside_the_base_models_cache_file_with_every_file_verl_reads(exported) -> None:
    path, cache, model_cfg, task, base = exported
    pt = base_cache_path(model_cfg, task, base, cache)
    assert path == hf_export_dir(model_cfg, task, base, cache) == pt.with_suffix(".hf") and pt.is_file()
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            EXPORT_INFO} <= names
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary folder left
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 0)
    info = json.loads((path / EXPORT_INFO).read_text())
    assert info["model_name"] == "cpu_s32" and info["stands_in_for"] == "qwen3_4b_base"
    assert info["base_info"]["cache_path"] == str(pt)


def test_a_current_export_is_reused_and_force_writes_it_again(exported) -> None:
    path, cache, model_cfg, task, base = exported
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert export_base_model(model_cfg, task, base, cache_dir=cache, progress=False) == (path, False)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    info = json.loads((path / EXPORT_INFO).read_text())
    (path / EXPORT_INFO).write_text(json.dumps({**info, "export_version": -1}))  # an older exporter's
    assert export_base_model(model_cfg, task, base, cache_dir=cache, progress=False) == (path, True)
    assert export_base_model(model_cfg, task, base, cache_dir=cache, progress=False, force=True) == (path, True)


def test_the_reloaded_model_gives_the_engines_logits(exported) -> None:
    path, cache, model_cfg, task, base = exported
    engine_model, _ = load_base_model(model_cfg, task, base, cache_dir=cache, progress=False)
    hf_model = AutoModelForCausalLM.from_pretrained(path)
    assert type(hf_model) is type(engine_model) and hf_model.dtype == torch.float32
    tok = ArithmeticTokenizer(task.max_number)
    problems = make_split(task, "aime24_standin")
    ids, mask = encode_prompts(tok, [p.prompt + " " + p.solution for p in problems])  # left-padded, as the rollout
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    engine_model.eval()
    hf_model.eval()
    with torch.no_grad():
        want = engine_model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
        got = hf_model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
    assert got.shape == want.shape and got.shape[-1] == tok.vocab_size
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert want[mask].std() > 0.1  # a real model, not a constant


def test_the_chat_template_gives_the_engines_prompt_ids(exported) -> None:
    path, _, _, task, _ = exported
    hf_tok = AutoTokenizer.from_pretrained(path)
    tok = ArithmeticTokenizer(task.max_number)
    stream = iter_train_prompts(task, replicate=3)
    problems = [next(stream) for _ in range(12)] + [p for s in EVAL_SPLITS for p in make_split(task, s)]
    ids, mask = encode_prompts(tok, [p.prompt for p in problems])
    for problem, row, keep in zip(problems, ids, mask):
        got = hf_tok.apply_chat_template([{"role": "user", "content": problem.prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        assert list(got) == row[keep].tolist(), problem.prompt
        assert got[0] == tok.bos_id == hf_tok.bos_token_id
    text = hf_tok.apply_chat_template([{"role": "user", "content": "1 + 2 ="}, {"role": "assistant", "content": "3"}],
                                      tokenize=False)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode("1 + 2 = 3", bos=True, eos=True)
    with pytest.raises(Exception, match="user and assistant turns only"):
        hf_tok.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)


def test_the_tokenizer_has_the_engines_ids_and_verls_qwen_lookups(exported) -> None:
    path, _, _, task, _ = exported
    hf_tok = AutoTokenizer.from_pretrained(path)
    tok = ArithmeticTokenizer(task.max_number)
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    vocab = hf_tok.get_vocab()
    assert all(vocab[t] == i for i, t in enumerate(tok.tokens))
    assert [vocab[t] for t in VERL_QWEN_TOKENS] == list(range(tok.vocab_size, tok.vocab_size + len(VERL_QWEN_TOKENS)))
    assert hf_tok.encode("\n", add_special_tokens=False) == [vocab["\n"]]  # verl's Qwen3 prompt builder asks
    assert hf_tok.convert_tokens_to_ids("<|im_end|>") == vocab["<|im_end|>"]
    for n in (0, 9, 10, 99, 100, task.max_number):
        assert hf_tok.encode(str(n), add_special_tokens=False) == [tok.number_id(n)]
    with pytest.raises(Exception, match="Missing"):  # a number outside the vocabulary, refused as the engine does
        hf_tok.encode(str(task.max_number + 1), add_special_tokens=False)
    with pytest.raises(ValueError):
        tok.encode(str(task.max_number + 1))


_PIECES = st.sampled_from(["+", "-", "=", ",", "\\boxed{", "}", "_", "<bos>", "<eos>", "<pad>"]) | \
    st.integers(0, 255).map(str)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=24), spaces=st.lists(st.sampled_from([" ", "  ", "\t", " \t "]),
                                                                min_size=24, max_size=24))
def test_encode_and_decode_are_the_engines_on_any_text(hf_tokenizer, pieces: list[str], spaces: list[str]) -> None:
    tok = ArithmeticTokenizer(255)
    text = "".join(p + s for p, s in zip(pieces, spaces))
    ids = tok.encode(text)
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ids
    decoded = hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == tok.decode(ids, stop_at_eos=False)
    assert hf_tokenizer.encode(decoded, add_special_tokens=False) == [i for i in ids if i >= 3]  # round trip
    # verl decodes a response up to its end, which vLLM puts at <eos>; the engine's decode stops there too
    upto = ids[:ids.index(tok.eos_id) + 1] if tok.eos_id in ids else ids
    assert hf_tokenizer.decode(upto, skip_special_tokens=True) == tok.decode(ids)
    assert reward(hf_tokenizer.decode(upto, skip_special_tokens=True), 7) == reward(tok.decode(ids), 7)


@pytest.fixture(scope="module")
def hf_tokenizer(exported):
    return AutoTokenizer.from_pretrained(exported[0])


def test_worked_solutions_decode_to_what_the_reward_parses() -> None:
    tok = ArithmeticTokenizer(255)
    from predmask.rl.hf_export import hf_tokenizer as build

    hf_tok = build(tok, 64)
    for text, answer in [("9 , 4 \\boxed{4}", 4), ("\\boxed{12}", 12), ("3 , 5", 5), ("\\boxed{ - 7 }", -7)]:
        ids = tok.encode(text, eos=True)
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)
        assert reward(hf_tok.decode(ids, skip_special_tokens=True), answer) == reward(tok.decode(ids), answer)
    assert hf_tok.decode(tok.encode("9 , 4 \\boxed{4}", eos=True), skip_special_tokens=True) == "9 , 4 \\boxed{4}"


def test_vllm_head_sizes_refuse_cpu_s_and_name_cpu_s32() -> None:
    vocab = ArithmeticTokenizer(255).vocab_size
    cpu_s32, cpu_s = group_entry("model", "cpu_s32"), group_entry("model", "cpu_s")
    assert head_dim(cpu_s32, vocab) == 32 in VLLM_CPU_HEAD_SIZES and vllm_cpu_problem(cpu_s32, vocab) is None
    problem = vllm_cpu_problem(cpu_s, vocab)
    assert problem is not None and "head_dim 16" in problem and "model=cpu_s32" in problem and "\n" not in problem
    assert "head_dim 24" in (vllm_cpu_problem(group_entry("model", "cpu_m"), vocab) or "")
    assert head_dim({**cpu_s, "head_dim": None}, vocab) == 128  # what the model is then: Qwen3Config's default
    assert vllm_cpu_problem({**cpu_s, "head_dim": 64}, vocab) is None
    # cpu_s32 is cpu_s but for its heads: same width, depth and the same paper model
    same = ("hidden_size", "intermediate_size", "num_hidden_layers", "tie_word_embeddings", "stands_in_for", "arch")
    assert {k: cpu_s32[k] for k in same} == {k: cpu_s[k] for k in same}


def test_the_export_refuses_cpu_s_unless_told_and_writes_nothing(tmp_path: Path) -> None:
    model_cfg, task, base = _sections(["model=cpu_s", *TINY_BASE])
    with pytest.raises(ValueError, match="head_dim 16"):
        export_base_model(model_cfg, task, base, cache_dir=tmp_path, progress=False)
    assert not list(tmp_path.iterdir())
    path, written = export_base_model(model_cfg, task, base, cache_dir=tmp_path, progress=False, vllm_check=False)
    assert written and AutoTokenizer.from_pretrained(path).eos_token_id == 2


def test_the_command_exports_a_paper_models_stand_in_and_refuses_in_one_line(tmp_path: Path, capsys) -> None:
    assert main(["model=qwen3_4b_base", *TINY_BASE, f"cache_dir={tmp_path}"]) == 2  # its stand-in is cpu_s
    err = capsys.readouterr().err
    assert err.startswith("error: model 'cpu_s' has head_dim 16") and err.count("\n") == 1
    out = tmp_path / "out"
    assert main(["model=cpu_s32", *TINY_BASE, f"cache_dir={tmp_path}", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"CPU stand-in for qwen3_4b_base, not the real model): {out}")
    assert json.loads((out / "config.json").read_text())["head_dim"] == 32
    assert main(["model=nope", f"cache_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    help_text = subprocess.run([sys.executable, "-m", "predmask.rl.hf_export", "--help"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout
    assert "model=cpu_s32" in help_text and "--no-vllm-check" in help_text


def test_the_engine_trains_cpu_s32(tmp_path: Path) -> None:
    engine = Engine(compose("train", ["model=cpu_s32", "precision=bf16", *TINY_BASE, f"cache_dir={tmp_path}",
                                      "rollout.n=2", "rollout.response_length=6", "trainer.progress=false"]),
                    progress=False)
    assert engine.model.config.head_dim == 32 and engine.model.config.num_attention_heads == 2
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    sample = engine.sample

    def half_rewarded(*args, **kwargs):  # the test-sized base solves nothing; GRPO needs rewards that differ
        batch = sample(*args, **kwargs)
        batch.rewards = (torch.arange(batch.batch_size) % 2).float()
        return batch

    engine.sample = half_rewarded  # type: ignore[method-assign]
    stream = iter_train_prompts(engine.task)
    metrics = engine.train_step([next(stream) for _ in range(4)], torch.Generator().manual_seed(0))
    assert metrics and not any(math.isnan(v) for v in metrics.values())
    assert any(not torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
