"""Table 1 (hyperparameters from the runs' composed configs) and the token-level summary beside the paper's numbers.

Each table is rendered as Markdown and LaTeX; the report page renders the same rows as HTML.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reports import data
from reports.figures import mean_se, unsafe_keep_stats
from reports.registry import ArtefactResult, ReportContext, table
from reports.style import method_rank, method_style

# math.md §5: the paper's token-level numbers (Qwen3 scale, 61 seeds). Never mixed with this database's.
PAPER_LABEL = "paper (Qwen3, 61 seeds)"
PAPER_TOKEN_LEVEL: dict[str, str] = {
    "seeds": "61",
    "outside": "1,435",
    "disagree": "≈ 82",
    "unsafe_predictive": "34.2%",
    "unsafe_ratio": "36.9%",
    "lower": "38 of 61",
    "corrective_predictive": "65.1%",
    "corrective_ratio": "62.9%",
}
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
    "≈": r"$\approx$",
    "−": "-",
    "·": r"$\cdot$",
    "\n": " ",
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in text)


def write_text_atomic(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


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


def hyperparameter_tables(runs: Sequence[data.RunInfo]) -> tuple[TextTable, TextTable]:
    """(training hyperparameters per setting, method parameters per method) from the runs' configs."""
    keys = data.panel_keys(runs)
    keys = [k for k in keys if k.model is not None]
    columns = []
    for k in keys:
        members = data.runs_in_panel(runs, k)
        flat = [
            {key: v for key, v in flatten(r.config).items() if not key.startswith("method.")} for r in members
        ]
        columns.append((k, flat))
    row_keys = sorted({key for _, flats in columns for f in flats for key in f})
    header = ["hyperparameter"] + [
        k.title.replace("\n", " (") + (")" if "\n" in k.title else "") for k, _ in columns
    ]
    rows = [[key] + [_merge_values([f.get(key) for f in flats]) for _, flats in columns] for key in row_keys]
    n_cpu = sum(r.is_cpu for r in runs)
    train = TextTable(
        title="Table 1: training hyperparameters per model-precision setting",
        note=(
            f"From the composed configs of {len(runs)} run(s) ({n_cpu} on the CPU engine: small stand-in models, "
            "emulated precision). Values that differ between runs of a setting are joined with ' / '."
        ),
        header=header,
        rows=rows,
    )
    methods = sorted({r.method for r in runs if r.method}, key=lambda m: (method_rank(m), m))
    per_method = {
        m: [flatten(r.config.get("method", {})) for r in runs if r.method == m and isinstance(r.config, dict)]
        for m in methods
    }
    m_keys = sorted({k for flats in per_method.values() for f in flats for k in f} - {"name"})
    m_rows = [[k] + [_merge_values([f.get(k) for f in per_method[m]]) for m in methods] for k in m_keys]
    method_table = TextTable(
        title="Table 1 (continued): method parameters",
        note="method.* of the same configs; δ is the trust-region threshold of the divergence methods.",
        header=["parameter"] + [method_style(m)[0] for m in methods],
        rows=m_rows,
    )
    return train, method_table


@table("table1_hyperparameters", "Table 1: hyperparameters from the runs' configs")
def table1_hyperparameters(ctx: ReportContext) -> ArtefactResult:
    sel = data.select_runs(ctx.runs, None, ctx.sweeps, None)
    runs = [r for r in sel.runs if r.config]
    result = ArtefactResult(
        name="table1_hyperparameters",
        title="Table 1: hyperparameters",
        caption="Rendered from the composed configs stored with each run (runs.config); Markdown and LaTeX.",
        runs=runs,
        selection_rule=sel.rule,
        has_data=bool(runs),
    )
    train, method_table = hyperparameter_tables(runs)
    result.tables = {"training": train, "method": method_table}
    if ctx.draw:
        md = train.markdown() + "\n" + method_table.markdown()
        tex = train.latex() + "\n" + method_table.latex()
        result.files = [
            write_text_atomic(ctx.out / "table1_hyperparameters.md", md),
            write_text_atomic(ctx.out / "table1_hyperparameters.tex", tex),
        ]
    return result


# --------------------------------------------------------------------------------- token-level summary


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%" if np.isfinite(v) else "—"


def _pct_se(mean: float, se: float, n: int) -> str:
    if not np.isfinite(mean):
        return "—"
    return (
        f"{100 * mean:.1f}% ± {100 * se:.1f} (n = {n})" if np.isfinite(se) else f"{100 * mean:.1f}% (n = {n})"
    )


def _mean_count(values: np.ndarray | None) -> str:
    if values is None:
        return "—"
    m, se, n = mean_se(values)
    return "—" if n == 0 else (f"{m:,.1f} ± {se:,.1f}" if np.isfinite(se) else f"{m:,.1f}")


