"""The results database as DataFrames for notebooks: runs, metric curves, the main results, the token-level study
(its rows, its summary, and its criteria judged against the per-token ground truths).

No number is computed here: the main results and smoothing come from ``analysis.training.stats`` (as in the
reports), the token-level statistics from ``analysis.token_level.summary.study_stats`` (as the study's CLI),
the validation curves from ``analysis.results.curves``. An unknown name raises ``UnknownNameError`` listing
what exists.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

import duckdb
import numpy as np
import polars as pl

from analysis.results import curves
from analysis.store import connect, run_sweeps, table_exists
from analysis.token_level.summary import study_stats as token_stats
from analysis.token_level.summary.study_tables import STUDY_TABLES
from analysis.training import stats as training_stats
from predmask import config
from predmask.command_text import command
from predmask.rundir import db_or_default

Backend = Literal["pandas", "polars"]
BACKENDS: tuple[str, ...] = ("pandas", "polars")
LEVELS: tuple[str, ...] = ("seed", "token")
#: the run axes every frame of runs or metrics carries, in this order
AXES: tuple[str, ...] = ("sweep", "method", "setting", "model", "precision", "delta", "seed", "backend")


class UnknownNameError(ValueError):
    """A name the database (or the library) does not have; the message lists the names that exist."""

    def __init__(self, what: str, name: object, known: Iterable[object]) -> None:
        listed = ", ".join(str(k) for k in known) or "none"
        super().__init__(f"unknown {what} {name!r}; this database has: {listed}")


def _check(what: str, names: Iterable[Any], known: Sequence[Any]) -> None:
    have = set(known)
    for name in names:
        if name not in have:
            raise UnknownNameError(what, name, known)


def _as_list(value: Any) -> list[Any]:
    return [value] if isinstance(value, (str, int, float)) else list(value)


def _metric_list(names: Any) -> list[str]:
    """The metric names asked for, each once (in the order first given): a name, or a list or tuple of names;
    anything else raises TypeError naming it."""
    listed = [names] if isinstance(names, str) else list(names) if isinstance(names, (list, tuple)) else None
    odd = [names] if listed is None else [n for n in listed if not isinstance(n, str)]
    if odd:
        raise TypeError(f"metric names are strings: give a name or a list of names (Results.metric_names() lists "
                        f"them), got {type(odd[0]).__name__} {odd[0]!r}")
    return list(dict.fromkeys(listed or []))


@cache
def _settings() -> dict[tuple[str, str], str]:
    """(paper model, precision) -> the conf/setting option that selects them."""
    out: dict[tuple[str, str], str] = {}
    for name in config.group_options("setting"):
        choice = config.option_choices("setting", name)
        out[(choice["model"], choice["precision"])] = name
    return out


def _run_setting(run_config: Mapping[str, Any], paper_model: str | None, precision: str | None) -> str | None:
    """The run's paper setting: its config's ``setting.name``, else the conf/setting of its (paper model,
    precision); None when no setting selects them."""
    node = run_config.get("setting")
    if isinstance(node, Mapping) and isinstance(node.get("name"), str):
        return node["name"]
    if paper_model is None or precision is None:
        return None
    return _settings().get((paper_model, precision))


@cache
def _model_label(model: str) -> str:
    """conf/model's label (for a CPU model it says what it stands in for), or the raw name conf/ lacks."""
    return config.known_label("model", model)


def _anchor(run_config: Mapping[str, Any]) -> str | None:
    """The anchor of the run's ratio (``predmask.methods.method_anchor``: recorded, else the method's default);
    None for a run without a method this code knows."""
    from predmask.methods import method_anchor  # lazy: torch is needed only here

    section = run_config.get("method")
    if not isinstance(section, Mapping):
        return None
    try:  # only the keys the anchor depends on: an old config's other parameters may no longer validate
        return method_anchor({k: section[k] for k in ("name", "anchor") if k in section})
    except ValueError:
        return None


