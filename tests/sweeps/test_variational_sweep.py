"""The variational-reasoning sweep family: expansion into its stage chain (counts, stable ids, the ids that a
changed setting does and does not move, inputs naming real sibling runs), one-line errors, the dry run, and a
real tiny sweep end to end through the local executor into a real DuckDB file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import duckdb
import pytest
import yaml

from sweeps.compose import SweepError
from sweeps.families import expand
from sweeps.vr_chain import waves

SWEEP = "variational_reasoning"
RECIPES = ["sft", "rft", "vr_acc", "vr_gml", "vr_likelihood", "grpo"]


def _by_kind(specs: list) -> dict[tuple[str | None, str, str | None, int], str]:
    """(stage, method, method.data, seed) -> run id."""
    out = {}
    for spec in specs:
        data = spec.config["method"].get("data") if spec.stage == "final" else None
        key = (spec.stage, spec.method, data, spec.seed)
        assert key not in out, f"two runs for {key}"
        out[key] = spec.run_id
    return out


def test_full_sweep_has_one_prior_and_per_seed_three_stages_and_nine_finals() -> None:
    specs = expand(SWEEP)
    kinds = Counter((spec.stage, spec.method) for spec in specs)
    assert kinds[("prior", "prior")] == 1
    for stage in ("posterior", "traces", "weights"):
        assert kinds[(stage, stage)] == 3
    for vr in ("vr_acc", "vr_gml", "vr_likelihood"):
        assert kinds[("final", vr)] == 6  # both data settings x 3 seeds
    assert kinds[("final", "sft")] == kinds[("final", "rft")] == kinds[(None, "grpo")] == 3
    assert len(specs) == 1 + 3 * (3 + 9)
    assert len({spec.run_id for spec in specs}) == len(specs)
    assert sorted({spec.seed for spec in specs}) == [0, 1, 2]
    # the grpo final: an ordinary train run, steps x batch = the same first data.questions problems
    grpo = next(spec for spec in specs if spec.method == "grpo")
    assert grpo.stage is None and grpo.config["trainer"]["train_batch_size"] == 16
    assert grpo.config["trainer"]["steps"] * 16 == 1024 and "method=grpo" in grpo.overrides


def test_ids_are_stable_and_inputs_point_at_sibling_runs() -> None:
    first, again = expand(SWEEP, ["seeds=1"]), expand(SWEEP, ["seeds=1"])
    assert [s.run_id for s in first] == [s.run_id for s in again]
    ids = {spec.run_id: spec for spec in first}
    expected = {"prior": set(), "posterior": set(), "traces": {"posterior"}, "weights": {"prior", "traces"}}
    for spec in first:
        for stage, run_id in spec.inputs.items():
            assert ids[run_id].stage == stage  # each input is a run of the named stage in the same sweep
        if spec.stage in expected:
            assert set(spec.inputs) == expected[spec.stage]
        if spec.stage == "final":
            assert set(spec.inputs) == ({"traces", "weights"} if spec.method.startswith("vr_") else set())
    # waves: every run comes after every run it reads
    seen: set[str] = set()
    for wave in waves(first):
        assert all(rid in seen for spec in wave for rid in spec.inputs.values())
        seen |= {spec.run_id for spec in wave}
    # a stage config keeps only its own sections
    posterior = next(s for s in first if s.stage == "posterior")
    assert {"final", "eval", "rft", "traces", "weights"}.isdisjoint(posterior.config)
    assert posterior.config["method"]["name"] == "posterior" and posterior.precision == "fp32"
    assert posterior.delta is None


def test_a_changed_final_setting_keeps_every_upstream_id() -> None:
    base = _by_kind(expand(SWEEP, ["seeds=1"]))
    changed = _by_kind(expand(SWEEP, ["seeds=1", "final.epochs=2"]))
    assert changed.keys() == base.keys()
    for key, run_id in base.items():
        is_final = key[0] == "final" or key[1] == "grpo"  # grpo: final.epochs sets its steps
        assert (changed[key] != run_id) == is_final, key


def test_a_changed_posterior_setting_changes_everything_downstream_only() -> None:
    base = _by_kind(expand(SWEEP, ["seeds=1"]))
    changed = _by_kind(expand(SWEEP, ["seeds=1", "posterior.epochs=3"]))
    for key, run_id in base.items():
        downstream = key[0] in ("posterior", "traces", "weights") or key[1].startswith("vr_")
        assert (changed[key] != run_id) == downstream, key


def test_method_axis_and_data_axis_restrict_the_finals() -> None:
    specs = expand(SWEEP, ["method=sft,vr_acc", "method.data=best_mixed", "seeds=[0,4]"])
    kinds = Counter((spec.stage, spec.method, spec.config["method"].get("data")) for spec in specs)
    assert kinds == Counter({("prior", "prior", None): 1, ("posterior", "posterior", None): 2,
                             ("traces", "traces", None): 2, ("weights", "weights", None): 2,
                             ("final", "sft", None): 2, ("final", "vr_acc", "best_mixed"): 2})
    assert {spec.seed for spec in specs if spec.stage != "prior"} == {0, 4}
    # sft alone reads no stage run; the prior still runs (pi_theta0's evaluation, the baseline); grpo alone: itself
    assert [spec.method for spec in expand(SWEEP, ["method=sft", "seeds=1"])] == ["prior", "sft"]
    assert [spec.method for spec in expand(SWEEP, ["method=grpo", "seeds=1"])] == ["grpo"]


@pytest.mark.parametrize(("override", "needle"), [
    ("method=sfft", "unknown method 'sfft'; valid: "),
    ("method.data=best", "unknown method.data 'best'; valid: "),
    ("data.questons=16", "unknown config key 'data.questons'"),
    ("model=cpu_xxl", "unknown model 'cpu_xxl'; valid: "),
    ("seeds=0", "seeds must be"),
])
def test_bad_overrides_are_one_line(override: str, needle: str) -> None:
    with pytest.raises(SweepError) as err:
        expand(SWEEP, [override])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_grpo_needs_whole_batches_of_questions() -> None:
    with pytest.raises(SweepError, match=r"data.questions \(20\) to be a multiple of sft.questions_per_step \(16\)"):
        expand(SWEEP, ["data.questions=20", "seeds=1"])


def _env(tmp: Path, cache: bool = True) -> dict[str, str]:
    """The sweep's environment; ``cache=False`` leaves the base-model cache at its default (results/cache under
    the working directory), as on a fresh clone."""
    env = {**os.environ, "PREDMASK_DB": str(tmp / "db.duckdb"), "PREDMASK_RUNS": str(tmp / "runs"),
           "PREDMASK_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}
    if not cache:
        del env["PREDMASK_CACHE"]
    return env


def _sweeps(tmp: Path, *args: str, timeout: float = 900, cache: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sweeps", *args], cwd=tmp, env=_env(tmp, cache),
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_dry_run_json_lists_every_stage_with_its_command(tmp_path: Path) -> None:
    out = _sweeps(tmp_path, "variational_reasoning_smoke", "--dry-run", "--format", "json", timeout=300)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["summary"]["runs"].startswith("13 runs") and payload["summary"]["jobs"] == 13
    runs = payload["runs"]
    ids = {rec["run_id"] for rec in runs}
    for rec in runs:
        if rec.get("stage") is not None:
            assert rec["command"][1:3] == ["-m", "predmask.rl.vr_runner"]
            assert Path(rec["command"][3]).name == rec["run_id"]
            assert set(rec["inputs"].values()) <= ids
        else:
            assert rec["method"] == "grpo" and rec["command"][1:3] == ["-m", "predmask.rl.train"]
    assert (tmp_path / "runs" / "variational_reasoning_smoke" / "dry-run" / "plan.json").exists()
    assert not list((tmp_path / "runs" / "variational_reasoning_smoke").glob("*/config.yaml"))  # nothing run


CLUSTER = ["cluster=h20_4x8", "model=qwen3_4b_base"]


def test_on_the_cluster_rft_reads_pi_theta0_samples_and_every_model_has_an_eval_run() -> None:
    specs = expand(SWEEP, CLUSTER)
    by_id = {spec.run_id: spec for spec in specs}
    kinds = Counter((spec.stage, spec.method) for spec in specs)
    seeds = sorted({spec.seed for spec in specs})
    assert kinds[("prior", "prior")] == kinds[("eval", "prior")] == 1
    assert kinds[("rft_samples", "rft_samples")] == len(seeds)
    finals = [spec for spec in specs if spec.stage == "final"]
    evals = [spec for spec in specs if spec.stage == "eval" and spec.method != "prior"]
    assert sorted(by_id[e.inputs["final"]].run_id for e in evals) == sorted(f.run_id for f in finals)
    for e in evals:  # an eval run carries its final's method (recipe, data setting), seed and eval settings
        final = by_id[e.inputs["final"]]
        assert (e.config["method"], e.seed, e.config["eval"]) == (final.config["method"], final.seed,
                                                                  final.config["eval"])
    prior = next(spec for spec in specs if spec.stage == "prior")
    assert next(spec for spec in specs if spec.stage == "eval" and spec.method == "prior").inputs == {
        "prior": prior.run_id}
    for rft in (f for f in finals if f.method == "rft"):
        samples = by_id[rft.inputs["rft_samples"]]
        assert set(rft.inputs) == {"rft_samples"} and samples.stage == "rft_samples" and samples.seed == rft.seed
        assert samples.inputs == {"prior": prior.run_id}
    order = [spec.run_id for wave in waves(specs) for spec in wave]
    for spec in specs:  # every run after the runs it reads
        assert all(order.index(rid) < order.index(spec.run_id) for rid in spec.inputs.values())
    # the CPU engine's chain has neither stage (its rft final samples and its models evaluate inside their runs)
    assert not {spec.stage for spec in expand(SWEEP)} & {"rft_samples", "eval"}


def test_cluster_dry_run_lists_the_rft_samples_and_eval_stages_with_their_commands(tmp_path: Path) -> None:
    out = _sweeps(tmp_path, "variational_reasoning_smoke", *CLUSTER, "cluster.check_paths=false", "--dry-run",
                  "--format", "json", timeout=300)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    runs = payload["runs"]
    # 1 prior, posterior, traces, weights, rft_samples + 9 finals (8 variational + grpo) + 9 evals (prior + 8)
    assert payload["summary"]["runs"].startswith("23 runs (1 prior, 1 posterior, 1 traces, 1 weights, "
                                                 "1 rft_samples, 9 eval; 1 seed x 9 finals)")
    modes = Counter(rec["command"][3] for rec in runs if rec["command"][2] == "predmask.verl.vr_sample")
    assert modes == {"traces": 1, "weights": 1, "rft": 1, "eval": 9}
    by_id = {rec["run_id"]: rec for rec in runs}
    for rec in runs:
        command = rec["command"]
        if command[2:4] == ["predmask.verl.vr_sample", "eval"]:
            (source,) = rec["inputs"].values()
            model = command[command.index("--model") + 1]
            assert model == str(Path(model).parent.parent / source / "checkpoints")
            assert [command[i + 1].rsplit("/", 1)[1] for i, a in enumerate(command) if a == "--eval-file"] == [
                "aime24.parquet", "aime25.parquet"]
            assert int(command[command.index("--max-num-batched-tokens") + 1]) > 0
        if command[2:4] == ["predmask.verl.vr_sample", "rft"]:
            assert by_id[rec["inputs"]["prior"]]["command"][2] == "predmask.verl.vr_sft"
    rft = next(r for r in runs if r.get("stage") == "final" and r["method"] == "rft")
    assert "predmask.recipe=rft" in rft["command"] and rft["command"][2] == "predmask.verl.vr_sft"


# test sizes (as tests/variational's own): a model much smaller than cpu_s, a 40-step base model, 16 questions
TINY = [
    "model.name=vr_tiny", "model.label='vr_tiny: test-sized stand-in model, not a real model'",
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "base.steps=40", "base.batch_size=16", "base.eval_problems=8",
    "task.eval_size=3", "data.questions=16", "traces.k=3", "weights.m=3", "eval.n=4", "rft.samples=3",
    "sft.questions_per_step=4", "sft.save_every=2", "sft.warmup=2", "posterior.epochs=1", "final.epochs=1",
    "trainer.val_n=2", "trainer.val_every=2", "trainer.save_every=2", "rollout.n=4",
]


@pytest.mark.slow
def test_tiny_sweep_end_to_end_every_run_completed_and_in_the_database(tmp_path: Path) -> None:
    args = ["variational_reasoning_smoke", "method=sft,vr_acc,grpo", "method.data=best_mixed", *TINY]
    out = _sweeps(tmp_path, *args, cache=False)  # the default, relative cache: one base model for every run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(list(tmp_path.rglob("base-*.pt"))) == 1, sorted(tmp_path.rglob("base-*.pt"))
    assert list((tmp_path / "results" / "cache").glob("base-*.pt"))
    assert "7 runs" in out.stdout and "7 completed, 0 already done, 0 failed" in out.stdout
    assert "(target <= 3 min on 2 cores)" in out.stdout
    assert "next: " in out.stdout and "analysis accuracy_weighting" in out.stdout
    assert "reports variational" in out.stdout
    sweep = tmp_path / "runs" / "variational_reasoning_smoke"
    dirs = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith((".", "dry"))]
    assert len(dirs) == 7
    for d in dirs:
        assert json.loads((d / "status.json").read_text())["status"] == "completed", d
    stages = {d.name: yaml.safe_load((d / "planned_config.yaml").read_text()).get("stage") for d in dirs}
    for d in dirs:
        if stages[d.name] is not None:  # the sweep wrote a stage run's config.yaml, inputs = sibling ids
            cfg = yaml.safe_load((d / "config.yaml").read_text())
            assert all((sweep / rid).is_dir() for rid in cfg["inputs"].values())
    con = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    try:
        rows = dict(con.execute("SELECT run_id, status FROM runs").fetchall())
        methods = {m for (m,) in con.execute("SELECT method FROM runs").fetchall()}
    finally:
        con.close()
    assert rows == {d.name: "completed" for d in dirs}
    assert {"prior", "posterior", "traces", "weights", "sft", "vr_acc", "grpo"} <= methods

    again = _sweeps(tmp_path, *args, cache=False)  # a rerun skips every completed run
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "0 completed, 7 already done, 0 failed" in again.stdout

    status = _sweeps(tmp_path, "status", "variational_reasoning_smoke", timeout=300)
    assert status.returncode == 0, status.stderr
    shown = {line.split("│")[2].strip(): line.split("│")[3].strip() for line in status.stdout.splitlines()
             if line.count("│") >= 9 and line.split("│")[2].strip() in rows}
    assert len(shown) == 7 and "(posterior)" in shown.values() and "vr_acc best_mixed" in shown.values()
    assert "every run completed; next: " in status.stdout and "reports variational" in status.stdout


@pytest.mark.slow
def test_a_failed_upstream_stops_its_dependents_with_the_resume_command(tmp_path: Path) -> None:
    """The base-model cache is a plain file, so every stage that loads the base model really fails; the runs that
    read a failed run are not started, and their lines name it and the command that resumes."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be\n")
    args = ["variational_reasoning_smoke", "method=vr_acc", "method.data=best_mixed", *TINY, f"cache_dir={blocker}"]
    out = _sweeps(tmp_path, *args, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    specs = {s.stage: s for s in expand(*args[:1], args[1:])}
    assert set(specs) == {"prior", "posterior", "traces", "weights", "final"}
    lines = out.stdout.splitlines()
    failed = {line.split()[1].rstrip(":") for line in lines if line.startswith("failed ")}
    blocked = {line.split()[2].rstrip(":"): line for line in lines if line.startswith("not started ")}
    assert {specs["prior"].run_id, specs["posterior"].run_id} <= failed
    assert set(blocked) == {specs["traces"].run_id, specs["weights"].run_id, specs["final"].run_id}
    assert f"its input run {specs['posterior'].run_id}" in blocked[specs["traces"].run_id]
    assert "did not run" in blocked[specs["final"].run_id]
    assert all("resume with: " in line and "-m sweeps variational_reasoning_smoke" in line for line in blocked.values())
    sweep = tmp_path / "runs" / "variational_reasoning_smoke"
    assert not (sweep / specs["final"].run_id).exists()  # a blocked run writes nothing


def test_the_cluster_path_check_lists_the_evaluation_aime_files(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Real files: with the Bespoke-Stratos files and the model in place, the AIME files the eval runs read are
    still missing, and the check names the first of them with the command that prepares it; once written, it
    passes. No grpo final here: its own validation reads the AIME files (and was checked before)."""
    from predmask.verl.vr_cluster import VR_DATA_FILES
    from sweeps.plan import check_paths, input_paths

    monkeypatch.setenv("PREDMASK_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PREDMASK_MODEL_ROOT", str(tmp_path / "models"))
    specs = expand("variational_reasoning_smoke", [*CLUSTER, "method=sft,vr_acc"])
    for name in VR_DATA_FILES.values():
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).write_bytes(b"prepared")
    (tmp_path / "models" / "Qwen3-4B-Base").mkdir(parents=True)
    aime = [tmp_path / "data" / f"{split}.parquet" for split in ("aime24", "aime25")]
    evals = [spec for spec in specs if spec.stage == "eval"]
    assert evals and all({str(p) for p in aime} <= {item.path for item in input_paths(spec)} for spec in evals)
    stages = [s for s in specs if s.stage != "eval"]
    assert stages and not any(str(aime[0]) in {item.path for item in input_paths(s)} for s in stages)
    with pytest.raises(SweepError) as err:
        check_paths(specs)
    assert str(err.value) == (f"data path {aime[0]} does not exist: python -m sweeps.datasets prepare "
                              f"--out {tmp_path / 'data'} (1 more missing path: see --dry-run); nothing submitted "
                              "(cluster.check_paths=false skips this check)")
    for path in aime:
        path.write_bytes(b"prepared")
    check_paths(specs)
