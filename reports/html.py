"""The report page reports/out/index.html: a summary, then every figure and table in collapsible sections, and
where each one's data came from."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import duckdb

from predmask.io import atomic_write_text
from reports import queries
from reports.artefact import ArtefactResult
from reports.artefact_registry import is_variational
from reports.summary import PageSummary
from reports.tables.render import TextTable

CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.0em; }
img { max-width: min(100%, 1100px); border: 1px solid #eee; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.paper { background: #fff7e6; } .db { background: #e8f3fb; }
.note { color: #555; font-size: 0.9em; } .empty { color: #a00; }
details { margin: 0.5em 0; } nav a { margin-right: 1em; }
summary { cursor: pointer; } summary h2 { display: inline; border: none; }
section { border-bottom: 1px solid #ddd; margin-top: 1.5em; }
"""


#: the sections open when the page loads (when they have data): the main comparison and the tables the summary's
#: headlines come from; every other section is one click away
OPEN_SECTIONS: tuple[str, ...] = (
    "fig1_main_comparison",
    "table1_hyperparameters",
    "table2_main_results",
    "token_level_summary",
    "vr_accuracy",
    "vr_results",
)


#: the variational-reasoning family's sections (reports.artefact_registry.is_variational) sit under one heading
VR_SECTION = "variational"
VR_HEADING = (
    f"<h2 id='{VR_SECTION}'>Variational reasoning: accuracy, pass@k, accuracy weighting and length bias</h2>"
    "<p class='note'>The second source paper's pipeline: π_θ0, a posterior q_φ fine-tuned on hinted prompts, K "
    "traces, their weights, weighted SFT of the final model. On the CPU engine π_θ0 is the engine's cached base "
    "model and the splits are arithmetic stand-ins, not the paper's benchmarks; each artefact's title names its "
    "scale and its evaluation splits with their size. The paper's own numbers appear only in the table labelled as "
    "the paper's.</p>"
)


def _esc(text: object) -> str:
    return html.escape(str(text))


def _table_html(t: TextTable, classes: Sequence[str] | None = None) -> str:
    cls = list(classes or [""] * len(t.header))
    head = "".join(f'<th class="{c}">{_esc(h)}</th>' for h, c in zip(t.header, cls))
    body = "".join(
        "<tr>" + "".join(f'<td class="{c}">{_esc(v)}</td>' for v, c in zip(row, cls)) + "</tr>"
        for row in t.rows
    )
    return f"<h3>{_esc(t.title)}</h3><p class='note'>{_esc(t.note)}</p><table><tr>{head}</tr>{body}</table>"


#: the columns of the table of runs an artefact drew from: header, cell of (run, run_id -> (steps, last step))
RUN_COLUMNS: tuple[tuple[str, Callable[[queries.RunInfo, dict[str, tuple[int, int]]], object]], ...] = (
    ("run", lambda r, steps: r.run_id),
    ("sweeps", lambda r, steps: ", ".join(r.sweeps) or "—"),
    ("method", lambda r, steps: r.method or "—"),
    ("δ", lambda r, steps: f"{r.delta:g}" if r.delta is not None else "—"),
    ("scale", lambda r, steps: r.describe_scale()),
    ("precision", lambda r, steps: r.describe_precision()),
    ("backend", lambda r, steps: r.describe_backend()),
    ("seed", lambda r, steps: "—" if r.seed is None else r.seed),
    ("status", lambda r, steps: r.status or "—"),
    ("steps logged", lambda r, steps: steps.get(r.run_id, (0, 0))[0]),
    ("last step", lambda r, steps: steps[r.run_id][1] if r.run_id in steps else "—"),
)


def _provenance(result: ArtefactResult, steps: dict[str, tuple[int, int]]) -> str:
    if result.study is not None:
        s = result.study
        return (
            f"<p class='note'>Drawn from token-level study <code>{_esc(s.study_id)}</code> "
            f"({s.n_seeds} seeds): {_esc(s.describe())}.</p>"
        )
    if not result.runs:
        return f"<p class='note empty'>No runs drawn ({_esc(result.selection_rule)}).</p>"
    backends = sorted({r.describe_backend() for r in result.runs})
    scales = sorted({r.describe_scale() for r in result.runs})
    emulated = any(r.is_cpu for r in result.runs)
    summary = (
        f"{len(result.runs)} run(s); selection: {result.selection_rule}; backend: {', '.join(backends)}; "
        f"scale: {', '.join(scales)}; precision {'emulated on CPU' if emulated else 'real (cluster)'}"
        + ("" if not emulated or all(r.is_cpu for r in result.runs) else " for the CPU runs")
    )
    rows = "".join(
        "<tr>" + "".join(f"<td>{_esc(cell(r, steps))}</td>" for _, cell in RUN_COLUMNS) + "</tr>"
        for r in result.runs
    )
    head = "".join(f"<th>{h}</th>" for h, _ in RUN_COLUMNS)
    return (
        f"<p class='note'>{_esc(summary)}</p><details><summary>runs drawn from</summary>"
        f"<table><tr>{head}</tr>{rows}</table></details>"
    )


