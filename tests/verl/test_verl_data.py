"""Data preparation on the tiny fixture files: filter stages, verl RLHF parquet read by verl, verl's reward scoring.

``sweeps.datasets`` imports no verl (test_verl_free.py prepares the data where verl cannot be imported); verl's own
``RLHFDataset`` reads the files and verl's reward (:mod:`predmask.verl.reward`) scores their answers here.

The fixtures (tests/verl/fixtures) are a handful of hand-written rows shaped like the hub releases (a DAPO-style
verl row set, raw AIME rows); nothing is downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from verl_helpers import FIXTURES, REPO, require_verl

from predmask.verl.overrides import DATA_FILES
from sweeps.datasets import (
    DATA_SOURCES,
    PROMPT_TEMPLATE,
    Problem,
    canonical_answer,
    extract_problem,
    filter_train,
    prepare,
    unwrap_problem,
)

pytestmark = pytest.mark.verl


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("data")
    manifest = prepare(out, train_file=FIXTURES / "dapo_math_tiny.jsonl", aime24_file=FIXTURES / "aime24_tiny.jsonl",
                       aime25_file=FIXTURES / "aime25_tiny.json")
    return out, manifest


def test_training_filter_stages_on_the_fixture(prepared) -> None:
    _, manifest = prepared
    assert manifest["sets"]["train"]["stages"] == [
        ["read", 10], ["non-empty problem and answer", 9], ["deduplicated", 7], ["English (no CJK characters)", 6],
        ["integer answer", 5],
    ]
    rows = pq.read_table(prepared[0] / DATA_FILES["train"]).to_pylist()
    assert [r["extra_info"]["source_id"] for r in rows] == ["fixture-0", "fixture-1", "fixture-2", "fixture-7",
                                                            "fixture-9"]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["55", "28", "5", "8", "12"]
    assert rows[2]["extra_info"]["raw_problem"] == "Let x satisfy 3x + 5 = 20. Find x.\n\nGive x as an integer."


def test_evaluation_sets_are_deduplicated_and_canonical(prepared) -> None:
    out, manifest = prepared
    aime24 = pq.read_table(out / DATA_FILES["aime24"]).to_pylist()
    aime25 = pq.read_table(out / DATA_FILES["aime25"]).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in aime24] == ["24", "24", "9"]
    assert [r["reward_model"]["ground_truth"] for r in aime25] == ["391", "143"]
    assert {r["data_source"] for r in aime24} == {"aime24"} and {r["data_source"] for r in aime25} == {"aime25"}
    assert manifest["sets"]["aime24"]["rows"] == 3
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest and len(on_disk["sets"]["train"]["sha256"]) == 64


def test_parquet_has_verl_rlhf_columns_and_types(prepared) -> None:
    import pyarrow as pa

    schema = pq.read_schema(prepared[0] / DATA_FILES["train"])
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert schema.field("reward_model").type.get_field_index("ground_truth") >= 0
    assert schema.field("extra_info").type.field("index").type == pa.int64()
    row = pq.read_table(prepared[0] / DATA_FILES["aime25"]).to_pylist()[0]
    assert row["prompt"] == [{"role": "user", "content": PROMPT_TEMPLATE.format(problem="What is 17 times 23?")}]


def test_verl_rlhf_dataset_reads_the_files(prepared, tmp_path) -> None:
    """verl's own RLHFDataset (datasets-backed) loads train and eval files and yields chat prompts."""
    require_verl("verl.utils.dataset.rl_dataset")
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    out = prepared[0]
    files = [str(out / DATA_FILES[k]) for k in ("train", "aime24", "aime25")]
    config = OmegaConf.create({"filter_overlong_prompts": False, "cache_dir": str(tmp_path / "cache"),
                               "prompt_key": "prompt"})
    dataset = RLHFDataset(files, tokenizer=None, config=config)
    assert len(dataset) == 5 + 3 + 2
    item = dataset[6]
    assert item["data_source"] == "aime24" and item["raw_prompt"][0]["role"] == "user"
    assert item["reward_model"]["ground_truth"] == "24" and item["index"] == 1


