"""Seeds as an axis of every sweep: S seeds per cell, each a distinct run; the count is no part of any run id;
bad values are one line before anything is written; a rerun with more seeds runs only the new ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import duckdb
import pytest
import yaml

from predmask.config import compose, conf_dir, stable_id, to_container
from predmask.methods import method_config
from sweeps.compose import RunSpec, SweepError, seed_list
from sweeps.families import describe, expand

# A tiny configuration of the CPU engine: a base model built in seconds, two GRPO steps.
TINY = ["trainer.steps=2", "trainer.val_every=2", "trainer.save_every=2", "trainer.val_n=2", "base.steps=40",
        "base.eval_problems=16", "task.eval_size=8", "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2",
        "rollout.n=4"]


def _yaml(group: str, name: str) -> dict:
    """A config file as written (read with PyYAML, not with the code under test)."""
    return yaml.safe_load((conf_dir() / group / f"{name}.yaml").read_text())


def _grid(sweep: str) -> list[tuple[str, str]]:
    params = _yaml("sweep", sweep)["hydra"]["sweeper"]["params"]
    return [(m, s) for m in params["method"].split(",") for s in params["+setting"].split(",")]


def _seeds_per_cell(runs: list[RunSpec]) -> dict[tuple[str, str], list[int]]:
    cells: dict[tuple[str, str], list[int]] = defaultdict(list)
    for run in runs:
        cells[(run.method, run.config["setting"]["name"])].append(run.seed)
    return {cell: sorted(seeds) for cell, seeds in cells.items()}


@pytest.fixture(scope="module")
def main3() -> list[RunSpec]:
    return expand("main_comparison")


@pytest.fixture(scope="module")
def main5() -> list[RunSpec]:
    return expand("main_comparison", ["seeds=5"])


def test_the_clusters_set_the_default_seeds() -> None:
    assert {name: _yaml("cluster", name)["seeds"] for name in ("local", "slurm_emulated", "h20_4x8")} == {
        "local": 3, "slurm_emulated": 3, "h20_4x8": 1}


def test_main_comparison_runs_three_seeds_per_cell_each_a_distinct_run(main3: list[RunSpec]) -> None:
    grid = _grid("main_comparison")
    assert len(grid) == 16
    assert len(main3) == 48 and len({r.run_id for r in main3}) == 48
    assert _seeds_per_cell(main3) == {cell: [0, 1, 2] for cell in grid}
    assert len({r.cell_id for r in main3}) == 16
    assert describe(main3) == "48 runs (16 cells x 3 seeds)"
    # seed by seed: every cell at seed 0 before any at seed 1
    assert [r.seed for r in main3] == [0] * 16 + [1] * 16 + [2] * 16


def test_seeds_n_and_an_explicit_list(main3: list[RunSpec], main5: list[RunSpec]) -> None:
    grid = _grid("main_comparison")
    assert len(main5) == 80 and len({r.run_id for r in main5}) == 80
    assert _seeds_per_cell(main5) == {cell: [0, 1, 2, 3, 4] for cell in grid}
    listed = expand("main_comparison", ["seeds=[0,3,7]"])
    assert len(listed) == 48 and _seeds_per_cell(listed) == {cell: [0, 3, 7] for cell in grid}
    assert describe(listed) == "48 runs (16 cells x 3 seeds)"
    # the same (cell, seed) is the same run whatever else is in the list
    by_seed = {(r.cell_id, r.seed): r.run_id for r in main5}
    assert all(by_seed[(r.cell_id, r.seed)] == r.run_id for r in listed if r.seed in (0, 3))


def test_a_cells_runs_differ_only_in_their_seed(main3: list[RunSpec]) -> None:
    seed0 = {r.cell_id: r for r in main3 if r.seed == 0}
    for run in main3:
        base = seed0[run.cell_id]
        assert {k for k in run.config if run.config[k] != base.config[k]} <= {"seed", "run_dir"}
        assert stable_id({**run.config, "seed": 0}) == base.run_id


def test_the_seed_count_is_no_part_of_any_run(main3: list[RunSpec], main5: list[RunSpec]) -> None:
    one = expand("main_comparison", ["seeds=1"])
    ids = {n: {(r.cell_id, r.seed): r.run_id for r in runs} for n, runs in ((1, one), (3, main3), (5, main5))}
    assert set(ids[1].values()) == {i for (_, seed), i in ids[3].items() if seed == 0}
    assert set(ids[3].values()) == {i for (_, seed), i in ids[5].items() if seed < 3}
    for runs in (one, main3, main5):
        assert all("seeds" not in r.config and not any(o.startswith("seeds") for o in r.overrides) for r in runs)


def test_a_run_config_is_what_the_trainer_composes_from_its_overrides(main3: list[RunSpec]) -> None:
    for run in (main3[0], main3[21], main3[-1]):
        cfg = to_container(compose("train", list(run.overrides)))
        cfg["method"] = method_config(cfg["method"])
        assert cfg == run.config and cfg["seed"] == run.seed


def test_the_cluster_runs_one_seed_unless_told() -> None:
    runs = expand("main_comparison", ["cluster=h20_4x8"])
    assert len(runs) == 16 and {r.seed for r in runs} == {0}
    assert describe(runs) == "16 runs (16 cells x 1 seed)"
    two = expand("main_comparison", ["cluster=h20_4x8", "method=dppo_topk_kl", "seeds=2"])
    settings = {setting for _, setting in _grid("main_comparison")}
    assert _seeds_per_cell(two) == {("dppo_topk_kl", setting): [0, 1] for setting in settings}


def test_each_cell_takes_its_own_clusters_default() -> None:
    cell = ["method=dppo_topk_kl", "+setting=qwen3_4b_bf16"]
    runs = expand("main_comparison", [*cell, "cluster=local,h20_4x8"])
    assert Counter(r.config["cluster"]["name"] for r in runs) == {"local": 3, "h20_4x8": 1}
    emulated = expand("main_comparison", [*cell, "cluster=slurm_emulated"])
    # the same CPU-engine runs as on the local cluster: where a run is launched is no part of its id
    assert [r.run_id for r in emulated] == [r.run_id for r in runs if r.config["cluster"]["name"] == "local"]


def test_a_seed_axis_still_works_and_smoke_keeps_its_own_seed() -> None:
    assert [r.seed for r in expand("smoke")] == [0] * 4
    assert sorted(r.seed for r in expand("smoke", ["seeds=2"])) == [0] * 4 + [1] * 4
    assert {r.seed for r in expand("smoke", ["seed=4"])} == {4}
    assert sorted(r.seed for r in expand("smoke", ["method=dppo_topk_kl", "seed=1,5"])) == [1, 5]
    assert sorted(r.seed for r in expand("smoke", ["method=dppo_topk_kl", "seed=range(0,3)"])) == [0, 1, 2]
    assert {r.seed for r in expand("main_comparison", ["method=dppo_topk_kl", "seed=4"])} == {4}


@pytest.mark.parametrize("written", ["0", "abc", "[1,1]", "-1", "[-1]", "[]", "1.5", "true", "1,2", "[0,a]", "null"])
def test_bad_seeds_are_one_line_naming_the_value(written: str) -> None:
    with pytest.raises(SweepError) as err:
        expand("main_comparison", [f"seeds={written}"])
    message = str(err.value)
    assert message.startswith("seeds must be a count >= 1") and message.endswith(f"; got {written}")
    assert "seeds=[0,3,7]" in message and "\n" not in message


@pytest.mark.parametrize("written", ["-1", "a", "1,1", "0.5"])
def test_bad_seed_axis_values_are_one_line(written: str) -> None:
    with pytest.raises(SweepError, match=r"^seed must be an integer >= 0 .*; got ") as err:
        expand("smoke", [f"seed={written}"])
    assert str(err.value).endswith(f"; got {written}") and "\n" not in str(err.value)


def test_seed_and_seeds_together_are_refused() -> None:
    with pytest.raises(SweepError, match=r"^give seeds=N \(or seeds=\[...\]\) or seed=..., not both on the command"):
        expand("smoke", ["seed=1", "seeds=3"])


def test_seed_list_counts_and_lists() -> None:
    assert seed_list(3) == [0, 1, 2]
    assert seed_list([7, 0]) == [7, 0]
    with pytest.raises(SweepError, match="got False"):
        seed_list(False)


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "PREDMASK_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}


def _sweeps(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sweeps", *args, "--runs-root", str(tmp / "runs"),
                           "--db", str(tmp / "db.duckdb")], cwd=tmp, env=_env(tmp), capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_bad_seeds_on_the_command_line_write_nothing(tmp_path: Path) -> None:
    out = _sweeps(tmp_path, "main_comparison", "seeds=[1,1]", timeout=300)
    assert out.returncode == 2
    expected = ("error: seeds must be a count >= 1 (seeds=5: seeds 0..4) or a list of distinct integers >= 0 "
                "(seeds=[0,3,7]); got [1,1]")
    assert out.stderr.strip().splitlines() == [expected]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "db.duckdb").exists()


def test_local_dry_run_records_carry_the_seed(tmp_path: Path) -> None:
    out = _sweeps(tmp_path, "smoke", "seeds=2", "--dry-run", "--format", "json", timeout=300)
    assert out.returncode == 0, out.stderr
    records = json.loads(out.stdout)["runs"]
    assert sorted(r["seed"] for r in records) == [0] * 4 + [1] * 4
    assert all(f"seed={r['seed']}" in r["command"] for r in records)
    written = json.loads((tmp_path / "runs" / "smoke" / "dry-run" / "plan.json").read_text())["runs"]
    assert [r["seed"] for r in written] == [r["seed"] for r in records]


def _db_runs(db: Path) -> dict[str, tuple[int, str]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {rid: (seed, status) for rid, seed, status in con.execute("SELECT run_id, seed, status FROM runs").fetchall()}
    finally:
        con.close()


@pytest.mark.slow
def test_a_rerun_with_more_seeds_runs_only_the_new_ones(tmp_path: Path) -> None:
    args = ["smoke", "method=dppo_topk_kl", *TINY]
    first = _sweeps(tmp_path, *args, "seeds=2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 runs (1 cell x 2 seeds)" in first.stdout and "2 completed, 0 already done, 0 failed" in first.stdout
    runs = tmp_path / "runs" / "smoke"
    done = {p.name: (p / "job.json").read_text() for p in runs.iterdir() if (p / "job.json").exists()}
    assert len(done) == 2

    more = _sweeps(tmp_path, *args, "seeds=3")
    assert more.returncode == 0, more.stdout + more.stderr
    assert "3 runs (1 cell x 3 seeds)" in more.stdout and "1 completed, 2 already done, 0 failed" in more.stdout
    started = [line for line in more.stdout.splitlines() if line.startswith("run ")]
    assert len(started) == 1
    new = {p.name for p in runs.iterdir() if (p / "job.json").exists()} - set(done)
    assert len(new) == 1 and new.pop() in started[0]
    # the runs of the first invocation were not submitted again
    assert all((runs / rid / "job.json").read_text() == text for rid, text in done.items())
    by_seed = {seed: (rid, status) for rid, (seed, status) in _db_runs(tmp_path / "db.duckdb").items()}
    assert sorted(by_seed) == [0, 1, 2] and {status for _, status in by_seed.values()} == {"completed"}
    planned = {seed: yaml.safe_load((runs / rid / "planned_config.yaml").read_text())["seed"]
               for seed, (rid, _) in by_seed.items()}
    assert planned == {0: 0, 1: 1, 2: 2}

    status = subprocess.run([sys.executable, "-m", "sweeps", "status", "smoke", "--runs-root", str(tmp_path / "runs")],
                            cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120, check=False)
    assert status.returncode == 0, status.stderr
    assert "seed" in status.stdout
    rows = {line.split("│")[2].strip(): line.split("│")[7].strip() for line in status.stdout.splitlines()
            if line.count("│") >= 9 and line.split("│")[2].strip() in {rid for rid, _ in by_seed.values()}}
    assert rows == {rid: str(seed) for seed, (rid, _) in by_seed.items()}
