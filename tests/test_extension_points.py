"""docs/architecture.md's "Where to add" holds: each addition is made in a fresh copy of the project in exactly the
files its bullet names (nothing else is touched), and the project's own commands, run from the copy in real
subprocesses, pick it up by name: the sweep runner, the CPU engine's loss, verl's policy-loss registry, the report.

A case fails when the page names a file that is not enough (another file must learn the new name) or names files
the addition does not need; the page and these cases are read together (``test_the_page_names_every_file_a_case_edits``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
NEW = "newcomer"  # every added thing's name contains it; the page spells it <name>


@dataclass(frozen=True)
class Edit:
    """Add ``text`` to ``path`` (relative to the project): a new file, else before the first line starting with
    ``before``, else at the end."""

    path: str
    text: str
    before: str | None = None


def where_to_add() -> dict[str, str]:
    """The page's "Where to add" bullets: the bold title (``A method``) -> the bullet's text."""
    section = PAGE.read_text(encoding="utf-8").split("## Where to add", 1)[1].split("\n## ", 1)[0]
    bullet = re.compile(r"^- \*\*(.+?)\*\*:(.*?)(?=^- \*\*|\Z)", re.MULTILINE | re.DOTALL)
    return {m.group(1): m.group(2) for m in bullet.finditer(section)}


def named_by(bullet: str, path: str) -> bool:
    """Whether the bullet names ``path``: as written, with its new name as ``<name>``, or a folder above it."""
    names = set(re.findall(r"`([^`]+)`", bullet))
    generic = re.sub(rf"[a-z_]*{NEW}[a-z_]*", "<name>", path)
    return bool({path, generic} & names) or any(n.endswith("/") and path.startswith(n) for n in names)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's files as git sees them (tracked, and untracked ones it does not ignore), copied once."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    out = tmp_path_factory.mktemp("pristine") / "project"
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out / rel)
    return out


def apply(pristine: Path, where: Path, edits: tuple[Edit, ...]) -> Path:
    """A copy of the project at ``where`` with ``edits`` made; refuses an anchor the file lacks."""
    project = where / "project"
    shutil.copytree(pristine, project)
    for e in edits:
        target = project / e.path
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(e.text, encoding="utf-8")
            continue
        lines = target.read_text(encoding="utf-8").splitlines(keepends=True)
        at = len(lines) if e.before is None else next(
            (i for i, line in enumerate(lines) if line.startswith(e.before)), None)
        assert at is not None, f"{e.path} has no line starting with {e.before!r}"
        target.write_text("".join(lines[:at]) + e.text + "".join(lines[at:]), encoding="utf-8")
    return project


def run(project: Path, *args: str, timeout: float = 240) -> str:
    """``python ARGS`` from the copy, with its own runs root and database; its stdout (stderr shown on failure)."""
    env = {**os.environ, "PREDMASK_ROOT": str(project), "PREDMASK_RUNS": str(project / "runs"),
           "PREDMASK_DB": str(project / "results" / "predmask.duckdb"), "PYTHONPATH": str(project)}
    proc = subprocess.run([sys.executable, *args], cwd=project, env=env, capture_output=True, text=True, check=False,
                          timeout=timeout)
    assert proc.returncode == 0, f"python {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def probe(project: Path, code: str) -> dict:
    """Run ``code`` in the copy (it prints one JSON object last); also proves the copy's packages were imported."""
    head = ("import json, sys\nimport predmask, reports, sweeps\n"
            f"assert predmask.__file__.startswith({str(project)!r}), predmask.__file__\n")
    return json.loads(run(project, "-c", head + code).strip().splitlines()[-1])


def dry_run(project: Path, *args: str) -> dict:
    return json.loads(run(project, "-m", "sweeps", *args, "--dry-run", "--format", "json"))


# ----------------------------------------------------------------------------------------------- the cases
METHOD = f"{NEW}_kl_agg"
METHOD_EDITS = (
    Edit("predmask/methods.py", f'register_method(Method("{METHOD}", "divergence", "kl", "topk", "predictive", '
                                '"aggregated",\n                       description="a newcomer\'s copy of the '
                                'aggregated-tail predictive mask"))\n'),
    Edit(f"conf/method/{METHOD}.yaml", f"name: {METHOD}\nlabel: Newcomer's mask\ndelta: ${{delta}}\n"),
)

