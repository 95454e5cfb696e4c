"""`python -m analysis drift`: the token-level study over a grid of drift (lr x staleness x precision), beyond the paper.

The grid is conf/drift.yaml (``DriftGridConfig``): every combination of its ``axes`` is one cell, a normal
token-level study with its own study id, whose seeds run on the study's own workers (``compute.fanout``; one
pool for the pending seeds of every cell) and are stored by the study's own ingest (``cli.ingest``);
``token_level_grid`` links the cells to their studies. A rerun skips the seeds already stored or finished on
disk. At the end: one row per cell (``summary.study_stats.drift_point``), the cell the grid's ``rule`` chooses
as the study's default (``choose_default``; docs/math.md §5.1) and a benchmark line (elapsed, per cell).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from analysis.token_columns import OWN_UPDATE
from analysis.token_level.cli import ERR, add_run_options, ingest, out_root, run_studies, stored_in
from analysis.token_level.compute.study_config import StudyInputError, compose_study, study_id_of, validate
from analysis.token_level.summary.study_stats import DriftPoint
from predmask.config import ConfigError, bare_key, compose, stable_id, to_container
from predmask.console import error, make_console
from predmask.rundir import first_line

if TYPE_CHECKING:
    import polars as pl


PRIMARY = "drift"
SCHEMA = "drift_schema"
#: top-level keys of the grid config: an override naming one of them changes the grid, any other a study key
GRID_KEYS: tuple[str, ...] = ("name", "seeds", "fixed", "axes", "rule")
#: the cell parameters token_level_grid stores as columns (read from each cell's composed study config)
CELL_COLUMNS: tuple[str, ...] = ("lr", "staleness", "minibatches", "sequences")


@dataclass(frozen=True, kw_only=True)
class RuleSettings:
    """The ``rule:`` block: how the study's default is chosen from the grid (``choose_default``)."""

    precision: str
    pooled_over_seeds: int
    min_pooled_disagree: int


@dataclass(frozen=True, kw_only=True)
class DriftGridConfig:
    """The grid's schema (Hydra's ConfigStore: drift_schema)."""

    name: str
    seeds: int
    fixed: dict[str, Any]
    axes: dict[str, list[Any]]
    rule: RuleSettings


@dataclass(frozen=True)
class Cell:
    """One cell of the grid: its index, axis values, study overrides, composed study config and study id."""

    index: int
    params: dict[str, Any]
    overrides: tuple[str, ...]
    config: dict[str, Any]
    study_id: str

    @property
    def precision(self) -> str:
        return str(self.config["precision"]["name"])

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items())


# ------------------------------------------------------------------------------------------- the grid


def _split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(grid overrides, study overrides): a key naming a grid key (or below one) changes the grid."""
    grid, study = [], []
    for ov in overrides:
        (grid if bare_key(ov).split(".", 1)[0] in GRID_KEYS else study).append(ov)
    return grid, study


def compose_grid(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The resolved grid config: conf/drift.yaml with grid ``overrides`` (checked: one-line StudyInputError)."""
    try:
        grid = to_container(compose(PRIMARY, list(overrides), schemas={SCHEMA: DriftGridConfig}))
    except (ConfigError, ValueError) as err:
        raise StudyInputError(first_line(err)) from None
    if grid["seeds"] < 1:
        raise StudyInputError(f"seeds must be >= 1, got {grid['seeds']}")
    if not grid["axes"]:
        raise StudyInputError("axes must name at least one study key with a list of values, got none")
    for key, values in grid["axes"].items():
        if not isinstance(values, list) or not values:
            raise StudyInputError(f"axes.{key} must be a non-empty list of values, got {values!r}")
        if len(set(map(repr, values))) != len(values):
            raise StudyInputError(f"axes.{key} lists a value twice: {values}")
        if key in grid["fixed"]:
            raise StudyInputError(f"{key} is both a grid axis and a fixed override; keep one")
    rule = grid["rule"]
    if rule["pooled_over_seeds"] < 1 or rule["min_pooled_disagree"] < 0:
        raise StudyInputError(
            f"rule needs pooled_over_seeds >= 1 and min_pooled_disagree >= 0, got {rule['pooled_over_seeds']} and "
            f"{rule['min_pooled_disagree']}"
        )
    return grid


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else str(value)


