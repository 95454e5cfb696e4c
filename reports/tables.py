"""Table 1 (hyperparameters from the runs' composed configs), Table 2 (main results over seeds) and the token-level
summary beside the paper's numbers.

Each table is rendered as Markdown and LaTeX; the report page renders the same rows as HTML. Table 2 prints what
analysis.training.stats returns for each setting's runs; the token-level summary prints what
analysis.token_level.summary.stats returns for the study, and the paper's numbers from the same module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from analysis.results import curves
from analysis.token_level.summary import stats
from analysis.training import stats as training_stats
from predmask import config
from predmask.cli import sweep_command
from predmask.io import atomic_write_text
from predmask.methods import method_anchor
from predmask.rl.task import EVAL_SPLITS
from reports import data
from reports.artefact import STUDY_COMMAND, ArtefactResult, ReportContext, table
from reports.figures.training import MAIN
from reports.figures.variational import (
    AT_N,
    SWEEP_COMMAND,
    VrScores,
    acc_name,
    pass_name,
    scale_note,
    vr_scores,
)
from reports.labels import method_label, sweep_delta, vr_data_label, vr_method_label
from reports.style import method_rank

NOT_REPORTED = "not reported"


@dataclass
class TextTable:
    """A rendered-anywhere table: a title, a note, header cells and rows of cells (plain text)."""

    title: str
    note: str
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        def cell(s: str) -> str:
            return s.replace("|", "\\|").replace("\n", " ")

        lines = [
            f"### {self.title}",
            "",
            self.note,
            "",
            "| " + " | ".join(cell(h) for h in self.header) + " |",
        ]
        lines.append("|" + "|".join("---" for _ in self.header) + "|")
        lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"

    def latex(self) -> str:
        cols = "l" + "l" * (len(self.header) - 1)
        lines = [
            "% requires \\usepackage{booktabs}",
            "\\begin{table}[t]",
            "\\centering",
            "\\small",
            f"\\caption{{{latex_escape(self.title)}. {latex_escape(self.note)}}}",
            f"\\begin{{tabular}}{{{cols}}}",
            "\\toprule",
            " & ".join(latex_escape(h) for h in self.header) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join(latex_escape(c) for c in row) + " \\\\" for row in self.rows]
        lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
        return "\n".join(lines) + "\n"


_LATEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "δ": r"$\delta$",
    "±": r"$\pm$",
    "Δ": r"$\Delta$",
    "—": "---",
    "≈": r"$\approx$",
    "−": "-",
    "·": r"$\cdot$",
    "\n": " ",
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in text)


# ------------------------------------------------------------------------------------------ Table 1

# Config keys that identify a run or say where it lives, not how it trains.
_SKIP_SEGMENTS = {
    "run_dir",
    "run_id",
    "seed",
    "sweep",
    "hydra",
    "paths",
    "path",
    "setup",
    "env",
    "cache_dir",
    "log_path",
}
_MAX_VALUE_LEN = 60


def flatten(cfg: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> printable scalar values of a nested config (long strings and identity keys left out)."""
    out: dict[str, str] = {}
    if isinstance(cfg, Mapping):
        for k, v in cfg.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            seg = str(k)
            if seg in _SKIP_SEGMENTS or seg.endswith(("_path", "_dir")):
                continue
            out.update(flatten(v, key))
    elif isinstance(cfg, list):
        if all(not isinstance(v, (Mapping, list)) for v in cfg):
            text = "[" + ", ".join(_fmt(v) for v in cfg) + "]"
            if len(text) <= _MAX_VALUE_LEN:
                out[prefix] = text
    elif cfg is not None:
        text = _fmt(cfg)
        if len(text) <= _MAX_VALUE_LEN:
            out[prefix] = text
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _merge_values(values: Sequence[str | None]) -> str:
    distinct = sorted({v for v in values if v is not None})
    if not distinct:
        return "—"
    return distinct[0] if len(distinct) == 1 else " / ".join(distinct)


def write_texts(ctx: ReportContext, texts: Mapping[str, str]) -> list:
    """Write each file name -> text into the output folder atomically; the paths written."""
    paths = [ctx.out / name for name in texts]
    for path, text in zip(paths, texts.values()):
        atomic_write_text(path, text)
    return paths