SWEEP_EDITS = (
    Edit(f"conf/sweep/{NEW}.yaml", f"# @package _global_\nsweep_name: {NEW}\ndelta: 0.1\nhydra:\n  sweeper:\n"
                                   "    params:\n      method: dppo_topk_kl,predmask_kl_agg\n"
                                   "      +setting: qwen3_4b_bf16\n      seed: 0\n"),
)

FIGURE = f"{NEW}_actor_kl"
FIGURE_EDITS = (
    Edit("reports/figures/training.py", f'\n\n@figure("A newcomer\'s figure: the actor\'s KL")\n'
                                        f"def {FIGURE}(ctx: ReportContext) -> ArtefactResult:\n"
                                        "    return _per_setting_figure(\n"
                                        '        ctx, title="A newcomer\'s figure: actor KL", caption="The actor\'s '
                                        'KL per step.",\n'
                                        '        rows=[MetricRow("actor KL", metrics.PPO_KL, (metrics.PPO_KL,))])\n'),
)

TABLE = f"{NEW}_runs_per_method"
TABLE_EDITS = (
    Edit("reports/tables/main_results.py", f'\n\n@table("A newcomer\'s table: runs per method")\n'
                                           f"def {TABLE}(ctx: ReportContext) -> ArtefactResult:\n"
                                           "    methods = sorted({r.method for r in ctx.runs if r.method})\n"
                                           '    text = TextTable("Runs per method", "every run of the database", '
                                           '["method", "runs"],\n'
                                           "                     [[m, str(sum(r.method == m for r in ctx.runs))] "
                                           "for m in methods])\n"
                                           '    result = ArtefactResult(title=text.title, caption="Runs per method.", '
                                           "runs=ctx.runs,\n"
                                           '                            tables={"main": text}, has_data=bool(methods))\n'
                                           "    result.drawn = (text,)\n    return result\n"),
)

METRIC = f"actor/{NEW}_share"
METRIC_EDITS = (
    Edit("predmask/metrics.py", f'NEWCOMER_SHARE = _metric("{METRIC}", "max", "a newcomer\'s metric")\n',
         before="METRICS: dict[str, Metric]"),
)

ESTIMATOR = NEW
RECIPE = f"vr_{NEW}"
ESTIMATOR_EDITS = (
    Edit("predmask/vr_weights.py", f'\n\n@register_estimator("{ESTIMATOR}", label="a newcomer\'s estimator: the '
                                   'accuracy, squared", inputs=("correct",))\n'
                                   "def _log_newcomer(answer_logp: Tensor | None, answer_tokens: Tensor | None, "
                                   "correct: Tensor | None) -> Tensor:\n"
                                   "    assert correct is not None\n"
                                   "    return 2 * torch.log(correct.double().mean(-1))\n",
         before="def log_correct_estimate"),
    Edit(f"conf/vr_method/{RECIPE}.yaml", f"name: {RECIPE}\nlabel: VR (newcomer weights)\nestimator: {ESTIMATOR}\n"
                                          "data: all_weighted\n"),
)

CASES: dict[str, tuple[Edit, ...]] = {
    "A method": METHOD_EDITS,
    "A sweep": SWEEP_EDITS,
    "A figure": FIGURE_EDITS,
    "A table": TABLE_EDITS,
    "A metric": METRIC_EDITS,
    "A variational recipe or estimator": ESTIMATOR_EDITS,
}


@pytest.mark.parametrize("title", sorted(CASES))
def test_the_page_names_every_file_a_case_edits(title: str) -> None:
    bullets = where_to_add()
    assert title in bullets, f"docs/architecture.md has no 'Where to add' bullet **{title}**; it has {sorted(bullets)}"
    unnamed = [e.path for e in CASES[title] if not named_by(bullets[title], e.path)]
    assert not unnamed, f"**{title}** does not name {unnamed}: {bullets[title].strip()}"