def _run_frame(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """One row per run: the stored columns (``sweep``: its newest ingest's), every sweep that holds it (``sweeps``,
    ``analysis.store.run_sweeps``) and the axes derived from its config (setting, paper model, anchor, scale)."""
    schema = {
        "run_id": pl.String,
        "sweep": pl.String,
        "sweeps": pl.List(pl.String),
        "method": pl.String,
        "setting": pl.String,
        "model": pl.String,
        "paper_model": pl.String,
        "precision": pl.String,
        "delta": pl.Float64,
        "seed": pl.Int64,
        "backend": pl.String,
        "status": pl.String,
        "anchor": pl.String,
        "scale": pl.String,
        "run_dir": pl.String,
        "updated_at": pl.Datetime("us"),
    }
    if not table_exists(con, "runs"):
        return pl.DataFrame(schema=schema)
    rows = con.execute(
        "SELECT run_id, sweep, method, model, precision, delta, seed, backend, status, config, run_dir, "
        "updated_at FROM runs ORDER BY sweep, run_id"
    ).fetchall()
    held = run_sweeps(con)
    out = []
    for run_id, sweep, method, model, precision, delta, seed, backend, status, cfg, run_dir, updated in rows:
        parsed = curves.json_object(cfg)
        paper = curves.paper_model(model, parsed) or model
        out.append((run_id, sweep, list(held.get(run_id, ())), method, _run_setting(parsed, paper, precision), model, paper, precision, delta,
                    seed, backend, status, _anchor(parsed), _model_label(model) if model else None, run_dir, updated))
    return pl.DataFrame(out, schema=schema, orient="row")  # each row in the schema's column order


@dataclass(frozen=True)
class _Run:
    """What pairing needs of a run (``curves.RunKey``)."""

    run_id: str
    method: str | None
    seed: int | None


@cache
def _method_order() -> dict[str, int]:
    from predmask.methods import METHODS  # lazy: torch is needed only here

    return {name: i for i, name in enumerate(METHODS)}


def _method_rank(method: str | None) -> tuple[int, str]:
    return (_method_order().get(method or "", len(_method_order())), method or "")


def _smoothing(smooth: float | training_stats.Smoothing | None) -> training_stats.Smoothing | None:
    if smooth is None or isinstance(smooth, training_stats.Smoothing):
        return smooth
    if isinstance(smooth, bool) or not isinstance(smooth, (int, float)):
        raise TypeError(
            f"smooth must be None, a half-life in logged points (a number >= 0) or a Smoothing, got {smooth!r}"
        )
    return training_stats.Smoothing(float(smooth))


def _interval(prefix: str, iv: training_stats.Interval | None) -> dict[str, float | int | None]:
    if iv is None:
        return {f"{prefix}_mean": None, f"{prefix}_lo": None, f"{prefix}_hi": None}
    return {f"{prefix}_mean": iv.mean, f"{prefix}_lo": iv.lo, f"{prefix}_hi": iv.hi}


def _difference(prefix: str, d: training_stats.PairedDifference | None) -> dict[str, float | int | None]:
    row = _interval(prefix, d.interval if d is not None else None)
    row[f"{prefix}_n"] = d.n if d is not None else None
    row[f"{prefix}_positive"] = d.n_positive if d is not None else None
    return row


def _keys(keys: Iterable[Hashable]) -> str:
    return ", ".join(str(k) for k in keys)


def _distinct(frame: pl.DataFrame, column: str) -> list[Any]:
    return sorted(v for v in frame.get_column(column).unique().to_list() if v is not None)


def _sweeps(frame: pl.DataFrame) -> list[str]:
    """The sweeps that hold any run of the frame."""
    return _distinct(frame.select(pl.col("sweeps").explode()), "sweeps")


def _select(
    frame: pl.DataFrame,
    sweep: str | Sequence[str] | None = None,
    method: str | Sequence[str] | None = None,
    setting: str | Sequence[str] | None = None,
    seed: int | Sequence[int] | None = None,
    runs: str | Sequence[str] | None = None,
) -> pl.DataFrame:
    """The runs matching every filter given (a value or a list); a value no run has raises UnknownNameError. A run
    is of each sweep that holds it (``sweeps``): filtered by sweep, its ``sweep`` is the first one asked for."""
    if sweep is not None:
        asked = _as_list(sweep)
        _check("sweep", asked, _sweeps(frame))
        frame = frame.with_columns(
            sweep=pl.coalesce([pl.when(pl.col("sweeps").list.contains(s)).then(pl.lit(s)) for s in asked])
        ).filter(pl.col("sweep").is_not_null())
    for column, wanted in (("method", method), ("setting", setting), ("seed", seed)):
        if wanted is None:
            continue
        values = _as_list(wanted)
        _check(column, values, _distinct(frame, column))
        frame = frame.filter(pl.col(column).is_in(values))
    if runs is not None:
        ids = _as_list(runs)
        _check("run", ids, frame.get_column("run_id").to_list())
        frame = frame.filter(pl.col("run_id").is_in(ids))
    return frame


def _metric_names(con: duckdb.DuckDBPyConnection, runs: pl.DataFrame) -> list[str]:
    by_run = curves.metric_names_by_run(con, runs.get_column("run_id").to_list(), "")
    return sorted({name for names in by_run.values() for name in names})


def _studies(con: duckdb.DuckDBPyConnection) -> list[str]:
    if not table_exists(con, "token_level_studies"):
        return []
    rows = con.execute("SELECT study_id FROM token_level_studies ORDER BY study_id").fetchall()
    return [r[0] for r in rows]


def _study(con: duckdb.DuckDBPyConnection, study: str | None) -> str:
    """The study asked for, else the only one stored."""
    known = _studies(con)
    if study is not None:
        _check("study", [study], known)
        return study
    if len(known) == 1:
        return known[0]
    if not known:
        raise ValueError(f"this database has no token-level study (run {command('analysis token_level --seeds 61')})")
    raise ValueError(f"this database has {len(known)} token-level studies; name one: {', '.join(known)}")


class Results:
    """A read-only view of one results database. Every call opens the file for its own queries and closes it
    again, so a notebook left open never keeps a sweep's ingest from writing."""

    def __init__(self, path: Path, backend: Backend = "pandas") -> None:
        _check("backend", [backend], BACKENDS)
        self.path = path
        self.backend: Backend = backend
        with self._connect():  # a missing or unreadable file fails here, in one line
            pass

    def _connect(self) -> duckdb.DuckDBPyConnection:
        """The database read-only, for one ``with`` block (the connection closes at its end)."""
        return connect(self.path, read_only=True)

    def __repr__(self) -> str:
        return (
            f"Results({str(self.path)!r}: sweeps {self.sweeps()}, studies {self.studies()}; {self.backend})"
        )

    def _out(self, frame: pl.DataFrame) -> Any:
        if self.backend == "polars":
            return frame
        try:
            return frame.to_pandas()
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"backend 'pandas' needs pandas installed ({exc}); pip install pandas, or use backend='polars'"
            ) from exc

    def sweeps(self) -> list[str]:
        """The sweeps that have runs in this database."""
        with self._connect() as con:
            return _sweeps(_run_frame(con))

    def metric_names(self, sweep: str | None = None) -> list[str]:
        """The metric names logged (by the runs of ``sweep`` when given)."""
        with self._connect() as con:
            return _metric_names(con, _select(_run_frame(con), sweep=sweep))

    def studies(self) -> list[str]:
        """The token-level studies stored, by id."""
        with self._connect() as con:
            return _studies(con)

    def runs(
        self,
        sweep: str | Sequence[str] | None = None,
        method: str | Sequence[str] | None = None,
        setting: str | Sequence[str] | None = None,
        seed: int | Sequence[int] | None = None,
    ) -> Any:
        """One row per run: its axes (sweep, method, setting, model, the paper model it stands for, precision,
        δ, seed, backend), every sweep that holds it (``sweeps``, comma-separated: two sweeps can hold one run;
        ``sweep`` is the first of the sweeps asked for that holds it, else the sweep ingested last), status, the
        ratio's anchor (``old`` | ``rollout``: recorded, else the method's default), scale (conf/model's label,
        which names a CPU stand-in as one), run directory and last update. Each filter takes a value or a list; a
        value no run has raises UnknownNameError."""
        with self._connect() as con:
            frame = _select(_run_frame(con), sweep, method, setting, seed)
        return self._out(frame.with_columns(pl.col("sweeps").list.join(", ")))

    def metrics(
        self,
        names: str | Sequence[str],
        *,
        sweep: str | Sequence[str] | None = None,
        runs: str | Sequence[str] | None = None,
        smooth: float | training_stats.Smoothing | None = None,
        wide: bool = False,
    ) -> Any:
        """Tidy rows (run_id, step, name, value) with the run axes, ordered by run, name and step; ``wide``: one
        column per metric (run axes, step, then the metrics; null where a run did not log one at a step). ``names``:
        a metric name or a list of them (a name given twice is read once).

        ``smooth``: the figures' EMA (``analysis.training.stats.Smoothing``, or its half-life in logged
        points) applied to each run's series of each metric, as the figures smooth each seed."""
        wanted = _metric_list(names)
        if not wanted:
            raise ValueError("metrics() needs at least one metric name; see Results.metric_names()")
        smoothing = _smoothing(smooth)
        with self._connect() as con:
            every = _run_frame(con)
            selected = _select(every, sweep=sweep, runs=runs)
            _check("metric", wanted, _metric_names(con, every))
            series = curves.metric_series(con, selected.get_column("run_id").to_list(), wanted)
        schema = {"run_id": pl.String, "step": pl.Int64, "name": pl.String, "value": pl.Float64}
        parts = [
            pl.DataFrame(
                {"run_id": run_id, "step": steps, "name": name,
                 "value": values if smoothing is None else smoothing.apply(values)},
                schema=schema,
            )
            for (run_id, name), (steps, values) in series.items()
        ]
        tidy = pl.concat(parts) if parts else pl.DataFrame(schema=schema)
        axes = selected.select("run_id", *AXES)
        tidy = tidy.join(axes, on="run_id", how="left").select("run_id", *AXES, "step", "name", "value")
        if wide:
            present = [n for n in wanted if n in set(tidy.get_column("name").to_list())]
            tidy = tidy.pivot(on="name", index=["run_id", *AXES, "step"], values="value")
            tidy = tidy.select("run_id", *AXES, "step", *present).sort("run_id", "step")
        return self._out(tidy)

    def summary(self, sweep: str) -> Any:
        """The main results of a sweep, one row per (setting, model, δ, method): final, best and AUC validation
        accuracy over seeds (mean and 95% t-interval; ``lo``/``hi`` null for one seed), the method a predictive
        mask is paired with and the paired differences in final accuracy and AUC (mean, interval, pairs, pairs
        > 0), and the seeds that collapsed: the numbers of Table 2 of the reports, from the same functions.
        Validation accuracy is the mean of the two AIME scores; runs without both are left out."""
        with self._connect() as con:
            selected = _select(_run_frame(con), sweep=sweep)
            val = curves.validation_by_run(con, selected.get_column("run_id").to_list())
        rows: list[dict[str, Any]] = []
        groups = ("setting", "paper_model", "model", "precision", "delta")
        for key, members in selected.group_by(groups, maintain_order=True):
            runs = [_Run(r["run_id"], r["method"], r["seed"]) for r in members.iter_rows(named=True)]
            by_method = curves.by_method_and_seed(runs, val, rank=_method_rank)
            results = training_stats.setting_results({str(m): g for m, g in by_method.items()})
            axes = dict(zip(groups, key))
            for method, r in results.items():
                ref = r.vs_final.reference if r.vs_final is not None else None
                rows.append(
                    {
                        "sweep": sweep,
                        **axes,
                        "method": method,
                        "n_seeds": r.n,
                        "seeds": _keys(r.runs),
                        **_interval("final", r.final),
                        **_interval("best", r.best),
                        **_interval("auc", r.auc),
                        "reference": ref,
                        **_difference("d_final", r.vs_final),
                        **_difference("d_auc", r.vs_auc),
                        "n_collapsed": len(r.collapsed),
                        "collapsed_seeds": _keys(r.collapsed),
                    }
                )
        if not rows:
            return self._out(pl.DataFrame(schema={"sweep": pl.String, **{g: pl.String for g in groups}}))
        frame = pl.DataFrame(rows, infer_schema_length=None)
        return self._out(
            frame.sort(["setting", "model", "precision", "delta"], nulls_last=True, maintain_order=True)
        )

    def token_level(self, study: str | None = None, level: str = "seed") -> Any:
        """A token-level study's rows as stored: ``level="seed"`` one row per seed (the per-seed counts and
        rates), ``level="token"`` one row per studied token. ``study`` None: the only study stored."""
        _check("level", [level], LEVELS)
        table = "token_level_seeds" if level == "seed" else "token_level_tokens"
        order = "seed" if level == "seed" else "seed, sequence, position"
        with self._connect() as con:
            study_id = _study(con, study)
            frame = curves.study_rows(con, table, study_id, order)
        return self._out(frame)

    def token_level_summary(self, study: str | None = None) -> Any:
        """The study's numbers as the study's CLI prints them
        (``analysis.token_level.summary.study_stats.study_summary``), one row per quantity and criterion: mean ±
        standard error over seeds (``over`` says which seeds: all, or the paired seeds of a comparison),
        pooled fractions k / n with their Wilson interval, the CLI's text, and the paper's number where the
        paper reports it."""
        with self._connect() as con:
            study_id = _study(con, study)
            seeds = curves.study_rows(con, "token_level_seeds", study_id, "seed")
        summary = token_stats.study_summary(seeds)
        rows = [_count_row("seeds", None, summary.n_seeds, "seeds")]
        rows.append(_mean_row("outside per seed", None, summary.outside, "outside_per_seed", count=True))
        for crit, pair in summary.pairs.items():
            u = pair.unsafe_keep
            lower = _count_row("seeds where predictive is lower", crit, u.n_lower, "seeds_predictive_lower")
            rows += [
                _mean_row("disagreement per seed", crit, pair.disagree, "disagree_per_seed", True),
                _mean_row("unsafe-keep, predictive", crit, u.pred_mean, "unsafe_keep_predictive"),
                _mean_row("unsafe-keep, ratio", crit, u.ratio_mean, "unsafe_keep_ratio"),
                {**lower, "n": u.n_paired, "over": "paired seeds", "text": f"{u.n_lower} of {u.n_paired}"},
                _pooled_row("corrective, predictive", crit, pair.corrective_pred, "corrective_predictive"),
                _pooled_row("corrective, ratio", crit, pair.corrective_ratio, "corrective_ratio"),
            ]
        return self._out(pl.DataFrame(rows, schema=_SUMMARY_SCHEMA))

    def _study_table(self, table: str, study: str | None) -> Any:
        """A study's rows of one study-level table as ingest stored them, in the table's column order
        (``analysis.token_level.summary.study_tables.STUDY_TABLES``); none stored: an empty frame of those columns."""
        schema = {"study_id": pl.String, **STUDY_TABLES[table]}
        with self._connect() as con:
            study_id = _study(con, study)
            stored = curves.study_rows(con, table, study_id)
        if stored.height == 0:
            return self._out(pl.DataFrame(schema=schema))
        keys = [c for c in schema if c in ("token_set", "truth", "criterion", "ddot", "seed")]
        return self._out(
            stored.select([c for c in schema if c in stored.columns]).sort(keys, maintain_order=True)
        )

    def token_level_criteria(self, study: str | None = None) -> Any:
        """The study's criteria judged against each per-token ground truth (docs/math.md §5.1), pooled over all its
        stored seeds: one row per token set × ground truth × criterion, with accuracy and balanced accuracy and
        their 95% seed-cluster bootstrap intervals (``accuracy_wilson_indep_*``: the Wilson interval, which assumes
        independent tokens), the constant predictor, and the paired per-seed comparison with the ratio criterion
        (``vs_ratio_*``). Empty for a study whose tokens carry no own-update ground truth (``ddot_net``)."""
        return self._study_table("token_level_criteria", study)

    def token_level_criteria_seeds(self, study: str | None = None) -> Any:
        """The per-seed rates behind ``token_level_criteria``: one row per token set × ground truth × criterion ×
        seed (tokens judged, right decisions, accuracy, balanced accuracy). The table ``token_level_criteria_seeds``."""
        return self._study_table("token_level_criteria_seeds", study)

    def token_level_sign_agreement(self, study: str | None = None) -> Any:
        """How often each network-aware ground truth and the logit-space prediction A·Ḋ of each tail agree in sign
        on the outside tokens (the paper's §3.4 caveat, measured), with the seed-cluster and Wilson intervals. The
        table ``token_level_sign_agreement``."""
        return self._study_table("token_level_sign_agreement", study)