@cache
def _declared_keys(group: str) -> dict[str, frozenset[str]] | None:
    """option -> the dotted keys (``group.…``) its own file conf/<group>/<option>.yaml sets (an option packaged
    ``_global_``, such as a setting, sets its keys under its group name); None when conf/ has no such group."""
    options = config.group_options(group)
    if not options:
        return None
    out: dict[str, frozenset[str]] = {}
    for name in options:
        entry = config.group_entry(group, name)
        own = entry[group] if isinstance(entry.get(group), dict) else entry
        out[name] = frozenset(_leaf_keys({k: v for k, v in own.items() if k != "defaults"}, group))
    return out


def _leaf_keys(cfg: Mapping[str, Any], prefix: str) -> set[str]:
    out: set[str] = set()
    for k, v in cfg.items():
        key = f"{prefix}.{k}"
        out |= _leaf_keys(v, key) if isinstance(v, Mapping) else {key}
    return out


def applies(run_config: Mapping[str, Any], key: str) -> bool:
    """Whether a dotted config key applies to a run: a key under a config group's section (``precision.…``,
    ``model.…``) applies only when the run's option of that group sets it in its own conf/ file; a key it carries
    only from a group default, a schema or the engine does not. Keys outside config groups, and the keys of an
    option conf/ no longer has, apply wherever the run carries them."""
    section = key.split(".", 1)[0]
    node = run_config.get(section)
    if "." not in key or not isinstance(node, Mapping):
        return True
    declared = _declared_keys(section)
    option = node.get("name")
    if declared is None or option not in declared:
        return True
    return key in declared[option]


APPLIES_RULE = (
    "A key of a config group (model.*, precision.*, cluster.*, setting.*, task.*, base.*) applies to a setting only "
    "when the setting's option of that group sets it in its own file, conf/<group>/<option>.yaml; a key the runs "
    "carry only from a group default, a schema or the engine is left out here. Other keys apply wherever the runs "
    "carry them."
)


def _column_title(key: data.PanelKey) -> str:
    """A panel's two-line title on one line: "setting (second line)"."""
    head, _, rest = key.title.partition("\n")
    if not rest:
        return head
    return f"{head} {rest}" if rest.startswith("(") else f"{head} ({rest})"


def hyperparameter_tables(runs: Sequence[data.RunInfo]) -> tuple[TextTable, TextTable, TextTable]:
    """(every training hyperparameter per setting, only those that differ between settings where they apply,
    method parameters per method) from the runs' configs."""
    keys = [k for k in data.panel_keys(runs) if k.model is not None]
    columns = []
    for k in keys:
        members = data.runs_in_panel(runs, k)
        flat = [
            {key: v for key, v in flatten(r.config).items() if not key.startswith("method.")} for r in members
        ]
        columns.append((k, members, flat))
    row_keys = sorted({key for _, _, flats in columns for f in flats for key in f})
    header = ["hyperparameter"] + [_column_title(k) for k, _, _ in columns]
    rows = [[key] + [_merge_values([f.get(key) for f in flats]) for _, _, flats in columns] for key in row_keys]
    n_cpu = sum(r.is_cpu for r in runs)
    source = (
        f"From the composed configs of {len(runs)} run(s) ({n_cpu} on the CPU engine: small stand-in models, "
        "emulated precision). Values that differ between runs of a setting are joined with ' / '."
    )
    train = TextTable(
        title="Table 1: training hyperparameters per model-precision setting",
        note=source,
        header=header,
        rows=rows,
    )
    differing = TextTable(
        title="Table 1: the hyperparameters that differ between settings",
        note=(
            f"{source} Only the keys whose values differ between the settings (or that apply to some settings "
            f"only), each shown only for the settings it applies to (an empty cell: it does not apply). "
            f"{APPLIES_RULE} The full table holds every key of every setting."
            + ("" if len(columns) > 1 else " With one setting nothing differs: see the full table.")
        ),
        header=header,
        rows=_differing_rows(row_keys, columns),
    )
    methods = sorted({r.method for r in runs if r.method}, key=lambda m: (method_rank(m), m))
    per_method = {
        m: [{**flatten(r.config.get("method", {})), "anchor": method_anchor(r.config.get("method", {}))}
            for r in runs if r.method == m and isinstance(r.config, dict)]
        for m in methods
    }
    m_keys = sorted({k for flats in per_method.values() for f in flats for k in f} - {"name", "label"})
    m_rows = [[k] + [_merge_values([f.get(k) for f in per_method[m]]) for m in methods] for k in m_keys]
    method_table = TextTable(
        title="Table 1 (continued): method parameters",
        note=(
            "method.* of the same configs; δ is the trust-region threshold of the divergence methods; anchor is "
            "what the ratio is anchored on: old = π_old (the training policy before the batch's first update, "
            "verl's recomputed old_log_prob), rollout = the rollout's μ of the sampled token."
        ),
        header=["parameter"] + [method_label(m) for m in methods],
        rows=m_rows,
    )
    return train, differing, method_table