def token_level_summary_table(ctx: ReportContext, study: data.StudyInfo) -> tuple[TextTable, dict[str, Any]]:
    """The study's numbers beside the paper's, one quantity per row; the values behind them as a dict."""
    seeds = data.seed_table(ctx.con, study.study_id)
    st = unsafe_keep_stats(seeds)
    counts, source = data.pooled_corrective(ctx.con, study.study_id)

    def pooled(crit: str) -> str:
        if crit not in counts:
            return "—"
        k, n = counts[crit]
        return f"{100 * k / n:.1f}% ({k}/{n})"

    def extra(col: str) -> str:
        v = seeds.get(col)
        if v is None:
            return "—"
        m, se, n = mean_se(v)
        return _pct_se(m, se, n)

    db_label = f"this database ({study.describe()}; study {study.study_id})"
    rows = [
        ["seeds", PAPER_TOKEN_LEVEL["seeds"], str(st["n_seeds"])],
        [
            "tokens outside the trust region per seed (mean ± SE)",
            PAPER_TOKEN_LEVEL["outside"],
            _mean_count(seeds.get("n_outside")),
        ],
        [
            "disagreement set per seed (mean ± SE)",
            PAPER_TOKEN_LEVEL["disagree"],
            _mean_count(seeds.get("n_disagree")),
        ],
        [
            "unsafe-keep rate, predictive aggregated (mean ± SE over seeds)",
            PAPER_TOKEN_LEVEL["unsafe_predictive"],
            _pct_se(st["mean_predictive"], st["se_predictive"], st["n_paired"]),
        ],
        [
            "unsafe-keep rate, ratio (mean ± SE over seeds)",
            PAPER_TOKEN_LEVEL["unsafe_ratio"],
            _pct_se(st["mean_ratio"], st["se_ratio"], st["n_paired"]),
        ],
        [
            "seeds where predictive is lower",
            PAPER_TOKEN_LEVEL["lower"],
            f"{st['n_predictive_lower']} of {st['n_paired']}",
        ],
        [
            "corrective fraction, predictive aggregated (pooled)",
            PAPER_TOKEN_LEVEL["corrective_predictive"],
            pooled("predictive"),
        ],
        ["corrective fraction, ratio (pooled)", PAPER_TOKEN_LEVEL["corrective_ratio"], pooled("ratio")],
        [
            "unsafe-keep rate, predictive uniform (mean ± SE)",
            NOT_REPORTED,
            extra("unsafe_keep_predictive_uniform"),
        ],
        [
            "unsafe-keep rate, predictive exact tail (mean ± SE)",
            NOT_REPORTED,
            extra("unsafe_keep_predictive_exact"),
        ],
        ["corrective fraction, predictive uniform (pooled)", NOT_REPORTED, pooled("predictive_uniform")],
        ["corrective fraction, predictive exact tail (pooled)", NOT_REPORTED, pooled("predictive_exact")],
    ]
    text = TextTable(
        title="Token-level study: this database beside the paper",
        note=(
            "Left column: the paper's published numbers (Qwen3 scale, 61 seeds, math.md §5). Right column: this "
            f"database only. A small CPU model reproduces the mechanism, not the paper's numbers. Pooled "
            f"fractions from {source}."
        ),
        header=["quantity", PAPER_LABEL, db_label],
        rows=rows,
    )
    return text, {"unsafe_keep": st, "corrective_counts": counts, "corrective_source": source}


@table("token_level_summary", "Token-level study beside the paper's numbers", source="study")
def token_level_summary(ctx: ReportContext) -> ArtefactResult:
    result = ArtefactResult(
        name="token_level_summary",
        title="Token-level study: this database beside the paper",
        caption="The paper's numbers and this database's, in separate, labelled columns; never mixed.",
        study=ctx.study,
        selection_rule=f"study {ctx.study.study_id}" if ctx.study else "no token-level study",
    )
    if ctx.study is None:
        text = TextTable(
            title=result.title,
            note="No token-level study in this database (python -m analysis token_level); only the paper's column.",
            header=["quantity", PAPER_LABEL, "this database"],
            rows=[[k, v, "—"] for k, v in PAPER_TOKEN_LEVEL.items()],
        )
    else:
        text, stats = token_level_summary_table(ctx, ctx.study)
        result.stats = stats
        result.has_data = stats["unsafe_keep"]["n_seeds"] > 0
    result.tables = {"summary": text}
    if ctx.draw:
        result.files = [
            write_text_atomic(ctx.out / "token_level_summary.md", text.markdown()),
            write_text_atomic(ctx.out / "token_level_summary.tex", text.latex()),
        ]
    return result