def _summary_html(summary: PageSummary) -> str:
    return (
        "<section id='summary'><h2>Summary</h2>"
        f"<p>{_esc(summary.where)} {_esc(summary.studies)}</p>"
        + _table_html(summary.ran)
        + f"<p class='note'>Training headline, {_esc(summary.training_label)}</p>"
        + (
            _table_html(summary.training)
            if summary.training.rows
            else "<p class='note empty'>No validation curves yet: Table 2 is empty.</p>"
        )
        + _table_html(summary.token_level, ["", "paper", "db"])
        + "</section>"
    )


def _table1_html(r: ArtefactResult) -> str:
    differing, full, method = r.tables["differing"], r.tables["training"], r.tables["method"]
    shown = (
        _table_html(differing)
        if differing.rows
        else f"<h3>{_esc(differing.title)}</h3><p class='note'>{_esc(differing.note)}</p>"
    )
    return (
        shown
        + f"<details><summary>the full table ({len(full.rows)} keys)</summary>{_table_html(full)}</details>"
        + _table_html(method)
    )


def _section_html(r: ArtefactResult, steps: dict[str, tuple[int, int]]) -> str:
    is_open = r.has_data and r.name in OPEN_SECTIONS
    status = "" if r.has_data else " (no data yet)"
    head = f"<summary><h2>{_esc(r.title)}</h2><span class='note'>{status}</span></summary>"
    parts = [f"<details{' open' if is_open else ''}>{head}"]
    if not r.has_data:
        parts.append(
            "<p class='note empty'>No data for this artefact in the database"
            + (f": <code>{_esc(r.command)}</code> produces it" if r.command else "")
            + ".</p>"
        )
    pngs = [f for f in r.files if f.suffix == ".png"]
    others = [f for f in r.files if f.suffix != ".png"]
    for f in pngs:
        parts.append(f"<p><img src='{_esc(f.name)}' alt='{_esc(r.title)}'></p>")
    if others:
        parts.append(
            "<p>Files: " + ", ".join(f"<a href='{_esc(f.name)}'>{_esc(f.name)}</a>" for f in others) + "</p>"
        )
    parts.append(f"<p>{_esc(r.caption)}</p>")
    if r.name == "table1_hyperparameters" and "differing" in r.tables:
        parts.append(_table1_html(r))
    elif r.name == "vr_results":
        for key, t in r.tables.items():
            parts.append(_table_html(t, ["paper" if key == "paper" else "db"] * len(t.header)))
    else:
        for t in r.tables.values():
            parts.append(_table_html(t, ["", "paper", "db"] if r.name == "token_level_summary" else None))
    parts.append(_provenance(r, steps))
    parts.append("</details>")
    return f"<section id='{_esc(r.name)}'>" + "".join(parts) + "</section>"


def render_index(
    results: Sequence[ArtefactResult], out: Path, db: Path, con: duckdb.DuckDBPyConnection, summary: PageSummary
) -> Path:
    """Write out/index.html: the summary, then every figure (PNG inline, PDF linked) and table, each section
    collapsible (OPEN_SECTIONS open when they have data), each with the runs it drew from and their steps."""
    steps = queries.last_steps(con, sorted({r.run_id for res in results for r in res.runs}))
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = " ".join(f"<a href='#{_esc(r.name)}'>{_esc(r.name)}</a>" for r in results)
    if any(is_variational(r.name) for r in results):
        nav += f" <a href='#{VR_SECTION}'>variational reasoning</a>"
    others = [r for r in results if not is_variational(r.name)]
    family = [r for r in results if is_variational(r.name)]
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<title>predmask report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>predmask: the paper's figures and tables from the results database</h1>",
        (
            f"<p class='note'>Database <code>{_esc(db)}</code>, generated {generated}. Every figure and table "
            "below is drawn from this database only; the paper's own numbers appear only in columns labelled as "
            "the paper's. CPU runs use small stand-in models with emulated precision.</p>"
        ),
        f"<nav><a href='#summary'>summary</a> {nav}</nav>",
        _summary_html(summary),
    ]
    parts += [_section_html(r, steps) for r in others]
    if family:
        parts.append(VR_HEADING)
        parts += [_section_html(r, steps) for r in family]
    parts.append("</body></html>")
    index = out / "index.html"
    atomic_write_text(index, "\n".join(parts))
    return index