def _differing_rows(
    row_keys: Sequence[str], columns: Sequence[tuple[data.PanelKey, list[data.RunInfo], list[dict[str, str]]]]
) -> list[list[str]]:
    """Rows of the keys whose applicable values differ between settings; "" where a key does not apply."""
    rows = []
    for key in row_keys:
        cells: list[str | None] = []
        for _, members, flats in columns:
            values = [f.get(key) for r, f in zip(members, flats) if key in f and applies(r.config, key)]
            cells.append(_merge_values(values) if values else None)
        shown = [c for c in cells if c is not None]
        if len(columns) > 1 and (len(set(shown)) > 1 or (shown and len(shown) < len(cells))):
            rows.append([key] + [c if c is not None else "" for c in cells])
    return rows


@table("table1_hyperparameters", "Table 1: hyperparameters from the runs' configs")
def table1_hyperparameters(ctx: ReportContext) -> ArtefactResult:
    sel = data.select_runs(ctx.runs, None, ctx.sweeps, None)
    # the variational family's stage runs are not RL runs: their parameters are in conf/variational.yaml
    runs = [r for r in sel.runs if r.config and r.config.get("family") != data.VR_FAMILY]
    result = ArtefactResult(
        name="table1_hyperparameters",
        title="Table 1: hyperparameters",
        caption=(
            "Rendered from the composed configs stored with each run (runs.config); the files (Markdown and LaTeX) "
            "hold the full table."
        ),
        runs=runs,
        selection_rule=sel.rule,
        has_data=bool(runs),
        command=sweep_command(MAIN),
    )
    train, differing, method_table = hyperparameter_tables(runs)
    result.tables = {"differing": differing, "training": train, "method": method_table}
    if ctx.draw:
        md = train.markdown() + "\n" + method_table.markdown()
        tex = train.latex() + "\n" + method_table.latex()
        result.files = write_texts(ctx, {"table1_hyperparameters.md": md, "table1_hyperparameters.tex": tex})
    return result


# --------------------------------------------------------------------------------- token-level summary

SummaryRow = tuple[str, str | None, Callable[[stats.StudySummary], str]]


def _pooled(crit: str) -> Callable[[stats.StudySummary], str]:
    return lambda s: s.corrective[crit].pct() if crit in s.corrective else "—"


def _paired_mean(crit: str, side: str) -> Callable[[stats.StudySummary], str]:
    def cell(s: stats.StudySummary) -> str:
        pair = s.pairs.get(crit)
        return "—" if pair is None else getattr(pair.unsafe_keep, side).pct()

    return cell


def _lower(s: stats.StudySummary) -> str:
    if s.headline is None:
        return "—"
    pair = s.headline.unsafe_keep
    return f"{pair.n_lower} of {pair.n_paired} paired seeds"


