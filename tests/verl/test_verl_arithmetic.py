"""The CPU engine's arithmetic task as verl data and reward (``sweeps.datasets`` ``--family arithmetic``,
:mod:`predmask.verl.arithmetic_task`), checked against the engine's own task code.

The truth is ``predmask.rl.task``: the training rows are the stream the engine draws for a seed, in the engine's
order and at its data positions (``iter_train_prompts(start=...)``, as a resumed run reads it), the evaluation rows
its held-out splits, each prompt the text the engine tokenises (the exported tokenizer's chat template gives the
engine's prompt ids for it); verl's reward function returns ``predmask.rl.task.reward`` on any response. Nothing
here needs verl; what verl itself must read (its RLHFDataset, its reward loader) is checked where verl is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from verl_helpers import REPO, require_verl, run_without

from predmask.config import compose, group_entry, to_container
from predmask.rl.hf_export import hf_tokenizer
from predmask.rl.model import hf_config
from predmask.rl.rollout import encode_prompts
from predmask.rl.task import EVAL_SPLITS, iter_train_prompts, make_split, reward
from predmask.rl.tokenizer import ArithmeticTokenizer
from predmask.schemas.task_schema import TaskConfig
from predmask.verl.arithmetic_task import (
    ARITHMETIC_DATA_FILES,
    ARITHMETIC_SOURCE,
    ARITHMETIC_SOURCES,
    REWARD_FUNCTION_NAME,
    REWARD_FUNCTION_PATH,
    compute_score,
)
from sweeps.datasets import ARITHMETIC_MANIFEST, prepare_arithmetic

pytestmark = pytest.mark.verl
SMALL = ["task.eval_size=4", "trainer.steps=3", "trainer.train_batch_size=5"]


def _task(overrides: list[str]) -> TaskConfig:
    return TaskConfig.from_mapping(to_container(compose("train", overrides))["task"])


def _rows(out: Path, key: str) -> list[dict]:
    return pq.read_table(out / ARITHMETIC_DATA_FILES[key]).to_pylist()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("data")
    return out, prepare_arithmetic(out, SMALL)


def test_the_training_rows_are_the_engines_stream_in_its_order(prepared) -> None:
    out, manifest = prepared
    task = _task(SMALL)
    rows = _rows(out, "train")
    assert len(rows) == 3 * 5 == manifest["sets"]["train"]["rows"]  # trainer.steps x trainer.train_batch_size
    stream = iter_train_prompts(task, replicate=0)
    want = [next(stream) for _ in range(15)]
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": p.prompt}] for p in want]
    assert [r["reward_model"] for r in rows] == [{"style": "rule", "ground_truth": str(p.answer)} for p in want]
    assert [r["extra_info"]["index"] for r in rows] == list(range(15))
    assert {r["data_source"] for r in rows} == {ARITHMETIC_SOURCE} and {r["ability"] for r in rows} == {"math"}
    # step 2's batch is what the engine draws after a resume at data position 5
    resumed = iter_train_prompts(task, start=5, replicate=0)
    assert [r["extra_info"]["raw_problem"] for r in rows[5:10]] == [next(resumed).prompt for _ in range(5)]


def test_a_seed_gives_that_seeds_stream_and_train_size_its_length(tmp_path: Path) -> None:
    manifest = prepare_arithmetic(tmp_path, [*SMALL, "seed=2"], train_size=7)
    stream = iter_train_prompts(_task(SMALL), replicate=2)
    assert [r["extra_info"]["raw_problem"] for r in _rows(tmp_path, "train")] == [next(stream).prompt for _ in range(7)]
    assert manifest["seed"] == 2 and manifest["sets"]["train"]["rows"] == 7
    seed0 = iter_train_prompts(_task(SMALL), replicate=0)
    assert [r["extra_info"]["raw_problem"] for r in _rows(tmp_path, "train")] != [next(seed0).prompt for _ in range(7)]
    with pytest.raises(ValueError, match="--train-size must be >= 1"):
        prepare_arithmetic(tmp_path, SMALL, train_size=0)


def test_the_evaluation_rows_are_the_held_out_splits_named_as_the_engines_metrics(prepared) -> None:
    out, manifest = prepared
    task = _task(SMALL)
    for split in EVAL_SPLITS:
        rows = _rows(out, split)
        problems = make_split(task, split)
        assert len(rows) == task.eval_size == 4
        assert [r["prompt"][0]["content"] for r in rows] == [p.prompt for p in problems]
        assert [r["reward_model"]["ground_truth"] for r in rows] == [str(p.answer) for p in problems]
        assert {r["data_source"] for r in rows} == {split} and manifest["sets"][split]["data_source"] == split
    train = {r["extra_info"]["raw_problem"] for r in _rows(out, "train")}
    assert not train & {r["extra_info"]["raw_problem"] for s in EVAL_SPLITS for r in _rows(out, s)}


def test_the_files_have_verls_columns_and_the_manifest_names_them(prepared) -> None:
    out, manifest = prepared
    for key, name in ARITHMETIC_DATA_FILES.items():
        schema = pq.read_schema(out / name)
        assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        assert manifest["sets"][key]["file"] == name
    assert json.loads((out / ARITHMETIC_MANIFEST).read_text()) == json.loads(json.dumps(manifest))
    assert manifest["reward_function"] == {"path": REWARD_FUNCTION_PATH, "name": REWARD_FUNCTION_NAME}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_the_chat_template_of_the_export_gives_the_engines_prompt_ids_for_every_row(prepared) -> None:
    out, _ = prepared
    tok = ArithmeticTokenizer(_task(SMALL).max_number)
    hf_tok = hf_tokenizer(tok, 64)
    for key in ARITHMETIC_DATA_FILES:
        rows = _rows(out, key)
        ids, mask = encode_prompts(tok, [r["prompt"][0]["content"] for r in rows])  # the engine's rollout prompts
        for row, line, keep in zip(rows, ids, mask):
            got = hf_tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
            assert list(got) == line[keep].tolist()


def test_a_failed_write_keeps_the_previous_files_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepare_arithmetic(tmp_path, SMALL)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    import pyarrow.parquet

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pyarrow.parquet, "write_table", fail)
    with pytest.raises(OSError, match="disk full"):
        prepare_arithmetic(tmp_path, [*SMALL, "seed=5"])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_the_command_prepares_the_family_and_refuses_in_one_line(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "sweeps.datasets", "prepare", "--out", str(tmp_path / "out")]
    ok = subprocess.run([*base, "--family", "arithmetic", "--train-size", "6", "task.eval_size=2"], check=False,
                        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert f"reward.custom_reward_function.path={REWARD_FUNCTION_PATH}" in ok.stdout
    assert len(_rows(tmp_path / "out", "train")) == 6 and len(_rows(tmp_path / "out", EVAL_SPLITS[0])) == 2
    for extra, message in [(["--family", "arithmetic", "nope=1"], "sweeps.datasets: "),
                           (["seed=1"], "are for --family arithmetic, not rl")]:
        bad = subprocess.run([*base, *extra], check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and message in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


# -- the reward -------------------------------------------------------------------------------------------------------

_TEXT = st.lists(st.sampled_from(["\\boxed{", "\\boxed {", "}", "{", ",", " ", "-", "+", "=", "_", "x", "1,234"])
                 | st.integers(0, 300).map(str), max_size=12).map(" ".join)


@settings(max_examples=400, deadline=None)
@given(text=_TEXT | st.text(max_size=30), answer=st.integers(-5, 300), source=st.sampled_from(ARITHMETIC_SOURCES),
       as_int=st.booleans())
def test_the_reward_function_is_the_engines_reward_on_any_response(text: str, answer: int, source: str,
                                                                  as_int: bool) -> None:
    truth = answer if as_int else f" {answer} "
    assert compute_score(source, text, truth) == reward(text, answer)
    assert compute_score(data_source=source, solution_str=text, ground_truth=truth, extra_info={"index": 3},
                         reward_router_address=None) == reward(text, answer)  # verl's keyword call


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 265), max_size=16), answer=st.integers(0, 255))
def test_the_reward_of_a_decoded_response_is_the_engines(ids: list[int], answer: int) -> None:
    tok = ArithmeticTokenizer(255)
    hf_tok = hf_tokenizer(tok, 64)
    upto = ids[:ids.index(tok.eos_id) + 1] if tok.eos_id in ids else ids  # vLLM ends the response at <eos>
    verl_text = hf_tok.decode(upto, skip_special_tokens=True)  # what verl's reward manager decodes
    assert compute_score(ARITHMETIC_SOURCE, verl_text, str(answer)) == reward(tok.decode(ids), answer)


def test_worked_solutions_score_one_and_wrong_ones_zero() -> None:
    assert compute_score(ARITHMETIC_SOURCE, "9 , 4 \\boxed{4}", "4") == 1.0
    assert compute_score("aime24_standin", "9 , 4 \\boxed{5}", "4") == 0.0
    assert compute_score("aime25_standin", "9 , 4", "4") == 0.0
    with pytest.raises(ValueError, match="ground truth 'four' of the arithmetic task is not an integer"):
        compute_score(ARITHMETIC_SOURCE, "\\boxed{4}", "four")


def test_without_verl_the_task_scores_and_other_sources_are_refused_in_one_line(tmp_path: Path) -> None:
    proc = run_without(f"""
        from pathlib import Path

        from predmask.verl.arithmetic_task import compute_score
        from sweeps.datasets import prepare_arithmetic

        assert compute_score("predmask_arithmetic", "1 , 2 \\\\boxed{{2}}", "2") == 1.0
        manifest = prepare_arithmetic(Path({str(tmp_path)!r}), ["task.eval_size=2"], train_size=3)
        assert manifest["sets"]["train"]["rows"] == 3
        try:
            compute_score("math_dapo", "Answer: 2", "2")
        except ValueError as exc:
            print("REFUSED", exc)
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFUSED")]
    assert "data_source 'math_dapo' is not the arithmetic task's" in line and "default reward dispatch" in line


