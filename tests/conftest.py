"""Fixtures and hooks shared by every test folder: the emulated Slurm cluster (scripts/slurm-emulated.sh).

A test marked ``slurm`` (or using the ``slurm_cluster`` fixture) needs the cluster. When ``sinfo`` cannot reach it
those tests are skipped, except under ``CI=true``, where they fail: CI must start the cluster before the tests.
As an ordinary user the reason is the one line of ``NEEDS_ROOT`` (the cluster's daemons need root), printed once
after collection and given as every such test's skip reason.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PARTITION, NUM_NODES = "h20", 4
STATE_DIR = Path(os.environ.get("PREDMASK_SLURM_DIR", "/tmp/predmask-slurm"))
USABLE_STATES = {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing"}
NEEDS_ROOT = (
    "SLURM TESTS SKIPPED: the emulated Slurm cluster is not running and needs root to start munge and slurmd; "
    "to run them: sudo bash scripts/test.sh, or sudo bash scripts/slurm-emulated.sh start "
    f"&& export SLURM_CONF={STATE_DIR / 'slurm.conf'}"
)


#: the tests marked ``slow`` here besides those a test file marks itself (``@pytest.mark.slow``), one list for every
#: folder: a file with no test names marks each of its tests, a name one test (all its parameters);
#: ``scripts/test.sh -m "not slow and not slurm"`` is then the fast subset (README). Chosen from pytest's --durations
#: on this project's 2-core machine (each test here took over 5 s there, or its file over 10 s); each folder keeps
#: tests in the subset (tests/test_fast_subset.py).
_SLOW_TESTS: dict[str, tuple[str, ...]] = {
    "tests/analysis_accuracy_weighting/test_aw_cli.py": (),
    "tests/analysis_calibrate/test_calibrate.py": (
        "test_bad_input_is_one_line_and_writes_nothing",
        "test_calibrate_end_to_end_then_resumes_without_training",
    ),
    "tests/analysis_results/test_results_curves.py": ("test_validation_is_the_mean_of_both_aime_scores",),
    "tests/analysis_results/test_results_notebook.py": (),
    "tests/analysis_store/test_analysis_store_db_path.py": (
        "test_ingest_piped_prints_one_progress_line_per_run_and_names_the_next_command",
    ),
    "tests/analysis_store/test_analysis_store_reliability.py": (
        "test_a_full_disk_under_the_database_is_one_line_and_keeps_what_was_stored",
        "test_a_sqlite_file_as_the_database_of_reports_paper_is_one_line_and_exit_1",
    ),
    "tests/analysis_store/test_analysis_store_vr_weight_columns.py": (),
    "tests/bench/test_bench_entry.py": (),
    "tests/config/test_config.py": (
        "test_every_family_sweep_expands_to_runs_of_composed_configs",
        "test_every_option_of_every_group_composes_into_train",
    ),
    "tests/faults/test_faults_db_wait.py": ("test_ingest_cli_waits_for_a_reader_and_gives_up_in_one_line",),
    "tests/faults/test_faults_sweeps_causes.py": (),
    "tests/faults/test_faults_sweeps_damaged.py": (),
    "tests/reports/test_figures_text_placement.py": ("test_labels_inside_the_axes_off_the_bars_and_legible",),
    "tests/reports/test_reports_golden.py": (),
    "tests/reports/test_reports_output.py": ("test_empty_and_missing_database_give_one_clear_line",),
    "tests/reports/test_reports_page.py": (
        "test_a_page_with_empty_sections_renders",
        "test_missing_database_says_what_to_run_first",
        "test_missing_database_with_run_directories_says_ingest",
    ),
    "tests/reports/test_reports_same_tokens.py": ("test_the_figures_render_without_warnings",),
    "tests/reports/test_reports_value_sources.py": (),
    "tests/reports/test_variational_gate.py": (
        "test_the_fixture_database_fires_the_gate_in_every_vr_artefact",
    ),
    "tests/reports/test_variational_reports.py": ("test_every_artefact_is_written_and_valid",),
    "tests/rl/test_rl_trackers.py": (),
    "tests/rl/test_rl_train.py": (
        "test_a_bad_config_exits_2_in_one_line_and_creates_no_run_dir",
        "test_cli_bad_input_is_one_line",
    ),
    "tests/rl/test_rl_validation_cache.py": ("test_a_changed_input_misses_the_cache",),
    "tests/rundir/test_rundir_project_root.py": (),
    "tests/slurm/test_slurm_executor.py": (
        "test_command_job_on_the_local_executor_records_its_exit_status",
        "test_follow_reports_every_job_once_with_its_result_its_error_or_its_death",
    ),
    "tests/sweeps/test_data_bespoke.py": (),
    "tests/sweeps/test_paper_plan.py": (
        "test_ctrl_c_passes_one_sigint_to_the_step_and_exits_130_with_one_line",
        "test_steps_run_in_order_stop_at_the_first_failure_and_resume",
    ),
    "tests/sweeps/test_plan_warnings.py": (),
    "tests/sweeps/test_sweeps_compose.py": (),
    "tests/sweeps/test_sweeps_plan.py": (),
    "tests/sweeps/test_sweeps_runs.py": (),
    "tests/sweeps/test_sweeps_seeds.py": (),
    "tests/sweeps/test_sweeps_status.py": (),
    "tests/sweeps/test_sweeps_validate.py": (
        "test_a_run_its_trainer_would_refuse_is_refused_before_anything_is_written",
        "test_from_the_command_line_it_exits_2_with_one_line",
    ),
    "tests/sweeps/test_sweeps_wall_clock.py": (),
    "tests/sweeps/test_variational_ablations.py": (),
    "tests/sweeps/test_variational_sweep.py": (
        "test_cluster_dry_run_lists_the_rft_samples_and_eval_stages_with_their_commands",
        "test_dry_run_json_lists_every_stage_with_its_command",
        "test_on_the_cluster_rft_reads_pi_theta0_samples_and_every_model_has_an_eval_run",
    ),
    "tests/test_extension_points.py": (
        "test_the_copy_without_edits_is_the_project_itself",
        "test_a_method_is_one_registration_and_its_config_file",
        "test_a_sweep_is_one_config_file",
        "test_a_figure_or_a_table_is_one_declared_function",
        "test_a_variational_estimator_is_one_registration_and_its_recipe_file",
    ),
    "tests/test_fast_subset.py": ("test_the_fast_subset_keeps_tests_of_every_folder",),
    "tests/token_level/test_token_level_cli.py": (),
    "tests/token_level/test_token_level_drift.py": (
        "test_a_tiny_grid_runs_into_duckdb_links_cells_to_studies_and_resumes",
        "test_the_grid_expands_to_every_combination_with_distinct_study_ids",
    ),
    "tests/variational/test_pipeline.py": (),
    "tests/variational/test_stage_errors.py": (
        "test_a_missing_upstream_output_names_the_stage_the_path_and_the_fix",
    ),
    "tests/verl/test_verl_data.py": (),
    "tests/verl/test_verl_free.py": (),
    "tests/verl/test_verl_overrides.py": (
        "test_golden_command_lines",
        "test_overrides_compose_with_verl_config",
        "test_the_cluster_configs_follow_verls_dppo_recipe",
    ),
    "tests/verl/test_vr_cluster.py": (),
}
SLOW: frozenset[str] = frozenset(
    f"{file}::{test}" if test else file for file, tests in _SLOW_TESTS.items() for test in tests or ("",)
)


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _unavailable(reason: str) -> None:
    if _under_ci():
        pytest.fail(f"CI=true but the Slurm tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def _needs_cluster(item: pytest.Item) -> bool:
    return item.get_closest_marker("slurm") is not None or "slurm_cluster" in getattr(item, "fixturenames", ())


@functools.cache
def _cluster_reason() -> str | None:
    """Why the Slurm tests cannot run (NEEDS_ROOT for an ordinary user), or None; asked once per session."""
    problem = _cluster_problem()
    if problem and os.geteuid() != 0:
        return NEEDS_ROOT
    return problem


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of ``SLOW`` slow, and every test that needs the cluster (its fixture) ``slurm``."""
    for item in items:
        if item.nodeid.split("::")[0] in SLOW or item.nodeid.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Say once, before the tests run, that the selected Slurm tests will skip and why."""
    if not any(_needs_cluster(item) for item in session.items) or _cluster_reason() is None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = _cluster_reason() if not _under_ci() else f"CI=true: the Slurm tests will fail: {_cluster_reason()}"
    if reporter is not None:
        reporter.write_line(line, yellow=True, bold=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slurm") is not None and _cluster_reason() is not None:
        _unavailable(_cluster_reason())  # type: ignore[arg-type]


def _cluster_problem() -> str | None:
    """None when the emulated cluster answers with 4 usable nodes, else why not (sets SLURM_CONF)."""
    if shutil.which("sinfo") is None:
        return "slurm-wlm is not installed (no sinfo); run scripts/slurm-emulated.sh start"
    if not os.environ.get("SLURM_CONF"):
        conf = STATE_DIR / "slurm.conf"
        if not conf.exists():
            return f"the emulated Slurm cluster is not running ({conf} missing): run scripts/slurm-emulated.sh start"
        os.environ["SLURM_CONF"] = str(conf)
    if not Path(os.environ["SLURM_CONF"]).is_file():
        return f"SLURM_CONF={os.environ['SLURM_CONF']} does not exist: run scripts/slurm-emulated.sh start"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %t"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    if out.returncode != 0:
        return f"sinfo failed ({out.stderr.strip().splitlines()[-1:]}): run scripts/slurm-emulated.sh start"
    usable = {
        line.split()[0]
        for line in out.stdout.splitlines()
        if line.split()[1:2] and line.split()[1] in USABLE_STATES
    }
    if len(usable) < NUM_NODES:
        return (
            f"partition {PARTITION} has {len(usable)} usable nodes, need {NUM_NODES}: {out.stdout.strip()!r}"
        )
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, Any]:
    """The running emulated cluster (skip, or fail under CI=true, when it is not up or ray is missing)."""
    problem = _cluster_reason()
    if problem:
        _unavailable(problem)
    try:
        import ray  # noqa: F401
    except ImportError:
        _unavailable("ray is not installed (pip install 'ray>=2.40')")
    logging.getLogger("submitit").setLevel(logging.ERROR)  # sacct is unavailable here: no accounting storage
    return {
        "slurm_conf": os.environ["SLURM_CONF"],
        "partition": PARTITION,
        "nodes": NUM_NODES,
        "gpus_per_node": 8,
    }


@pytest.fixture
def float64_default() -> Iterator[None]:
    """torch's default dtype float64 for the test (closed-form checks), restored afterwards so no other test
    inherits it; use with ``pytestmark = pytest.mark.usefixtures("float64_default")``."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    """``tmpfs(size_mib) -> Path``: a real size-limited tmpfs under ``tmp_path``, unmounted after the test. Mounting
    needs root: without it the test is skipped with the reason; under CI=true (root on a fresh machine) a mount that
    cannot be made fails the test, as the Slurm tests do."""
    mounted: list[Path] = []

    def mount(size_mib: int) -> Path:
        why = None if os.geteuid() == 0 else "mounting a size-limited tmpfs needs root; run the tests as root"
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        if why is None:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)],
                                  capture_output=True, text=True, check=False)
            why = f"mounting a tmpfs failed here: {done.stderr.strip()}" if done.returncode else None
        if why is not None:
            if _under_ci():
                pytest.fail(f"CI=true but the full-disk test cannot run: {why}", pytrace=False)
            pytest.skip(why)
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in reversed(mounted):
        subprocess.run(["umount", "-l", str(mnt)], check=False)