# (quantity, key of the paper's number or None when the paper does not report it, this study's value)
SUMMARY_ROWS: tuple[SummaryRow, ...] = (
    ("seeds", "seeds", lambda s: str(s.n_seeds)),
    ("tokens outside the trust region per seed (mean ± SE)", "outside_per_seed", lambda s: s.outside.count()),
    (
        "disagreement set per seed (mean ± SE)",
        "disagree_per_seed",
        lambda s: s.headline.disagree.count() if s.headline else "—",
    ),
    (
        "unsafe-keep rate, predictive aggregated (mean ± SE over paired seeds)",
        "unsafe_keep_predictive",
        _paired_mean("predictive", "pred_mean"),
    ),
    (
        "unsafe-keep rate, ratio (mean ± SE over paired seeds)",
        "unsafe_keep_ratio",
        _paired_mean("predictive", "ratio_mean"),
    ),
    ("seeds where predictive is lower", "seeds_predictive_lower", _lower),
    ("corrective fraction, predictive aggregated (pooled)", "corrective_predictive", _pooled("predictive")),
    ("corrective fraction, ratio (pooled)", "corrective_ratio", _pooled("ratio")),
    (
        "unsafe-keep rate, predictive uniform (mean ± SE over paired seeds)",
        None,
        _paired_mean("predictive_uniform", "pred_mean"),
    ),
    (
        "unsafe-keep rate, predictive exact tail (mean ± SE over paired seeds)",
        None,
        _paired_mean("predictive_exact", "pred_mean"),
    ),
    ("corrective fraction, predictive uniform (pooled)", None, _pooled("predictive_uniform")),
    ("corrective fraction, predictive exact tail (pooled)", None, _pooled("predictive_exact")),
)


def summary_rows(summary: stats.StudySummary | None) -> list[list[str]]:
    """One row per quantity: its name, the paper's number, this study's number ("—" without a study)."""
    return [
        [
            quantity,
            stats.paper_text(key) if key is not None else NOT_REPORTED,
            value(summary) if summary is not None else "—",
        ]
        for quantity, key, value in SUMMARY_ROWS
    ]


@table("token_level_summary", "Token-level study beside the paper's numbers", source="study")
def token_level_summary(ctx: ReportContext) -> ArtefactResult:
    result = ArtefactResult(
        name="token_level_summary",
        title="Token-level study: this database beside the paper",
        caption="The paper's numbers and this database's, in separate, labelled columns; never mixed.",
        study=ctx.study,
        selection_rule=f"study {ctx.study.study_id}" if ctx.study else "no token-level study",
        command=STUDY_COMMAND,
    )
    if ctx.study is None or ctx.summary is None:
        note = f"No token-level study in this database ({STUDY_COMMAND}); only the paper's column."
        db_label = "this database"
    else:
        result.stats = ctx.summary
        result.has_data = ctx.summary.n_seeds > 0
        note = (
            "Left column: the paper's published numbers (Qwen3 scale, 61 seeds, docs/math.md §5). Right column: this "
            "database only. A small CPU model reproduces the mechanism, not the paper's numbers. Means of "
            "unsafe-keep rates are over the paired seeds (both criteria kept a disagreement token); pooled "
            "fractions are summed over all seeds from the per-seed counts."
        )
        db_label = f"this database ({ctx.study.describe()}; study {ctx.study.study_id})"
    text = TextTable(
        title=result.title,
        note=note,
        header=["quantity", stats.PAPER_LABEL, db_label],
        rows=summary_rows(ctx.summary),
    )
    result.tables = {"summary": text}
    if ctx.draw:
        result.files = write_texts(
            ctx, {"token_level_summary.md": text.markdown(), "token_level_summary.tex": text.latex()}
        )
    return result


# ------------------------------------------------------------------------------------------ Table 2

COLLAPSE_DOC = "docs/results.md"


def _pct(iv: training_stats.Interval) -> str:
    """ "41.2% ± 3.1" (t-interval half-width, percentage points); one seed: "41.2% (one seed, no interval)"."""
    return iv.text(100.0, ".1f", "%", with_n=False)


def _diff(d: training_stats.PairedDifference | None, is_reference: bool) -> str:
    if is_reference:
        return "reference"
    return "—" if d is None else d.text(scale=100.0)


def _collapsed(r: training_stats.MethodResult) -> str:
    seeds = r.collapsed
    which = f" (seed {', '.join(str(k) for k in seeds)})" if seeds else ""
    return f"{len(seeds)}/{r.n} seeds{which}"


SettingResults = list[tuple[data.PanelKey, dict[str, training_stats.MethodResult]]]


