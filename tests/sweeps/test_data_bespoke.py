"""``python -m sweeps.datasets prepare --family variational``: Bespoke-Stratos-17k into the variational family's SFT files.

Truth: the hand-written fixture (tests/fixtures/bespoke_stratos, the hub release's columns; its README says which
rows are malformed and why) read back from the written parquet files, and the real CLI in a subprocess. Nothing is
downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from predmask.verl.vr_cluster import VR_DATA_FILES, answers_match, boxed_answer, cut_trace, split_response
from sweeps.datasets import VR_MANIFEST, prepare_variational

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "bespoke_stratos" / "bespoke_stratos_tiny.jsonl"
MALFORMED = [
    "row 3: no <|end_of_thought|> marker",
    "row 4: no assistant turn",
    "row 5: empty question",
    "row 6: markers out of order (expected thought begin/end, then solution begin/end)",
]


def _fixture_rows() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("vr")
    return out, prepare_variational(out, bespoke_file=FIXTURE)


def test_rows_are_split_by_the_markers(prepared: tuple[Path, dict]) -> None:
    out, manifest = prepared
    questions = pq.read_table(out / VR_DATA_FILES["questions"]).to_pylist()
    assert [q["source_id"] for q in questions] == ["row-0", "row-1", "row-2", "row-7"]
    assert [q["question"] for q in questions] == [0, 1, 2, 3]
    assert [q["reference_answer"] for q in questions] == ["42", "49", "", "5"]
    assert [q["checkable"] for q in questions] == [True, True, False, True]
    raw = _fixture_rows()[1]["conversations"]
    q = questions[1]
    assert q["problem"] == raw[0]["value"] and q["response"] == raw[1]["value"]
    assert q["thought"] == "Area of a square is the side squared.\n\n7 * 7 = 49.\n\nCheck: 49 / 7 = 7."
    assert q["solution"] == "The area is $7^2 = \\boxed{49}$."
    # z then y' rebuilds the original response of the fixture exactly (it uses the dataset's spacing)
    assert q["trace_text"] + q["answer_text"] == raw[1]["value"]
    assert q["hint_prompt"] == f"{raw[0]['value']}\n\n<hint>\n{q['solution']}\n</hint>"
    assert manifest["malformed"] == MALFORMED and (manifest["read"], manifest["rows"]) == (8, 4)


def test_sft_and_posterior_files_are_chat_messages(prepared: tuple[Path, dict]) -> None:
    out, _ = prepared
    sft = pq.read_table(out / VR_DATA_FILES["sft"]).to_pylist()
    post = pq.read_table(out / VR_DATA_FILES["posterior"]).to_pylist()
    system = _fixture_rows()[0]["system"]
    assert [m["role"] for m in sft[0]["messages"]] == ["system", "user", "assistant"]
    assert sft[0]["messages"][0]["content"] == system  # conf/prompt/reasoning.yaml: system from the data
    assert sft[3]["messages"][1]["content"] == _fixture_rows()[7]["conversations"][0]["value"]
    assert post[3]["messages"][1]["content"].endswith("\n<hint>\nSubtracting 5 and dividing by 3 gives $x = \\boxed{5}$.\n</hint>")
    assert post[3]["messages"][2] == sft[3]["messages"][2]  # same target, only the prompt carries the hint
    assert {r["weight"] for r in sft + post} == {1.0}
    manifest = json.loads((out / VR_MANIFEST).read_text())
    assert {k: v["rows"] for k, v in manifest["files"].items()} == {"sft": 4, "posterior": 4, "questions": 4}


def test_a_directory_of_parquet_shards_reads_like_the_file(tmp_path: Path, prepared: tuple[Path, dict]) -> None:
    rows = _fixture_rows()
    shards = tmp_path / "data"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:5]), shards / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[5:]), shards / "train-00001-of-00002.parquet")
    manifest = prepare_variational(tmp_path / "out", bespoke_file=shards)
    assert manifest["malformed"] == MALFORMED
    a = pq.read_table(tmp_path / "out" / VR_DATA_FILES["questions"]).to_pylist()
    b = pq.read_table(prepared[0] / VR_DATA_FILES["questions"]).to_pylist()
    assert a == b


def test_cli_reports_malformed_rows_one_line_each(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "sweeps.datasets", "prepare", "--family", "variational",
                           "--bespoke-file", str(FIXTURE), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [f"sweeps.datasets: skipped Bespoke-Stratos {m}" for m in MALFORMED]
    assert sorted(p.name for p in out.iterdir()) == sorted([*VR_DATA_FILES.values(), VR_MANIFEST])


def test_nothing_is_written_without_usable_rows(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for i, r in enumerate(_fixture_rows()) if i in (3, 4, 5, 6)) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "sweeps.datasets", "prepare", "--family", "variational",
                           "--bespoke-file", str(bad), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"sweeps.datasets: no usable rows in {bad} (4 malformed)"]
    assert not out.exists()
    missing = subprocess.run([sys.executable, "-m", "sweeps.datasets", "prepare", "--family", "variational",
                              "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert missing.returncode == 2 and "needs --bespoke-file" in missing.stderr and not out.exists()


@pytest.mark.parametrize(("text", "answer"), [
    ("so \\boxed{42}.", "42"), ("\\boxed{\\frac{1}{2}} then \\boxed{ 7 }", "7"), ("no box", None),
    ("\\boxed{unclosed", None), ("\\boxed{a{b}c}", "a{b}c"),
])
def test_boxed_answer(text: str, answer: str | None) -> None:
    assert boxed_answer(text) == answer


def test_split_cut_and_match() -> None:
    with pytest.raises(ValueError, match="2 <\\|begin_of_thought\\|> markers"):
        split_response("<|begin_of_thought|><|begin_of_thought|>x<|end_of_thought|><|begin_of_solution|>y<|end_of_solution|>")
    with pytest.raises(ValueError, match="empty thought section"):
        split_response("<|begin_of_thought|> <|end_of_thought|><|begin_of_solution|>y<|end_of_solution|>")
    assert cut_trace("abc<|end_of_thought|> rest") == ("abc<|end_of_thought|>", " rest")
    assert cut_trace("no marker") is None
    assert answers_match("x = \\boxed{ 5 }", "5") and not answers_match("\\boxed{6}", "5")
    assert not answers_match("\\boxed{}", "")  # an empty reference never matches