def _flatten(prefix: str, value: Any) -> list[str]:
    """``key=value`` overrides of a (nested) mapping: {model: {hidden_size: 32}} -> model.hidden_size=32."""
    if isinstance(value, Mapping):
        return [ov for k, v in value.items() for ov in _flatten(f"{prefix}.{k}" if prefix else str(k), v)]
    return [f"{prefix}={_value(value)}"]


def expand(
    grid: Mapping[str, Any], study_overrides: Sequence[str] = (), cluster: str | None = None
) -> list[Cell]:
    """The grid's cells in axis order (the last axis varies fastest), each composed and validated."""
    axes = dict(grid["axes"])
    for key in map(bare_key, study_overrides):
        if key in axes:
            raise StudyInputError(f"{key} is a grid axis; change it with axes.{key}=[...]")
    fixed = _flatten("", dict(grid["fixed"]))
    cells = []
    for index, combo in enumerate(itertools.product(*axes.values())):
        params = dict(zip(axes, combo))
        overrides = (*fixed, *study_overrides, *_flatten("", params))
        cfg = compose_study(overrides, cluster)
        try:
            validate(cfg)
        except StudyInputError as err:
            where = ", ".join(f"{k}={_value(v)}" for k, v in params.items())
            raise StudyInputError(f"cell {index} ({where}): {err}") from None
        cells.append(Cell(index, params, tuple(overrides), cfg, study_id_of(cfg)))
    ids = [c.study_id for c in cells]
    if len(set(ids)) != len(ids):
        raise StudyInputError(
            "two cells of the grid compose the same study; an axis value does not change it"
        )
    return cells


def grid_id_of(grid: Mapping[str, Any], cells: Sequence[Cell]) -> str:
    """Stable id of the grid: its name and its cells' study ids (not the seed count, not the rule)."""
    return stable_id({"grid": grid["name"], "studies": [c.study_id for c in cells]}, exclude=())


def grid_rows(cells: Sequence[Cell], grid_name: str) -> list[dict[str, Any]]:
    """The token_level_grid rows of ``cells`` (analysis.store.upsert_grid)."""
    return [
        {
            "grid_name": grid_name,
            "cell": c.index,
            "study_id": c.study_id,
            "precision": c.precision,
            **{k: c.config[k] for k in CELL_COLUMNS},
            "params": c.params,
        }
        for c in cells
    ]


# ---------------------------------------------------------------------------------- choosing a default


def cell_criteria(tokens: pl.DataFrame) -> pl.DataFrame | None:
    """The criteria of a cell judged against the own-update ground truth on the disagreement set of its tokens
    (``criteria_table`` rows, what ``drift_point`` reads); None when the tokens carry no own-update truth."""
    from analysis.token_level.summary.criteria import criteria_table, judge
    from analysis.token_level.summary.study_stats import DISAGREE_SET
    from analysis.token_level.summary.study_tables import carried

    if not carried(tokens, OWN_UPDATE):
        return None
    return criteria_table(judge(tokens, DISAGREE_SET, OWN_UPDATE).values())


def cell_row(cell: Mapping[str, Any], point: DriftPoint) -> dict[str, Any]:
    """What the rule reads of a cell: its parameters (``precision``, ``cell``, ...) and its drift point."""
    return {
        **cell,
        "n_seeds": point.n_seeds,
        "share_outside": point.share_outside.fraction,
        "disagree_per_seed": point.disagree_per_seed.mean,
    }


def pooled_disagree(row: Mapping[str, Any], rule: Mapping[str, Any]) -> float | None:
    """The cell's disagreement tokens pooled over the rule's seed count: mean per seed x ``pooled_over_seeds``."""
    per_seed = row["disagree_per_seed"]
    return None if per_seed is None or row["n_seeds"] == 0 else per_seed * rule["pooled_over_seeds"]


def measurable(row: Mapping[str, Any], rule: Mapping[str, Any]) -> bool:
    """The rule's test of one cell: the paired statistics, pooled over seeds, have enough tokens. The cell has
    seeds, and its mean disagreement tokens per seed x ``pooled_over_seeds`` >= ``min_pooled_disagree``."""
    pooled = pooled_disagree(row, rule)
    return pooled is not None and pooled >= rule["min_pooled_disagree"]