def main_results(
    ctx: ReportContext, runs: Sequence[data.RunInfo]
) -> tuple[SettingResults, list[data.RunInfo]]:
    """Per setting (panel order), each method's results over its seeds from the runs' validation curves; and the
    runs they come from (those with a validation curve)."""
    aime = curves.aime_series(ctx.con, [r.run_id for r in runs])
    val = {rid: s for rid, a in aime.items() if (s := curves.validation_series(a)) is not None and len(s[0])}
    out: SettingResults = []
    used: list[data.RunInfo] = []
    for key in data.panel_keys(runs):
        if key.model is None:
            out.append((key, {}))
            continue
        members = [r for r in data.runs_in_panel(runs, key) if r.run_id in val]
        groups = curves.by_method_and_seed(members, val, rank=method_rank)
        results = training_stats.setting_results({str(m): g for m, g in groups.items()})
        out.append((key, results))
        used += [r for r in members if str(r.method) in results]
    return out, used


def main_results_table(results: SettingResults, n_runs: int, n_cpu: int) -> TextTable:
    references = {r.vs_final.reference for _, rs in results for r in rs.values() if r.vs_final is not None}
    rows = []
    for key, by_method in results:
        setting = _column_title(key)
        if not by_method:
            rows.append([setting, "no runs with validation", "0"] + ["—"] * 7)
        for method, r in by_method.items():
            ref = r.vs_final.reference if r.vs_final is not None else None
            rows.append(
                [
                    setting,
                    method_label(method),
                    str(r.n),
                    _pct(r.final),
                    _pct(r.best),
                    _pct(r.auc),
                    method_label(ref) if ref else "—",
                    _diff(r.vs_final, method in references),
                    _diff(r.vs_auc, method in references),
                    _collapsed(r),
                ]
            )
    note = (
        f"From {n_runs} run(s) ({n_cpu} on the CPU engine: small stand-in models, emulated precision; not the "
        "paper's scale). Validation accuracy = mean of the two AIME avg@16 scores (CPU: their stand-in splits). "
        f"Each accuracy cell: {training_stats.interval_note()} (half-width after ±; one seed: no interval). "
        "final = the last evaluated step; best = the highest evaluation; AUC = trapezoid area under the "
        "validation curve over steps divided by the step span (a mean accuracy over the run). Δ = predictive mask "
        "minus the method it is paired with (the ratio-direction mask of the same divergence and support), "
        "per seed, in percentage points: mean [95% t-interval] (seeds with Δ > 0). Collapsed: validation "
        f"accuracy stays below half of its best for the rest of the run (defined in {COLLAPSE_DOC})."
    )
    return TextTable(
        title="Table 2: main results (validation accuracy over seeds)",
        note=note,
        header=[
            "setting",
            "method",
            "seeds",
            "final val acc",
            "best val acc",
            "AUC (mean val acc)",
            "paired with",
            "Δ final (pp)",
            "Δ AUC (pp)",
            "collapsed",
        ],
        rows=rows,
    )


def headline_table(results: SettingResults) -> TextTable:
    """Table 2's headline, from the same results and cells: per setting, the method with the highest mean final
    validation accuracy, and each predictive mask against the method it is paired with."""
    rows = []
    for key, by_method in results:
        finals = {m: r.final.mean for m, r in by_method.items() if r.final.mean is not None}
        if not finals:
            continue
        top = max(finals, key=lambda m: finals[m])
        highest = f"{method_label(top)}: {_pct(by_method[top].final)}"
        pairs = [(m, r) for m, r in by_method.items() if r.vs_final is not None]
        for method, r in pairs or [(None, None)]:
            versus = "—" if r is None else f"{method_label(method)} − {method_label(r.vs_final.reference)}"
            rows.append(
                [
                    _column_title(key),
                    highest,
                    versus,
                    "—" if r is None else _diff(r.vs_final, False),
                    "—" if r is None else _diff(r.vs_auc, False),
                ]
            )
    return TextTable(
        title="Headline: Table 2 in brief",
        note="The same numbers as Table 2 (accuracies in %, Δ in percentage points, per-seed pairs).",
        header=["setting", "highest final val acc", "predictive mask − its pair", "Δ final (pp)", "Δ AUC (pp)"],
        rows=rows,
    )