def test_the_copy_without_edits_is_the_project_itself(pristine: Path, tmp_path: Path) -> None:
    """The check each case relies on: no case's new name is known to the unedited project."""
    project = apply(pristine, tmp_path, ())
    out = probe(project, "import predmask.vr_weights as V\nfrom predmask.metrics import METRICS\n"
                         "from reports.artefact_registry import ARTEFACTS\n"
                         "print(json.dumps({'methods': sorted(predmask.METHODS), 'metrics': sorted(METRICS), "
                         "'artefacts': sorted(ARTEFACTS), 'estimators': sorted(V.ESTIMATORS)}))")
    assert not [n for names in out.values() for n in names if NEW in n]
    assert "grpo_clip_higher" in out["methods"] and "fig1_main_comparison" in out["artefacts"]


def test_a_method_is_one_registration_and_its_config_file(pristine: Path, tmp_path: Path) -> None:
    """The sweep runner composes it; the CPU engine's loss and verl's registry find it by name, with the same
    numbers as the method it copies; the report gives it its conf label and a style."""
    project = apply(pristine, tmp_path, METHOD_EDITS)
    runs = dry_run(project, "smoke", f"method={METHOD}")["runs"]
    assert [r["method"] for r in runs] == [METHOD] and f"method={METHOD}" in runs[0]["command"]
    out = probe(project, f"""
import torch
from predmask.config import label
from predmask.rl.algo import reads_tail_sq
from reports.style import method_style
from verl.trainer.ppo import core_algos
import predmask.verl.loss as verl_loss
g = torch.Generator().manual_seed(0)
mu = torch.log_softmax(torch.randn(3, 5, 12, generator=g, dtype=torch.float64), -1)
pi = torch.log_softmax(mu + 0.3 * torch.randn(mu.shape, generator=g, dtype=torch.float64), -1)
sampled = torch.multinomial(mu.exp().reshape(-1, 12), 1, generator=g).reshape(3, 5)
top = mu.topk(4, -1)
sup = predmask.build_support(top.indices, top.values, sampled, mu.gather(-1, sampled[..., None])[..., 0])
pi_sup = torch.where(sup.valid, pi.gather(-1, sup.ids), torch.full_like(sup.mu_logprobs, -torch.inf))
batch = dict(log_prob=sup.sampled_logprob(pi_sup), old_log_prob=sup.sampled_logprob(sup.mu_logprobs),
             advantages=torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5).clone(),
             response_mask=torch.ones(3, 5, dtype=torch.bool), mu_logprobs=sup.mu_logprobs, pi_logprobs=pi_sup,
             valid=sup.valid, sampled_index=sup.sampled_index)
new, ref = (predmask.policy_loss(m, **batch, delta=0.01) for m in ("{METHOD}", "predmask_kl_agg"))
verl_loss.register_all(core_algos)
print(json.dumps({{"same_loss": bool(torch.equal(new[0], ref[0])), "same_metrics": new[1] == ref[1],
                  "metrics": len(new[1]), "verl": callable(core_algos.get_policy_loss_fn("{METHOD}")),
                  "label": label("method", "{METHOD}"), "style": list(method_style("{METHOD}")),
                  "tail_sq": reads_tail_sq("{METHOD}") == reads_tail_sq("predmask_kl_agg")}}))
""")
    assert out["same_loss"] and out["same_metrics"] and out["metrics"] > 0 and out["verl"] and out["tail_sq"]
    assert out["label"] == "Newcomer's mask" and len(out["style"]) == 2


def test_a_sweep_is_one_config_file(pristine: Path, tmp_path: Path) -> None:
    project = apply(pristine, tmp_path, SWEEP_EDITS)
    assert NEW in run(project, "-m", "sweeps", "--help")
    plan = dry_run(project, NEW)
    assert plan["summary"]["sweep"] == NEW and plan["summary"]["runs"] == "2 runs (2 cells x 1 seed)"
    assert sorted(r["method"] for r in plan["runs"]) == ["dppo_topk_kl", "predmask_kl_agg"]
    assert {r["delta"] for r in plan["runs"]} == {0.1}