def choose_default(rows: Sequence[Mapping[str, Any]], rule: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The lowest-drift measurable cell of ``rule.precision``: of the cells of that precision that pass
    ``measurable``, the one with the lowest measured share outside (ties: the earlier cell); None if none passes."""
    ok = [r for r in rows if r["precision"] == rule["precision"] and measurable(r, rule)]
    return min(ok, key=lambda r: (r["share_outside"], r["cell"])) if ok else None


# ------------------------------------------------------------------------------------------------ running


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis drift",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "The token-level study over a grid of drift (conf/drift.yaml): every combination of the grid's axes "
            "(lr x staleness x precision by default) is one study with its own study id, stored in the "
            "token_level_* tables and linked to the grid in token_level_grid. Prints, per cell, the measured share "
            "of response tokens outside the trust region and the paper's statistics there, and the cell the grid's "
            "rule chooses as the study's default. A rerun keeps every finished seed."
        ),
        epilog=(
            "overrides (key=value):\n"
            "  seeds=N, name=..., axes.KEY=[...], (+)fixed.KEY=VALUE, rule.KEY=VALUE   change the grid\n"
            "  any other key (checkpoint=..., delta=..., model.hidden_size=...)   a study override of every cell\n\n"
            "examples:\n"
            "  python -m analysis drift\n"
            "  python -m analysis drift seeds=3 axes.precision=[bf16] axes.lr=[3e-4] axes.staleness=[3,7]\n"
            "  python -m analysis drift --dry-run"
        ),
    )
    add_run_options(p, "print the cells and their study ids; run nothing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="grid or study overrides (see below)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    console = make_console(min_width=210)
    try:
        if args.workers is not None and args.workers < 1:
            raise StudyInputError(f"--workers must be >= 1, got {args.workers}")
        grid_ovs, study_ovs = _split_overrides(args.overrides)
        grid = compose_grid(grid_ovs)
        cells = expand(grid, study_ovs, args.cluster)
        if cells[0].config.get("checkpoint") is not None:
            from analysis.token_level.compute.backend import check_checkpoint

            check_checkpoint(cells[0].config)
    except StudyInputError as err:
        error(str(err))
        return 2
    grid_id = grid_id_of(grid, cells)
    console.print(
        escape(
            f"drift grid {grid['name']} {grid_id}: {len(cells)} cells x {grid['seeds']} seeds "
            f"({', '.join(f'{k} {_value(v)}' for k, v in grid['axes'].items())}; fixed {' '.join(_flatten('', grid['fixed']))})"
        )
    )
    if args.dry_run:
        for c in cells:
            console.print(escape(f"  cell {c.index:>2}: {c.describe()} -> study {c.study_id}"))
        return 0
    return _run(args, grid, grid_id, cells, console)


def _run(
    args: argparse.Namespace, grid: Mapping[str, Any], grid_id: str, cells: list[Cell], console: Console
) -> int:
    from analysis.store import StoreError, check_db_path, connect, paper_command
    from analysis.store.token_level_tables import upsert_grid
    from analysis.token_level.compute.fanout import SeedFiles
    from predmask.rundir import db_or_default

    t0 = time.perf_counter()
    db, out = db_or_default(args.db), out_root(args.out)
    seeds = list(range(grid["seeds"]))
    try:
        check_db_path(db)  # before any seed runs: a bad path costs nothing
        stored = {c.index: stored_in(db, c.study_id) for c in cells}
    except StoreError as err:
        error(str(err))
        return 2
    unstored = {i: [s for s in seeds if s not in done] for i, done in stored.items()}
    pending = {c.index: [s for s in unstored[c.index] if not SeedFiles(out / c.study_id).done(s)]
               for c in cells}
    n_pending = sum(map(len, pending.values()))
    console.print(
        f"{len(cells) * len(seeds) - n_pending} of {len(cells) * len(seeds)} cell seeds done; {n_pending} to run"
    )
    failures: list[str] = []
    interrupted = False
    if n_pending:
        failures, interrupted = run_studies(
            [(c.config, out / c.study_id, pending[c.index]) for c in cells], args, f"drift grid {grid_id}: cell seeds",
            out / "jobs" / grid_id, out / "jobs" / grid_id / "drift.log", console,
        )
    try:  # every cell's seeds not yet stored, and the cells linked to their studies
        for c in cells:
            ingest(db, c.study_id, c.config, out / c.study_id, unstored[c.index])
        with connect(db) as con:
            upsert_grid(con, grid_id, grid_rows(cells, grid["name"]))
    except StoreError as err:
        error(str(err))
        return 1
    for msg in failures:
        error(msg)
    if interrupted:
        ERR.print("interrupted: finished seeds are stored; rerun the same command to run the others")
        return 130
    missing = _print_grid(db, grid, grid_id, cells, seeds, console, time.perf_counter() - t0)
    if missing:
        error(f"{missing} cell seed(s) are not stored; rerun the same command to run them")
        return 1
    console.print(f"next: {paper_command(args.db)} (fig9_drift_sensitivity draws the grid)", markup=False)
    return 0


def _pct(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{100 * v:.{digits}f}%"


def _grid_table(grid: Mapping[str, Any], grid_id: str, axes: Sequence[str]) -> Table:
    """The grid table's title, caption and columns (no rows)."""
    from analysis.token_level.summary.report import titled_table

    rule = grid["rule"]
    at = rule["pooled_over_seeds"]
    t = titled_table(
        f"drift grid {grid['name']} {grid_id} ({' '.join(_flatten('', grid['fixed']))}): both criteria against "
        "the own update, and the paper's statistics, per cell",
        "share outside: outside tokens / response tokens, pooled over seeds; disagree: aggregated-tail "
        f"predictive vs ratio; x{at}: disagreement tokens per seed x {at} seeds (pooled at the study's default "
        "seed count).\n"
        "own update (docs/math.md §5.1), on the disagreement tokens with a truth: balanced accuracy of each "
        f"criterion against {OWN_UPDATE} > 0, pooled, 95% seed-cluster bootstrap interval; Δ: predictive − ratio per "
        "seed (percentage points), mean with its 95% t interval, and the seeds where predictive is lower / tied "
        "/ higher; — where the study's tokens carry no own-update truth.\n"
        "paper's statistics: unsafe-keep: mean over paired seeds (both criteria kept a disagreement token); "
        "corrective: pooled. Paper (Qwen3, 61 seeds): share outside not reported (0.017%-0.14% for a mean "
        "response length of 8,192-1,024 tokens, assumed), disagreement ≈ 82 of 1,435 outside (5.7%), "
        "unsafe-keep 34.2% vs 36.9%, corrective 65.1% vs 62.9%.\n"
        f"measurable (rule): mean disagreement tokens per seed x {at} >= {rule['min_pooled_disagree']:,} (the "
        "paired statistics pool over seeds: no seed needs a minimum); default = the measurable "
        f"{rule['precision']} cell with the lowest share outside.",
        ("cell", "precision", *axes, "seeds", "share outside", "outside/seed", "disagree/seed (min)", f"x{at}",
         "bal. acc. pred", "bal. acc. ratio", "Δ bal. acc. [95% t]", "lower/tied/higher", "disagree share", "paired",
         "pred lower", "unsafe-keep pred", "ratio", "corrective pred", "ratio", "cpu s"),
        left=0,
    )
    t.add_column("rule", justify="left")
    return t


def _row_cells(c: Cell, p: DriftPoint, row: Mapping[str, Any], rule: Mapping[str, Any], axes: Sequence[str],
               cpu: float | None, mark: str) -> list[str]:
    """One cell's row of the grid table, in ``_grid_table``'s column order."""
    outside, disagree = p.outside_per_seed.mean, p.disagree_per_seed.mean
    pooled, diff = pooled_disagree(row, rule), p.balanced_difference
    return [
        str(c.index),
        c.precision,
        *[_value(c.params[k]) for k in axes],
        str(p.n_seeds),
        _pct(p.share_outside.fraction, 3),
        "—" if outside is None else f"{outside:,.1f}",
        "—" if disagree is None else f"{disagree:.1f} ({p.min_disagree})",
        "—" if pooled is None else f"{pooled:,.0f}",
        "—" if p.balanced_predictive is None else p.balanced_predictive.pct(),
        "—" if p.balanced_ratio is None else p.balanced_ratio.pct(),
        "—" if diff is None else diff.pp(),
        "—" if diff is None else f"{diff.n_lower}/{diff.n_tied}/{diff.n_higher}",
        _pct(p.disagreement.fraction, 1),
        f"{p.n_paired}/{p.n_seeds}",
        f"{p.n_lower}/{p.n_paired}",
        _pct(p.unsafe_keep_predictive.mean, 1),
        _pct(p.unsafe_keep_ratio.mean, 1),
        _pct(p.corrective_predictive.fraction, 1),
        _pct(p.corrective_ratio.fraction, 1),
        "—" if cpu is None else f"{cpu:.0f}",
        mark,
    ]


def _notes(chosen: Mapping[str, Any] | None, cells: Sequence[Cell], grid: Mapping[str, Any], elapsed: float,
           cpu: Mapping[int, float]) -> list[str]:
    """The lines under the table: the cell the rule chose as the study's default (or why none), the benchmark."""
    rule, cpu_total = grid["rule"], sum(cpu.values())
    if chosen is None:
        default = f"no {rule['precision']} cell is measurable by the rule: raise the drift or the sequences"
    else:
        c = cells[chosen["cell"]]
        default = escape(
            f"default by the rule: cell {c.index} ({c.describe()}; {' '.join(_flatten('', grid['fixed']))}): share "
            f"outside {_pct(chosen['share_outside'], 3)}, {chosen['disagree_per_seed']:.1f} disagreement tokens per "
            f"seed ({pooled_disagree(chosen, rule):,.0f} pooled over {rule['pooled_over_seeds']} seeds) in "
            f"{chosen['n_seeds']} seeds"
        )
    per_cell = ", ".join(f"{i}: {v:.0f}" for i, v in cpu.items())
    benchmark = (f"benchmark: elapsed {elapsed:.0f} s ({elapsed / 60:.1f} min) for {len(cells)} cells; worker CPU "
                 f"seconds {cpu_total:.0f} in all, {cpu_total / max(1, len(cells)):.0f} per cell on average; per "
                 f"cell: {per_cell}")
    return [default, benchmark]


def _print_grid(
    db: Path,
    grid: Mapping[str, Any],
    grid_id: str,
    cells: Sequence[Cell],
    seeds: Sequence[int],
    console: Console,
    elapsed: float,
) -> int:
    """The grid table, the chosen default and the benchmark line; returns the number of missing cell seeds."""
    from analysis.store import connect
    from analysis.token_level.summary.report import load_study
    from analysis.token_level.summary.study_stats import drift_point

    with connect(db, read_only=True) as con:
        studies = {c.index: load_study(con, c.study_id, seeds) for c in cells}
    frames = {i: study.seeds for i, study in studies.items()}
    rule = grid["rule"]
    points = {c.index: drift_point(frames[c.index], cell_criteria(studies[c.index].tokens)) for c in cells}
    rows = [cell_row({"cell": c.index, "precision": c.precision, **c.params}, points[c.index]) for c in cells]
    chosen = choose_default(rows, rule)
    axes = [k for k in grid["axes"] if k != "precision"]
    cpu = {  # worker CPU seconds of each cell's stored seeds (the benchmark)
        c.index: float(frames[c.index].get_column("cpu_seconds").sum())
        for c in cells
        if frames[c.index].height and "cpu_seconds" in frames[c.index].columns
    }
    t = _grid_table(grid, grid_id, axes)
    for c, row in zip(cells, rows):
        mark = "default" if chosen is not None and chosen["cell"] == c.index else "ok" if measurable(row, rule) else ""
        t.add_row(*_row_cells(c, points[c.index], row, rule, axes, cpu.get(c.index), mark))
    console.print(t)
    for line in _notes(chosen, cells, grid, elapsed, cpu):
        console.print(line)
    return sum(len(seeds) - frames[c.index].height for c in cells)
