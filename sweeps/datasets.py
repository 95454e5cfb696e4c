"""``python -m sweeps.datasets prepare``: the paper's data (DAPO-Math-17k filtered, AIME24, AIME25) as verl RLHF parquet.

Writes ``<out>/dapo_math_13k.parquet`` (training), ``<out>/aime24.parquet`` and ``<out>/aime25.parquet``
(evaluation) and ``<out>/manifest.json`` (counts per filter stage, sources, template). Each row is verl's RLHF
format: ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model`` {style, ground_truth},
``extra_info`` {index, split, raw_problem, source_id}. verl's default reward dispatch scores ``math_dapo`` and
``aime*`` with its DAPO math scoring (the last ``Answer: ...`` line, else ``\\boxed{}``; the same dispatch as
:func:`predmask.verl.reward.reward_score`), so the validation metrics are ``val-core/aime24/acc/mean@16`` and
``val-core/aime25/acc/mean@16``. Nothing here imports verl.

Sources: local files (.parquet, .jsonl or .json) or, for any set without one, the Hugging Face hub.

Training filter (the paper says "a filtered version of DAPO-Math-17k ... about 13k"; its exact filter is not
published, so this is ours, with the count printed after every stage):
1. rows with an empty problem or answer are dropped;
2. duplicates are dropped (the hub release repeats each problem; key: whitespace-collapsed, case-folded problem);
3. non-English problems are dropped (any CJK / kana / hangul / full-width character);
4. the ground truth must be an integer (DAPO-Math's answers are integers by construction);
5. optionally ``--max-problem-chars N`` drops long problems.
Stages 1-4 should give about 14.1k problems on the public release; ``--max-problem-chars`` brings it towards
the paper's ~13k (check the printed counts and manifest.json on the cluster).

Every problem (training and evaluation) is re-wrapped in one prompt template (:data:`PROMPT_TEMPLATE`) so that
training and evaluation prompts agree; DAPO-formatted prompts are unwrapped first (:func:`unwrap_problem`).

``--family arithmetic`` writes the CPU engine's synthetic arithmetic task instead (:func:`prepare_arithmetic`; nothing
read or downloaded), for verl to train the exported CPU stand-in (``python -m predmask.rl.hf_export``) on the task
the engine trains it on: the training rows are the first ``--train-size`` problems of the stream the engine draws
for the run's ``seed`` (``predmask.rl.task.iter_train_prompts``; by default ``trainer.steps`` x
``trainer.train_batch_size`` of conf/train.yaml, in the engine's order, so verl with ``data.shuffle=false`` and the
same batch size trains on the same batches), the evaluation rows the held-out splits (``make_split``). Each prompt
is the problem's bare text (``7 + 2 - 5 _ _ _ _ _ _ =``), the text the engine tokenises; the exported tokenizer's
chat template adds only ``<bos>``. The files, data sources and verl's reward function are those of
:mod:`predmask.verl.arithmetic_task`. Overrides (``key=value`` on conf/train.yaml: ``task.*``, ``seed``,
``trainer.*``) follow the options.

``--family variational`` prepares the variational family's SFT files from a local copy of Bespoke-Stratos-17k
instead (:func:`prepare_variational`; never downloaded here): each row's assistant turn split into its thought
and solution, with the prompt templates of conf/prompt/; a malformed row is reported in one line and left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from predmask.config import compose, group_entry, to_container
from predmask.io import atomic_write_text
from predmask.rl.task import EVAL_SPLITS, STANDIN_LABEL, iter_train_prompts, make_split
from predmask.rl.task import Problem as TaskProblem  # this module's own Problem is a text problem
from predmask.schemas.task_schema import TaskConfig
from predmask.verl.arithmetic_task import (  # the task's files, data sources and verl reward (no verl import)
    ARITHMETIC_DATA_FILES,
    ARITHMETIC_SOURCE,
    REWARD_FUNCTION_NAME,
    REWARD_FUNCTION_PATH,
)
from predmask.verl.overrides import DATA_FILES  # the file names the verl command reads (no verl import)
from predmask.verl.vr_cluster import (  # the variational family's file names and response format (no verl import)
    SOLUTION_MARKERS,
    THOUGHT_MARKERS,
    VR_DATA_FILES,
    answer_text,
    boxed_answer,
    chat_messages,
    split_response,
    trace_text,
    write_parquet,
)

#: the one prompt of every problem; the answer contract matches verl's DAPO math scoring (last "Answer:" line)
PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. On the last line of your response, give the final answer "
    'in the form "Answer: X" where X is the answer.\n\n{problem}'
)
#: default hub datasets (name, split) per set; override with --train-hub / --aime24-hub / --aime25-hub
HUB_SOURCES: dict[str, tuple[str, str]] = {
    "train": ("BytedTsinghua-SIA/DAPO-Math-17k", "train"),
    "aime24": ("HuggingFaceH4/aime_2024", "train"),
    "aime25": ("yentinglin/aime_2025", "train"),
}
#: data_source per set: verl dispatches "math_dapo" and names starting with "aime" to its DAPO math scoring
DATA_SOURCES: dict[str, str] = {"train": "math_dapo", "aime24": "aime24", "aime25": "aime25"}

_CJK = re.compile(r"[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uff00-\uffef]")
_INT = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class Problem:
    """One problem: its text, its ground-truth answer and an id from the source."""

    problem: str
    answer: str
    source_id: str = ""


@dataclass
class FilterReport:
    """Row counts after each training-filter stage (for the manifest and the console)."""

    stages: list[tuple[str, int]] = field(default_factory=list)

    def add(self, stage: str, count: int) -> None:
        self.stages.append((stage, count))


def unwrap_problem(text: str) -> str:
    """The bare problem from a DAPO-style prompt (instruction paragraph, problem, reminder paragraph).

    A text whose first and last paragraphs both mention "Answer" is taken to be framed: the paragraphs between
    them are the problem. Any other text is returned stripped.
    """
    text = text.strip()
    parts = text.split("\n\n")
    if len(parts) >= 3 and "answer" in parts[0].lower() and "answer" in parts[-1].lower():
        return "\n\n".join(parts[1:-1]).strip()
    return text


def canonical_answer(value: Any) -> str:
    """The ground truth as a string; integers without sign noise or leading zeros ("042" -> "42")."""
    text = str(value).strip()
    if _INT.match(text):
        return str(int(text))
    return text


def _first(row: Mapping[str, Any], keys: Sequence[str]) -> Any:
    for key in keys:
        if row.get(key) not in (None, ""):
            return row[key]
    return None


def extract_problem(row: Mapping[str, Any]) -> Problem:
    """A :class:`Problem` from a verl-style row (prompt messages + reward_model.ground_truth) or a raw row
    (problem/question + answer). Missing fields give empty strings (dropped by the filter)."""
    prompt = row.get("prompt")
    if isinstance(prompt, Sequence) and not isinstance(prompt, str) and prompt:
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        text = unwrap_problem(str((users or list(prompt))[-1].get("content", "")))
    else:
        text = str(_first(row, ("problem", "Problem", "question", "prompt")) or "").strip()
    reward = row.get("reward_model")
    answer = reward.get("ground_truth") if isinstance(reward, Mapping) else None
    if answer in (None, ""):
        answer = _first(row, ("answer", "Answer", "ground_truth", "solution"))
    extra = row.get("extra_info")
    source_id = _first(row, ("id", "ID", "uid")) or (extra.get("index") if isinstance(extra, Mapping) else None)
    return Problem(text, "" if answer is None else canonical_answer(answer), "" if source_id is None else str(source_id))


def dedupe(problems: Iterable[Problem]) -> list[Problem]:
    """First occurrence of each problem (whitespace-collapsed, case-folded text)."""
    seen: set[str] = set()
    out = []
    for p in problems:
        key = " ".join(p.problem.split()).casefold()
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def filter_train(problems: Iterable[Problem], *, max_problem_chars: int | None = None) -> tuple[list[Problem], FilterReport]:
    """The training filter (module docstring), with the count after every stage."""
    report = FilterReport()
    rows = list(problems)
    report.add("read", len(rows))
    rows = [p for p in rows if p.problem and p.answer]
    report.add("non-empty problem and answer", len(rows))
    rows = dedupe(rows)
    report.add("deduplicated", len(rows))
    rows = [p for p in rows if not _CJK.search(p.problem)]
    report.add("English (no CJK characters)", len(rows))
    rows = [p for p in rows if _INT.match(p.answer)]
    report.add("integer answer", len(rows))
    if max_problem_chars is not None:
        if max_problem_chars < 1:
            raise ValueError(f"--max-problem-chars must be >= 1, got {max_problem_chars}")
        rows = [p for p in rows if len(p.problem) <= max_problem_chars]
        report.add(f"problem <= {max_problem_chars} characters", len(rows))
    return rows, report


def to_rlhf_rows(problems: Sequence[Problem], *, data_source: str, split: str,
                 template: str = PROMPT_TEMPLATE) -> list[dict[str, Any]]:
    """verl RLHF rows (the columns verl's RLHFDataset and reward loop read); the user turn is ``template`` with
    the problem in its ``{problem}`` field."""
    return [
        {
            "data_source": data_source,
            "prompt": chat_messages("", template.format(problem=p.problem)),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"index": i, "split": split, "raw_problem": p.problem, "source_id": p.source_id},
        }
        for i, p in enumerate(problems)
    ]


def _parquet_schema() -> Any:
    import pyarrow as pa

    chat = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    reward = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
    extra = pa.struct([("index", pa.int64()), ("split", pa.string()), ("raw_problem", pa.string()),
                       ("source_id", pa.string())])
    return pa.schema([("data_source", pa.string()), ("prompt", chat), ("ability", pa.string()),
                      ("reward_model", reward), ("extra_info", extra)])


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a local .parquet, .jsonl or .json (a list of objects, or {"data": [...]}) file."""
    if not path.is_file():
        raise ValueError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix == ".jsonl":
        with path.open() as fh:
            return [json.loads(line) for line in fh if line.strip()]
    if suffix == ".json":
        data = json.loads(path.read_text())
        rows = data.get("data") if isinstance(data, Mapping) else data
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a list of rows (or {{'data': [...]}})")
        return rows
    raise ValueError(f"unsupported data file {path}: allowed suffixes .parquet, .jsonl, .json")


def hub_rows(name: str, split: str) -> Iterator[dict[str, Any]]:
    """Rows of a Hugging Face hub dataset (network; imports ``datasets`` lazily)."""
    try:
        from datasets import load_dataset
    except ImportError as exc:  # pragma: no cover - cluster path
        raise ValueError(f"reading {name} from the hub needs the 'datasets' package ({exc}); or pass a local file") from None
    yield from load_dataset(name, split=split)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare(
    out: Path,
    *,
    train_file: Path | None = None,
    aime24_file: Path | None = None,
    aime25_file: Path | None = None,
    hub: Mapping[str, tuple[str, str]] | None = None,
    max_problem_chars: int | None = None,
) -> dict[str, Any]:
    """Build the three parquet files and the manifest under ``out``; returns the manifest."""
    hub = {**HUB_SOURCES, **(hub or {})}
    locals_ = {"train": train_file, "aime24": aime24_file, "aime25": aime25_file}
    manifest: dict[str, Any] = {"template": PROMPT_TEMPLATE, "sets": {}}
    for key in ("train", "aime24", "aime25"):
        local = locals_[key]
        origin = str(local) if local is not None else f"hf://{hub[key][0]}[{hub[key][1]}]"
        rows = read_rows(local) if local is not None else hub_rows(*hub[key])
        problems = [extract_problem(row) for row in rows]
        if key == "train":
            kept, report = filter_train(problems, max_problem_chars=max_problem_chars)
            stages = report.stages
        else:
            kept = dedupe(p for p in problems if p.problem and p.answer)
            stages = [("read", len(problems)), ("non-empty, deduplicated", len(kept))]
        if not kept:
            raise ValueError(f"{key}: no usable rows in {origin}")
        split = "train" if key == "train" else "test"
        path = out / DATA_FILES[key]
        write_parquet(to_rlhf_rows(kept, data_source=DATA_SOURCES[key], split=split), path, schema=_parquet_schema())
        manifest["sets"][key] = {
            "file": DATA_FILES[key], "source": origin, "data_source": DATA_SOURCES[key], "rows": len(kept),
            "stages": [[stage, count] for stage, count in stages], "sha256": _sha256(path),
        }
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return manifest


# -- the arithmetic family: the CPU engine's task ------------------------------------------------------------------

#: manifest of ``--family arithmetic`` (beside the RL family's manifest.json)
ARITHMETIC_MANIFEST = "arithmetic_manifest.json"
#: the user turn of an arithmetic row: the problem's text and nothing else (what the engine tokenises)
ARITHMETIC_TEMPLATE = "{problem}"


def arithmetic_rows(problems: Sequence[TaskProblem], *, data_source: str, split: str) -> list[dict[str, Any]]:
    """verl RLHF rows of the task's problems: the bare prompt text, the answer as ``ground_truth``, the position
    in ``split`` as ``extra_info.index`` (``source_id`` ``<split>-<index>``)."""
    rows = [Problem(p.prompt, str(p.answer), f"{split}-{i}") for i, p in enumerate(problems)]
    return to_rlhf_rows(rows, data_source=data_source, split=split, template=ARITHMETIC_TEMPLATE)


def arithmetic_train_size(run_cfg: Mapping[str, Any]) -> int:
    """The prompts the CPU engine draws in a whole run: ``trainer.steps`` x ``trainer.train_batch_size``."""
    trainer = run_cfg["trainer"]
    return int(trainer["steps"]) * int(trainer["train_batch_size"])


def prepare_arithmetic(out: Path, overrides: Sequence[str] = (), *, train_size: int | None = None) -> dict[str, Any]:
    """Write the arithmetic family's parquet files and manifest under ``out`` (module docstring) for the run
    config conf/train.yaml composes with ``overrides``; returns the manifest."""
    return write_arithmetic(out, to_container(compose("train", list(overrides))), train_size=train_size)


def write_arithmetic(out: Path, run_cfg: Mapping[str, Any], *, train_size: int | None = None) -> dict[str, Any]:
    """:func:`prepare_arithmetic` for a composed run config ``run_cfg``."""
    task = TaskConfig.from_mapping(run_cfg["task"])
    seed = int(run_cfg["seed"])
    size = arithmetic_train_size(run_cfg) if train_size is None else train_size
    if size < 1:
        raise ValueError(f"--train-size must be >= 1, got {size}")
    stream = iter_train_prompts(task, replicate=seed)
    problems = {"train": [next(stream) for _ in range(size)], **{s: make_split(task, s) for s in EVAL_SPLITS}}
    tables = {key: arithmetic_rows(rows, data_source=ARITHMETIC_SOURCE if key == "train" else key, split=key)
              for key, rows in problems.items()}
    manifest: dict[str, Any] = {
        "family": "arithmetic", "task": task.to_dict(), "label": STANDIN_LABEL, "seed": seed,
        "train_order": f"the CPU engine's training stream for seed {seed}, data positions 0..{size - 1}",
        "reward_function": {"path": REWARD_FUNCTION_PATH, "name": REWARD_FUNCTION_NAME}, "sets": {},
    }
    for key, rows in tables.items():
        path = out / ARITHMETIC_DATA_FILES[key]
        write_parquet(rows, path, schema=_parquet_schema())
        manifest["sets"][key] = {"file": ARITHMETIC_DATA_FILES[key], "data_source": rows[0]["data_source"],
                                 "rows": len(rows), "stages": [["generated", len(rows)]], "sha256": _sha256(path)}
    atomic_write_text(out / ARITHMETIC_MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


# -- the variational family: Bespoke-Stratos-17k -------------------------------------------------------------------

#: manifest of ``--family variational`` (beside the RL family's manifest.json)
VR_MANIFEST = "variational_manifest.json"
BESPOKE_SUFFIXES: tuple[str, ...] = (".parquet", ".jsonl", ".json")


def read_bespoke(path: Path) -> list[dict[str, Any]]:
    """Rows of a local Bespoke-Stratos-17k copy: one file, or every .parquet/.jsonl/.json file of a directory
    (sorted by name, e.g. the hub's ``train-0000N-of-0000M.parquet`` shards)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in BESPOKE_SUFFIXES)
        if not files:
            raise ValueError(f"no {', '.join(BESPOKE_SUFFIXES)} files in {path}")
        return [row for f in files for row in read_rows(f)]
    return read_rows(path)


def _turn(conversations: Any, role: str) -> str | None:
    if not isinstance(conversations, Sequence) or isinstance(conversations, str):
        return None
    for turn in conversations:
        if isinstance(turn, Mapping) and turn.get("from", turn.get("role")) == role:
            value = turn.get("value", turn.get("content"))
            return value if isinstance(value, str) else None
    return None


def _prompts(name_reasoning: str, name_hint: str) -> tuple[dict[str, Any], dict[str, Any]]:
    reasoning, hint = group_entry("prompt", name_reasoning), group_entry("prompt", name_hint)
    if tuple(reasoning.get("thought_markers", ())) != THOUGHT_MARKERS or \
            tuple(reasoning.get("solution_markers", ())) != SOLUTION_MARKERS:
        raise ValueError(f"conf/prompt/{name_reasoning}.yaml markers must be {list(THOUGHT_MARKERS)} and "
                         f"{list(SOLUTION_MARKERS)} (predmask.verl.vr_cluster splits responses by them)")
    if hint.get("hint_source") not in ("solution", "boxed"):
        raise ValueError(f"conf/prompt/{name_hint}.yaml hint_source={hint.get('hint_source')!r}; allowed: solution, boxed")
    return reasoning, hint


def parse_bespoke_row(row: Mapping[str, Any], reasoning: Mapping[str, Any], hint: Mapping[str, Any]) -> dict[str, Any]:
    """One question's record from a Bespoke-Stratos row (``system``, ``conversations``); ValueError says why not."""
    conversations = row.get("conversations")
    question = _turn(conversations, "user")
    response = _turn(conversations, "assistant")
    if question is None or not question.strip():
        raise ValueError("no user turn" if question is None else "empty question")
    if response is None:
        raise ValueError("no assistant turn")
    thought, solution = split_response(response)
    reference = boxed_answer(solution)
    hint_value = solution if hint["hint_source"] == "solution" else reference
    if not hint_value:
        raise ValueError("no \\boxed{} answer in the solution (hint_source=boxed needs one)")
    system_cfg = str(reasoning.get("system", "from_data"))
    system = str(row.get("system") or "") if system_cfg == "from_data" else system_cfg
    question = question.strip()
    return {
        "system": system, "problem": question,
        "prompt": str(reasoning["user"]).format(question=question),
        "hint_prompt": str(hint["user"]).format(question=question, hint=hint_value), "hint": hint_value,
        "response": response, "thought": thought, "solution": solution,
        "trace_text": trace_text(thought), "answer_text": answer_text(solution),
        "reference_answer": reference or "", "checkable": reference is not None,
    }


def prepare_variational(out: Path, *, bespoke_file: Path, reasoning_prompt: str = "reasoning",
                        hint_prompt: str = "hint") -> dict[str, Any]:
    """Write the variational family's files under ``out`` (module docstring); returns the manifest, whose
    ``malformed`` lists one line per row left out."""
    reasoning, hint = _prompts(reasoning_prompt, hint_prompt)
    raw = read_bespoke(bespoke_file)
    kept: list[dict[str, Any]] = []
    malformed: list[str] = []
    for index, row in enumerate(raw):
        try:
            record = parse_bespoke_row(row, reasoning, hint)
        except ValueError as exc:
            malformed.append(f"row {index}: {exc}")
            continue
        kept.append({"question": len(kept), "source_id": f"row-{index}", **record})
    if not kept:
        raise ValueError(f"no usable rows in {bespoke_file} ({len(malformed)} malformed)")
    sft = [{"messages": chat_messages(q["system"], q["prompt"], q["response"]), "weight": 1.0, "question": q["question"]}
           for q in kept]
    posterior = [{"messages": chat_messages(q["system"], q["hint_prompt"], q["response"]), "weight": 1.0,
                  "question": q["question"]} for q in kept]
    tables = {"sft": sft, "posterior": posterior, "questions": kept}
    import pyarrow as pa

    for rows in tables.values():  # every table is built before any file is written
        pa.Table.from_pylist(rows)
    manifest: dict[str, Any] = {
        "source": str(bespoke_file), "read": len(raw), "rows": len(kept),
        "checkable": sum(1 for q in kept if q["checkable"]), "malformed": malformed,
        "prompts": {"reasoning": reasoning, "hint": hint}, "files": {},
    }
    for key, rows in tables.items():
        path = out / VR_DATA_FILES[key]
        write_parquet(rows, path)
        manifest["files"][key] = {"file": VR_DATA_FILES[key], "rows": len(rows), "sha256": _sha256(path)}
    atomic_write_text(out / VR_MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def _hub_arg(value: str) -> tuple[str, str]:
    name, _, split = value.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"expected NAME[:SPLIT], got {value!r}")
    return name, split or "train"


def _print_manifest(manifest: Mapping[str, Any], out: Path) -> None:
    from rich.table import Table

    from predmask.console import make_console

    table = Table(title=f"prepared data in {out}")
    for col in ("set", "stage", "rows"):
        table.add_column(col)
    for key, info in manifest["sets"].items():
        for i, (stage, count) in enumerate(info["stages"]):
            table.add_row(key if i == 0 else "", stage, str(count))
        table.add_row("", f"-> {info['file']} (data_source={info['data_source']})", str(info["rows"]))
    make_console().print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sweeps.datasets", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the training and evaluation parquet files")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--train-file", type=Path, help="local DAPO-Math-17k file (else the hub)")
    p.add_argument("--aime24-file", type=Path, help="local AIME 2024 file (else the hub)")
    p.add_argument("--aime25-file", type=Path, help="local AIME 2025 file (else the hub)")
    p.add_argument("--train-hub", type=_hub_arg, help=f"hub NAME[:SPLIT] (default {HUB_SOURCES['train'][0]})")
    p.add_argument("--aime24-hub", type=_hub_arg, help=f"hub NAME[:SPLIT] (default {HUB_SOURCES['aime24'][0]})")
    p.add_argument("--aime25-hub", type=_hub_arg, help=f"hub NAME[:SPLIT] (default {HUB_SOURCES['aime25'][0]})")
    p.add_argument("--max-problem-chars", type=int, help="drop training problems longer than this")
    p.add_argument("--family", choices=("rl", "arithmetic", "variational"), default="rl",
                   help="rl: DAPO-Math + AIME (default); arithmetic: the CPU engine's synthetic task; variational: "
                        "Bespoke-Stratos-17k SFT files")
    p.add_argument("--bespoke-file", type=Path, help="local Bespoke-Stratos-17k file or directory (--family variational)")
    p.add_argument("--train-size", type=int,
                   help="training problems (--family arithmetic; default trainer.steps x trainer.train_batch_size)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="--family arithmetic: overrides of conf/train.yaml (task.*, seed, trainer.*)")
    args = parser.parse_args(argv)
    if args.family != "arithmetic" and (args.overrides or args.train_size is not None):
        print(f"sweeps.datasets: key=value overrides and --train-size are for --family arithmetic, not {args.family}",
              file=sys.stderr)
        return 2
    if args.family == "arithmetic":
        try:
            manifest = prepare_arithmetic(args.out, args.overrides, train_size=args.train_size)
        except (ValueError, OSError) as exc:
            print(f"sweeps.datasets: {exc}", file=sys.stderr)
            return 2
        _print_manifest(manifest, args.out)
        print(f"verl scores it with reward.custom_reward_function.path={REWARD_FUNCTION_PATH} "
              f"reward.custom_reward_function.name={REWARD_FUNCTION_NAME}")
        return 0
    if args.family == "variational":
        if args.bespoke_file is None:
            print("sweeps.datasets: --family variational needs --bespoke-file FILE_OR_DIR (a local copy of "
                  "bespokelabs/Bespoke-Stratos-17k)", file=sys.stderr)
            return 2
        try:
            vr = prepare_variational(args.out, bespoke_file=args.bespoke_file)
        except (ValueError, OSError) as exc:
            print(f"sweeps.datasets: {exc}", file=sys.stderr)
            return 2
        for line in vr["malformed"]:
            print(f"sweeps.datasets: skipped Bespoke-Stratos {line}", file=sys.stderr)
        print(f"prepared {vr['rows']} of {vr['read']} Bespoke-Stratos rows ({vr['checkable']} with a \\boxed{{}} "
              f"answer, {len(vr['malformed'])} malformed) in {args.out}: "
              + ", ".join(f["file"] for f in vr["files"].values()))
        return 0
    hub = {k: v for k, v in (("train", args.train_hub), ("aime24", args.aime24_hub), ("aime25", args.aime25_hub)) if v}
    try:
        manifest = prepare(
            args.out, train_file=args.train_file, aime24_file=args.aime24_file, aime25_file=args.aime25_file,
            hub=hub, max_problem_chars=args.max_problem_chars,
        )
    except ValueError as exc:
        print(f"sweeps.datasets: {exc}", file=sys.stderr)
        return 2
    _print_manifest(manifest, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