@pytest.fixture(scope="module")
def report_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report tests' known-values database (tests/reports/report_database.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "reports"))
    try:
        from report_database import build_db
    finally:
        sys.path.remove(str(ROOT / "tests" / "reports"))
    return build_db(tmp_path_factory.mktemp("report_db"))


@pytest.mark.parametrize(("edits", "name", "files"), [
    (FIGURE_EDITS, FIGURE, (f"{FIGURE}.png", f"{FIGURE}.pdf")),
    (TABLE_EDITS, TABLE, (f"{TABLE}.md", f"{TABLE}.tex")),
], ids=["figure", "table"])
def test_a_figure_or_a_table_is_one_declared_function(pristine: Path, tmp_path: Path, report_db: Path,
                                                      edits: tuple[Edit, ...], name: str, files: tuple[str, ...]) -> None:
    """``python -m reports list`` lists it with data; ``python -m reports paper --only`` writes its files."""
    project = apply(pristine, tmp_path, edits)
    listed = run(project, "-m", "reports", "list", "--db", str(report_db))
    assert name in listed
    out = tmp_path / "out"
    run(project, "-m", "reports", "paper", "--db", str(report_db), "--out", str(out), "--only", name)
    assert all((out / f).stat().st_size > 0 for f in files), sorted(p.name for p in out.iterdir())
    if name == TABLE:
        text = (out / f"{TABLE}.md").read_text(encoding="utf-8")
        assert "| predmask_kl_agg |" in text.replace("`", "") or "predmask_kl_agg" in text


def test_a_metric_is_one_catalogue_line(pristine: Path, tmp_path: Path) -> None:
    """The catalogue knows it and merges it by its own rule (max here, not the mean a guess would take)."""
    project = apply(pristine, tmp_path, METRIC_EDITS)
    out = probe(project, f"""
from predmask.metrics import METRICS, metric, reduce_metrics
print(json.dumps({{"reduce": metric("{METRIC}").reduce, "merged": reduce_metrics([{{"{METRIC}": 1.0}},
                  {{"{METRIC}": 3.0}}, {{"{METRIC}": 2.0}}])["{METRIC}"], "catalogued": "{METRIC}" in METRICS}}))
""")
    assert out == {"reduce": "max", "merged": 3.0, "catalogued": True}


def test_a_variational_estimator_is_one_registration_and_its_recipe_file(pristine: Path, tmp_path: Path) -> None:
    """The chain runs the recipe's final; the weights stage (CPU and cluster) keeps the estimator's column, the
    final reads it, and the results database stores it."""
    project = apply(pristine, tmp_path, ESTIMATOR_EDITS)
    runs = dry_run(project, "variational_reasoning_smoke", f"method={RECIPE}")["runs"]
    assert {r["method"] for r in runs if r["stage"] == "final"} == {RECIPE}, runs
    out = probe(project, f"""
import pandas as pd, torch
from predmask.vr_weights import weight_column, weights_columns
from predmask.rl.vr_runner import trace_weights
from analysis.store import vr_trace_columns
from predmask.config import compose, to_container
recipe = to_container(compose("variational", ["vr_method@method={RECIPE}"]))["method"]
frame = pd.DataFrame({{"question": [0, 0, 1, 1], "trace": [0, 1, 0, 1], "log_prior": [-3.0, -4.0, -2.0, -2.5],
                      "log_posterior": [-2.0, -2.0, -2.0, -2.0], "trace_tokens": [3, 4, 2, 2],
                      "answer_logp": [-0.1, -0.5, -0.2, -0.3], "answer_tokens": [2, 2, 2, 2]}})
correct = torch.tensor([[True, True], [True, False], [False, True], [True, True]])
w = trace_weights(frame, correct)[weight_column(recipe["estimator"])]
print(json.dumps({{"column": weight_column(recipe["estimator"]), "cpu": list(weights_columns()),
                  "store": list(vr_trace_columns()), "sums": [float(w[:2].sum()), float(w[2:].sum())]}}))
""")
    column = out["column"]
    assert column == f"weight_{ESTIMATOR}" and column in out["cpu"] and column in out["store"]
    assert out["sums"] == pytest.approx([1.0, 1.0])