_SUMMARY_SCHEMA = {
    "quantity": pl.String,
    "criterion": pl.String,
    "value": pl.Float64,
    "se": pl.Float64,
    "lo": pl.Float64,
    "hi": pl.Float64,
    "k": pl.Int64,
    "n": pl.Int64,
    "over": pl.String,
    "text": pl.String,
    "paper": pl.String,
}


def _row(quantity: str, criterion: str | None, paper: str | None, **values: Any) -> dict[str, Any]:
    """A row of ``_SUMMARY_SCHEMA``; ``paper``: the key of the paper's number printed beside it (None: none), which
    the paper reports for the study and for its own criterion (``HEADLINE``) only."""
    paper_text = token_stats.paper_text(paper) if paper and criterion in (None, token_stats.HEADLINE) else None
    return {key: values.get(key) for key in _SUMMARY_SCHEMA} | {
        "quantity": quantity, "criterion": criterion, "paper": paper_text}


def _count_row(quantity: str, criterion: str | None, value: int, paper: str | None) -> dict[str, Any]:
    return _row(quantity, criterion, paper, value=float(value), text=str(value))


def _mean_row(
    quantity: str, criterion: str | None, m: token_stats.MeanSE, paper: str | None, count: bool = False
) -> dict[str, Any]:
    return _row(quantity, criterion, paper, value=m.mean, se=m.se, n=m.n, over=m.over,
                text=m.count() if count else m.pct())


def _pooled_row(
    quantity: str, criterion: str | None, p: token_stats.Pooled, paper: str | None
) -> dict[str, Any]:
    lo, hi = p.interval
    return _row(quantity, criterion, paper, value=p.fraction, lo=None if np.isnan(lo) else lo,
                hi=None if np.isnan(hi) else hi, k=p.k, n=p.n, over="tokens pooled over seeds", text=p.pct())


def open_results(db: str | os.PathLike[str] | None = None, *, backend: Backend = "pandas") -> Results:
    """Open the results database read-only: ``db``, else ``$PREDMASK_DB``, else results/predmask.duckdb (the
    commands' default). Raises StoreError (one line) when the file is missing or cannot be opened."""
    return Results(db_or_default(db), backend)