@table("table2_main_results", f"Table 2: main results at δ = {sweep_delta(MAIN):g}, over seeds")
def table2_main_results(ctx: ReportContext) -> ArtefactResult:
    sel = data.select_runs(ctx.runs, sweep_delta(MAIN), ctx.sweeps, MAIN)
    results, runs = main_results(ctx, sel.runs)
    text = main_results_table(results, len(runs), sum(r.is_cpu for r in runs))
    result = ArtefactResult(
        name="table2_main_results",
        title=text.title,
        caption=(
            "Final, best and mean (AUC) validation accuracy per setting and method over seeds, the paired "
            "difference of each predictive mask against its DPPO reference, and collapses; Markdown and LaTeX."
        ),
        runs=runs,
        selection_rule=sel.rule,
        stats=results,
        tables={"main": text},
        has_data=any(by_method for _, by_method in results),
        command=sweep_command(MAIN),
    )
    if ctx.draw:
        result.files = write_texts(
            ctx, {"table2_main_results.md": text.markdown(), "table2_main_results.tex": text.latex()}
        )
    return result


# ------------------------------------------------------------------------------------ variational reasoning

#: the paper's own headline (Qwen3-4B-Base, real benchmarks), in our words; never mixed with this database's cells
VR_PAPER_HEADLINE: tuple[tuple[str, str, str], ...] = (
    (
        "variational reasoning vs Bespoke-Stratos-4B† (same training data)",
        "Qwen3-4B-Base; the paper's real reasoning benchmarks",
        "average accuracy over 8.5% higher (as the paper reports it)",
    ),
)


def vr_results_table(scores: VrScores) -> TextTable:
    """One row per method × data setting × estimator: seeds, per stand-in split avg@16 and pass@16 (mean ± the
    interval over seeds, from analysis.training.stats)."""
    rows = []
    for key in scores.by_key:
        cells = [vr_method_label(key.method), vr_data_label(key.data) or "—", key.estimator or "—"]
        n = len(scores.by_key[key])
        cells.append(str(n))
        for split in EVAL_SPLITS:
            cells.append(_pct(scores.interval(key, acc_name(split))))
            cells.append(_pct(scores.interval(key, pass_name(split, AT_N))))
        rows.append(cells)
    header = ["method", "data setting", "estimator", "seeds"]
    for split in EVAL_SPLITS:
        header += [f"{split} avg@{AT_N}", f"{split} pass@{AT_N}"]
    return TextTable(
        title="Variational reasoning: final models on the stand-in splits (this database)",
        note=(
            f"This database only: {scale_note(scores.runs)}. Each cell: {training_stats.interval_note()} of the "
            f"final evaluation (half-width after ±, percentage points; one seed: no interval). Selection: "
            f"{scores.rule}."
        ),
        header=header,
        rows=rows,
    )


def vr_paper_table() -> TextTable:
    return TextTable(
        title="Variational reasoning: the paper's own headline (not this database)",
        note=(
            "The source paper's reported result at its own scale, for orientation only; not comparable with the "
            "stand-in numbers above (different models, data and benchmarks)."
        ),
        header=["comparison", "paper's setting", "paper's result"],
        rows=[list(r) for r in VR_PAPER_HEADLINE],
    )


@table("vr_results", "Variational reasoning: results per method, data setting and estimator")
def vr_results(ctx: ReportContext) -> ArtefactResult:
    scores = vr_scores(ctx)
    text, paper = vr_results_table(scores), vr_paper_table()
    result = ArtefactResult(
        name="vr_results",
        title="Variational reasoning: results table",
        caption=(
            "avg@16 and pass@16 per method over seeds from this database; below it, separately, the paper's own "
            "headline at its own scale."
        ),
        runs=scores.runs,
        selection_rule=scores.rule,
        stats=scores,
        tables={"results": text, "paper": paper},
        has_data=bool(scores.runs),
        command=SWEEP_COMMAND,
    )
    if ctx.draw:
        md = text.markdown() + "\n" + paper.markdown()
        tex = text.latex() + "\n" + paper.latex()
        result.files = write_texts(ctx, {"vr_results.md": md, "vr_results.tex": tex})
    return result