def test_verl_loads_the_reward_function_and_other_sources_get_its_default_dispatch() -> None:
    import_utils = require_verl("verl.utils.import_utils")
    loaded = import_utils.load_extern_object(module_path=REWARD_FUNCTION_PATH, object_name=REWARD_FUNCTION_NAME)
    assert loaded is compute_score
    from verl.utils.reward_score import default_compute_score

    for source, text in [("math_dapo", "Answer: 12"), ("aime24", "so \\boxed{11}"), ("math_dapo", "no answer")]:
        assert compute_score(source, text, "12") == default_compute_score(source, text, "12")


def test_verls_dataset_and_prompt_builder_give_the_engines_prompt_ids(prepared, tmp_path: Path) -> None:
    """verl's RLHFDataset reads every row and its agent loop's prompt builder (the one verl picks for the exported
    config's model_type, Qwen3's) turns each into the engine's prompt ids with the exported tokenizer."""
    require_verl("verl.utils.dataset.rl_dataset")
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    out, _ = prepared
    tok = ArithmeticTokenizer(_task(SMALL).max_number)
    hf_tok = hf_tokenizer(tok, 64)
    files = [str(out / name) for name in ARITHMETIC_DATA_FILES.values()]
    config = OmegaConf.create({"filter_overlong_prompts": True, "max_prompt_length": 32,
                               "cache_dir": str(tmp_path / "cache"), "prompt_key": "prompt"})
    dataset = RLHFDataset(files, tokenizer=hf_tok, config=config)
    assert len(dataset) == 15 + 2 * 4
    model_type = hf_config(group_entry("model", "cpu_s32"), tok.vocab_size).model_type
    builder = create_continuous_token_builder(hf_tok, hf_model_type=model_type)
    assert model_type == "qwen3" and type(builder).__name__ == "QwenContinuousTokenBuilder"
    for i in range(len(dataset)):
        item = dataset[i]
        assert item["data_source"] in ARITHMETIC_SOURCES
        prompt = item["raw_prompt"][-1]["content"]
        assert builder.build_initial_tokens(item["raw_prompt"]) == tok.encode(prompt, bos=True)
