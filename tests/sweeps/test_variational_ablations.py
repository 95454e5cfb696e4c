"""The variational family's ablation sweeps (conf/sweep/vr_trace_count.yaml, vr_hint_use.yaml): each expands to
exactly the runs it names, shares the stage runs whose settings are equal (the main sweep's run ids in its default
arm), plans them in a dry run, and resumes: with every run directory marked completed, nothing starts."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from predmask.rundir import write_status
from sweeps.families import expand
from sweeps.run_dirs import run_dir
from sweeps.submit import run_waves

ESTIMATORS = ("vr_acc", "vr_gml", "vr_likelihood")
TRACE_COUNTS = (1, 2, 4, 8, 16, 32)


def _kinds(specs: list) -> Counter:
    return Counter((spec.stage, spec.method) for spec in specs)


def _main_ids(seeds: int, data: str) -> dict[tuple, str]:
    """The main sweep's vr runs at the defaults: (stage, method, seed) -> run id."""
    specs = expand("variational_reasoning", [f"method={','.join(ESTIMATORS)}", f"method.data={data}",
                                             f"seeds={seeds}"])
    return {(s.stage, s.method, s.seed): s.run_id for s in specs}


def test_trace_count_sweep_is_k_1_to_32_crossed_with_the_three_estimators() -> None:
    specs = expand("vr_trace_count")
    seeds = sorted({s.seed for s in specs if s.stage != "prior"})
    assert seeds == [0, 1]
    kinds = _kinds(specs)
    assert kinds[("prior", "prior")] == 1 and kinds[("posterior", "posterior")] == len(seeds)  # one q_φ for every K
    assert kinds[("traces", "traces")] == kinds[("weights", "weights")] == len(TRACE_COUNTS) * len(seeds)
    assert all(kinds[("final", m)] == len(TRACE_COUNTS) * len(seeds) for m in ESTIMATORS)
    assert len(specs) == 1 + len(seeds) * (1 + len(TRACE_COUNTS) * (2 + len(ESTIMATORS)))
    finals = [s for s in specs if s.stage == "final"]
    assert {s.config["method"]["data"] for s in finals} == {"all_weighted"}
    by_id = {s.run_id: s for s in specs}
    per_seed_k = Counter((s.seed, by_id[s.inputs["traces"]].config["traces"]["k"]) for s in finals)
    assert per_seed_k == {(seed, k): len(ESTIMATORS) for seed in seeds for k in TRACE_COUNTS}
    # the K = 8 arm is the main sweep's runs (the same ids), so its settings are the family's defaults
    main = _main_ids(len(seeds), "all_weighted")
    def k_of(spec) -> int | None:  # a weights run or a final reads its K through its traces run
        traces = spec if spec.stage == "traces" else by_id.get(spec.inputs.get("traces", ""))
        return None if traces is None else traces.config["traces"]["k"]

    k8 = {(s.stage, s.method, s.seed): s.run_id for s in specs if k_of(s) in (None, 8)}
    assert k8 == main


def test_hint_use_sweep_is_both_arms_crossed_with_the_estimators_in_both_data_settings() -> None:
    specs = expand("vr_hint_use")
    seeds = sorted({s.seed for s in specs if s.stage != "prior"})
    assert seeds == [0, 1, 2]
    kinds = _kinds(specs)
    assert kinds[("prior", "prior")] == 1
    for stage in ("posterior", "traces", "weights"):
        assert kinds[(stage, stage)] == 2 * len(seeds), stage
    assert all(kinds[("final", m)] == 2 * 2 * len(seeds) for m in ESTIMATORS)
    assert len(specs) == 1 + len(seeds) * (3 * 2 + 2 * 2 * len(ESTIMATORS))
    assert {s.config["hint"]["use"] for s in specs if s.stage == "posterior"} == {True, False}
    by_id = {s.run_id: s for s in specs}

    def hinted(spec) -> bool | None:  # a final reads its hint setting through its traces run; the prior has none
        own = spec if "hint" in spec.config else by_id.get(spec.inputs.get("traces", ""))
        return None if own is None else own.config["hint"]["use"]

    on = {(s.stage, s.method, s.seed, s.config["method"].get("data")): s.run_id for s in specs
          if hinted(s) in (None, True)}
    main = {(s.stage, s.method, s.seed, s.config["method"].get("data")): s.run_id
            for s in expand("variational_reasoning", [f"method={','.join(ESTIMATORS)}", "seeds=3"])}
    assert on == main  # the hinted arm is the main sweep's runs


def test_trace_count_dry_run_plans_every_run(tmp_path: Path) -> None:
    env = {**os.environ, "PREDMASK_RUNS": str(tmp_path / "runs"), "PREDMASK_DB": str(tmp_path / "db.duckdb"),
           "PREDMASK_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "sweeps", "vr_trace_count", "--dry-run", "--format", "json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["summary"]["runs"].startswith("63 runs (1 prior, 2 posterior, 12 traces, 12 weights; "
                                                 "2 seeds x 18 finals)")
    assert {r["run_id"] for r in payload["runs"]} == {s.run_id for s in expand("vr_trace_count")}


@pytest.mark.parametrize("sweep", ["vr_trace_count", "vr_hint_use"])
def test_a_rerun_after_every_run_completed_starts_nothing(tmp_path: Path, sweep: str) -> None:
    """Real run directories marked completed by the project's own status writer; the wave runner then starts no
    job (a started one would need a base model and fail here)."""
    specs = expand(sweep)
    for spec in specs:
        path = run_dir(spec, tmp_path)
        path.mkdir(parents=True)
        write_status(path, "completed", 1, 1)
    ended: list[str] = []
    outcome = run_waves(specs, root=tmp_path, max_parallel=2, console=Console(file=io.StringIO()),
                        on_finished=lambda spec, _: ended.append(spec.run_id), resume="unused")
    assert sorted(outcome.skipped) == sorted(s.run_id for s in specs)
    assert not outcome.completed and not outcome.failed and not outcome.blocked and not ended