@pytest.mark.parametrize("key", ["train", "aime24", "aime25"])
def test_rewards_score_with_verl_dapo_math(prepared, key: str) -> None:
    """predmask.verl.reward (verl's default dispatch) scores every prepared row's answer contract."""
    reward_score = require_verl("predmask.verl.reward").reward_score
    for row in pq.read_table(prepared[0] / DATA_FILES[key]).to_pylist():
        truth = row["reward_model"]["ground_truth"]
        assert row["data_source"] == DATA_SOURCES[key]
        assert reward_score(row["data_source"], f"Some reasoning.\nAnswer: {truth}", truth) == 1.0
        assert reward_score(row["data_source"], f"So the result is \\boxed{{{truth}}}", truth) == 1.0
        assert reward_score(row["data_source"], f"Answer: {int(truth) + 1}", truth) == -1.0
        assert reward_score(row["data_source"], "I do not know.", truth) == -1.0


def test_unwrap_and_extract() -> None:
    framed = "Reply with a final line Answer: N.\n\nFirst part.\n\nSecond part.\n\nRemember the Answer: line."
    assert unwrap_problem(framed) == "First part.\n\nSecond part."
    assert unwrap_problem("  Just a problem.\n\nWith two paragraphs.  ") == "Just a problem.\n\nWith two paragraphs."
    assert extract_problem({"problem": "P", "answer": 7, "id": 3}) == Problem("P", "7", "3")
    assert extract_problem({"question": "Q", "solution": "-012"}) == Problem("Q", "-12", "")
    assert canonical_answer(" 0042 ") == "42" and canonical_answer("3/4") == "3/4"


def test_filter_length_option_and_bad_value() -> None:
    problems = [Problem("short one", "1"), Problem("a much longer problem text", "2")]
    kept, report = filter_train(problems, max_problem_chars=10)
    assert kept == [problems[0]] and report.stages[-1] == ("problem <= 10 characters", 1)
    with pytest.raises(ValueError, match="max-problem-chars"):
        filter_train(problems, max_problem_chars=0)


def test_parquet_and_json_inputs(tmp_path) -> None:
    import pyarrow as pa

    src = tmp_path / "aime.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "What is 2+2?", "answer": "4"}]), src)
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [{"problem": "What is 3+3?", "answer": 6}]}))
    manifest = prepare(tmp_path / "out", train_file=FIXTURES / "dapo_math_tiny.jsonl", aime24_file=src,
                       aime25_file=tmp_path / "wrapped.json")
    assert manifest["sets"]["aime24"]["rows"] == 1 and manifest["sets"]["aime25"]["rows"] == 1


def test_cli_prepare_and_bad_input(tmp_path) -> None:
    env_path = str(REPO)
    args = [sys.executable, "-m", "sweeps.datasets", "prepare", "--out", str(tmp_path / "out"),
            "--train-file", str(FIXTURES / "dapo_math_tiny.jsonl"), "--aime24-file", str(FIXTURES / "aime24_tiny.jsonl"),
            "--aime25-file", str(FIXTURES / "aime25_tiny.json")]
    ok = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=env_path, check=False)
    assert ok.returncode == 0, ok.stderr
    assert all((tmp_path / "out" / name).is_file() for name in DATA_FILES.values())
    bad = subprocess.run([*args[:-1], str(tmp_path / "missing.jsonl")], capture_output=True, text=True,
                         timeout=120, cwd=env_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [f"sweeps.datasets: data file not found: {tmp_path / 'missing.jsonl'}"]
    wrong = tmp_path / "rows.csv"
    wrong.write_text("a,b\n")
    bad = subprocess.run([*args[:-1], str(wrong)], capture_output=True, text=True, timeout=120, cwd=env_path,
                         check=False)
    assert bad.returncode == 2 and "allowed suffixes" in bad.stderr
