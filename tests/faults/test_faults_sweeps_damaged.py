"""Damaged run directories and links out of the runs root, with real files and real `python -m sweeps` processes:
`status` shows each damaged run as one line ``damaged: <file>, <what>`` and goes on with the others (a truncated
status.json is never shown as running), and a dry run whose folder is a symlink out of the runs root is refused in
one line with every file behind the link left as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.store import connect
from predmask.rundir import write_status
from sweeps.families import expand
from sweeps.run_dirs import read_state, run_dir, write_planned_config

REPO = Path(__file__).resolve().parents[2]


def _sweeps(tmp: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREDMASK_RUNS": str(tmp / "runs")}
    return subprocess.run([sys.executable, "-m", "sweeps", *argv], cwd=tmp, capture_output=True, text=True,
                          timeout=300, check=False, env=env)


def test_status_shows_damaged_runs_in_one_line_each_and_the_others_as_they_are(tmp_path: Path) -> None:
    good, as_list, cut, bad_config = expand("smoke", [])[:4]
    paths = [run_dir(spec, tmp_path / "runs") for spec in (good, as_list, cut, bad_config)]
    for spec, path in zip((good, as_list, cut, bad_config), paths, strict=True):
        path.mkdir(parents=True)
        write_planned_config(path, spec)
    write_status(paths[0], "completed", 6, 6)
    (paths[1] / "status.json").write_text("[]\n")
    whole = json.dumps({"status": "running", "step": 3, "total_steps": 6, "updated": 1.0, "error": None})
    (paths[2] / "status.json").write_text(whole[: len(whole) // 2])  # cut short mid-write
    write_status(paths[3], "failed", 2, 6, "boom")
    planned = paths[3] / "planned_config.yaml"
    planned.write_text(planned.read_text()[:40])  # cut short: no final newline

    assert read_state(paths[2]).status == "damaged"  # never "running" (no writer could be holding it forever)
    done = _sweeps(tmp_path, "status", "smoke")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    rows = {cells[2]: cells for line in lines if len(cells := [c.strip() for c in line.split("│")]) > 9}
    assert rows[good.run_id][8:10] == ["completed", "6/6"]
    assert rows[as_list.run_id][8] == rows[cut.run_id][8] == rows[bad_config.run_id][8] == "damaged"
    assert rows[bad_config.run_id][3] == "?"  # its config cannot say its method
    assert f"smoke {as_list.run_id}: damaged: status.json, a JSON list, not an object" in lines
    assert any(line.startswith(f"smoke {cut.run_id}: damaged: status.json, not JSON (") for line in lines)
    assert any(line.startswith(f"smoke {bad_config.run_id}: damaged: planned_config.yaml, truncated")
               for line in lines)
    assert lines[-1].startswith("smoke: 3 not completed (3 damaged); next: rerun the sweep's own command")


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_dry_run_folder_linked_out_of_the_runs_root_is_refused_and_nothing_behind_it_changes(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("must survive\n")
    (outside / "plan.json").write_text("{}\n")
    before = _tree(outside)
    sweep_dir = tmp_path / "runs" / "smoke"
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "dry-run").symlink_to(outside, target_is_directory=True)

    done = _sweeps(tmp_path, "smoke", "method=dppo_topk_kl", "--dry-run")
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line == (f"error: {sweep_dir / 'dry-run'} leads out of the runs root {tmp_path / 'runs'} (to {outside}); "
                    "nothing written or deleted: remove that link, or choose another --runs-root")
    assert _tree(outside) == before and sorted(p.name for p in sweep_dir.iterdir()) == ["dry-run"]

    (sweep_dir / "dry-run").unlink()  # the sweep folder itself linked out: refused the same way
    sweep_dir.rmdir()
    sweep_dir.symlink_to(outside, target_is_directory=True)
    done = _sweeps(tmp_path, "smoke", "method=dppo_topk_kl", "--dry-run")
    assert done.returncode == 2 and "leads out of the runs root" in done.stderr and len(done.stderr.splitlines()) == 1
    assert _tree(outside) == before

    sweep_dir.unlink()  # a plain folder: the dry run writes there, inside the root
    done = _sweeps(tmp_path, "smoke", "method=dppo_topk_kl", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert (sweep_dir / "dry-run" / "plan.json").is_file() and _tree(outside) == before


@pytest.mark.slow
def test_a_sweep_reports_damaged_runs_and_goes_on_with_the_others(tmp_path: Path) -> None:
    """A real two-run local sweep: one run's status.json is ``[]`` (it is reported and run again: it completes), the
    other's config.yaml is cut short (its trainer refuses it: reported as failed with its damaged line); no traceback
    in the sweep's output, the good run completed and stored."""
    args = ["smoke", "method=dppo_topk_kl,grpo_clip_higher", "trainer.steps=2", "trainer.val_every=2",
            "trainer.save_every=2", "trainer.val_n=2", "base.steps=40", "base.eval_problems=16", "task.eval_size=8",
            "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "rollout.n=4"]
    listed, cut = expand(args[0], args[1:])
    runs = tmp_path / "runs"
    for spec in (listed, cut):
        run_dir(spec, runs).mkdir(parents=True)
        write_planned_config(run_dir(spec, runs), spec)
    (run_dir(listed, runs) / "status.json").write_text("[]\n")
    config = run_dir(cut, runs) / "config.yaml"
    config.write_text((run_dir(cut, runs) / "planned_config.yaml").read_text()[:60])
    write_status(run_dir(cut, runs), "failed", 0, 2, "killed")

    env = {**os.environ, "PYTHONPATH": str(REPO), "PREDMASK_RUNS": str(runs), "PREDMASK_CACHE": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "sweeps", *args, "--db", str(tmp_path / "db.duckdb")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Traceback" not in out
    assert (f"run {listed.run_id}: damaged: status.json, a JSON list, not an object; started again (it resumes from "
            "its checkpoints)") in done.stdout
    (failed,) = [ln for ln in done.stdout.splitlines() if ln.startswith(f"failed {cut.run_id}: ")]
    assert "damaged: " in failed and "config.yaml" in failed
    assert read_state(run_dir(listed, runs)).status == "completed"
    assert "1 completed, 0 already done, 1 failed" in done.stdout
    con = connect(tmp_path / "db.duckdb", read_only=True)
    try:
        stored = con.execute("SELECT run_id, status FROM runs WHERE status = 'completed'").fetchall()
    finally:
        con.close()
    assert stored == [(listed.run_id, "completed")]


def test_the_sweep_lock_and_a_job_log_linked_out_of_the_root_are_refused_and_their_targets_kept(
        tmp_path: Path) -> None:
    """The sweep lock is truncated when taken and a job's log appended to: through a link either would change a file
    outside the runs root. Both are refused (the lock in one SweepError line, the log by the OS: ELOOP)."""
    import errno

    from launch.command_job import CommandJob
    from sweeps.compose import SweepError
    from sweeps.run_dirs import sweep_lock

    outside = tmp_path / "elsewhere.txt"
    outside.write_text("must survive\n")
    sweep_dir = tmp_path / "runs" / "s"
    (sweep_dir / "r1").mkdir(parents=True)
    (sweep_dir / ".sweep.lock").symlink_to(outside)
    with pytest.raises(SweepError, match=r"\.sweep\.lock is a symlink \(to .*elsewhere\.txt\); nothing written"), \
            sweep_lock(sweep_dir):
        pass
    (sweep_dir / "r1" / "job.log").symlink_to(outside)
    job = CommandJob(command=[sys.executable, "-c", "print('written')"], run_dir=str(sweep_dir / "r1"),
                     log_file=str(sweep_dir / "r1" / "job.log"))
    with pytest.raises(OSError) as err:
        job._run_command(extra_env={})  # the job's own step that opens the log (no submitit job around it here)
    assert err.value.errno == errno.ELOOP
    assert outside.read_text() == "must survive\n"

    (sweep_dir / ".sweep.lock").unlink()  # a plain lock file and log: taken and written as before
    with sweep_lock(sweep_dir):
        assert (sweep_dir / ".sweep.lock").read_text().startswith("pid ")
    (sweep_dir / "r1" / "job.log").unlink()
    assert job._run_command(extra_env={}) == 0
    assert (sweep_dir / "r1" / "job.log").read_text() == "written\n"


@pytest.mark.parametrize(("text", "line"), [
    ("", "damaged: status.json, empty; allowed: a JSON object written by predmask.rundir.write_status"),
    ('{"status": "completed", "step": "six", "total_steps": 6}', "damaged: status.json, step 'six' is not a whole number"),
    ('{"status": "completed", "step": 6, "total_steps": 2.5}', "damaged: status.json, total_steps 2.5 is not a whole number"),
    ("[]", "damaged: status.json, a JSON list, not an object"),
])
def test_a_status_json_that_is_not_what_write_status_writes_reads_as_damaged(tmp_path: Path, text: str,
                                                                             line: str) -> None:
    (tmp_path / "status.json").write_text(text)
    state = read_state(tmp_path)
    assert (state.status, state.error) == ("damaged", line)
    write_status(tmp_path, "completed", 6, 6)  # rewritten by its writer: read as it says again
    assert (read_state(tmp_path).status, read_state(tmp_path).step) == ("completed", 6)
