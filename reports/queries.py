"""Read-only queries behind the reports: runs and their settings, metric series, token-level studies."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import polars as pl

from analysis.results import curves
from analysis.store import STUDY_RESULT_KEYS, run_sweeps, table_exists
from reports import labels


def count_rows(con: duckdb.DuckDBPyConnection, table: str) -> int:
    return (
        int(con.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0]) if table_exists(con, table) else 0
    )


# ----------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunInfo:
    """One row of `runs` with what the reports derive from it (setting, stand-in, backend). ``sweeps``: every sweep
    that holds the run (``analysis.store.run_sweeps``; not given: ``sweep``, the sweep of its newest ingest)."""

    run_id: str
    sweep: str | None
    method: str | None
    delta: float | None
    model: str | None
    precision: str | None
    seed: int | None
    backend: str | None
    status: str | None
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    sweeps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.sweeps and self.sweep is not None:
            object.__setattr__(self, "sweeps", (self.sweep,))

    @property
    def stands_in_for(self) -> str | None:
        return curves.paper_model(self.model, self.config)

    @property
    def paper_model(self) -> str:
        return self.stands_in_for or self.model or "unknown model"

    @property
    def setting(self) -> tuple[str, str]:
        return (self.paper_model, self.precision or "unknown precision")

    @property
    def is_cpu(self) -> bool:
        return self.backend == "local" or (self.backend is None and self.stands_in_for is not None)

    def describe_scale(self) -> str:
        if self.stands_in_for and self.model != self.stands_in_for:
            return f"{self.model} (CPU stand-in for {labels.model_label(self.stands_in_for)})"
        return labels.model_label(self.model)

    def describe_precision(self) -> str:
        if self.precision is None:  # a run without a precision option (the variational family's stages)
            return "none set (the CPU engine's default)" if self.is_cpu else "none set"
        label = labels.precision_label(self.precision)
        return (
            f"{label} (emulated on CPU)"
            if self.is_cpu
            else f"{label} (real, {self.backend or 'unknown backend'})"
        )

    def describe_backend(self) -> str:
        if self.backend == "local":
            return "local (CPU engine)"
        if self.backend == "slurm":
            return "slurm (VeRL)"
        return self.backend or "unknown"


def load_runs(con: duckdb.DuckDBPyConnection) -> list[RunInfo]:
    """Every registered run (empty when the table does not exist)."""
    if not table_exists(con, "runs"):
        return []
    rows = con.execute(
        "SELECT run_id, sweep, method, delta, model, precision, seed, backend, status, config FROM runs ORDER BY run_id"
    ).fetchall()
    held = run_sweeps(con)
    return [RunInfo(*r[:9], config=curves.json_object(r[9]), sweeps=held.get(r[0], ())) for r in rows]


@dataclass(frozen=True)
class RunSelection:
    """The runs a figure draws from and the rule that chose them (shown on the report page)."""

    runs: tuple[RunInfo, ...]
    rule: str


def select_runs(
    runs: Sequence[RunInfo], delta: float | None, sweeps: Sequence[str] | None, default_sweep: str | None
) -> RunSelection:
    """Runs at threshold `delta` (None: any) from `sweeps` if given; else from `default_sweep` when it has
    matching runs; else from every sweep. A run is from each sweep that holds it (``RunInfo.sweeps``), once."""
    cands = [
        r for r in runs
        if delta is None or (r.delta is not None and math.isclose(r.delta, delta, rel_tol=1e-9, abs_tol=1e-12))
    ]
    where = f"δ = {delta:g}" if delta is not None else "any δ"
    if sweeps:
        chosen = [r for r in cands if not set(sweeps).isdisjoint(r.sweeps)]
        rule = f"{where}, sweep in {{{', '.join(sweeps)}}} (--sweep)"
    elif default_sweep is not None and any(default_sweep in r.sweeps for r in cands):
        chosen = [r for r in cands if default_sweep in r.sweeps]
        rule = f"{where}, sweep {default_sweep} (default for this figure; --sweep to change)"
    else:
        chosen = cands
        rule = f"{where}, all sweeps" + (f" (no {default_sweep} runs)" if default_sweep else "")
    return RunSelection(tuple(chosen), rule)


@dataclass(frozen=True)
class PanelKey:
    """One panel of a per-setting figure: a paper setting and the model that actually ran (None: no runs)."""

    paper_model: str
    precision: str
    model: str | None
    on_cpu_verl: bool = False  # trained by verl on a CPU (cluster.device=cpu), not by the CPU engine

    @property
    def title(self) -> str:
        head = labels.setting_label(self.paper_model, self.precision)
        if self.model is None:
            stand = labels.cpu_standin(self.paper_model)
            return head + (f"\n(CPU stand-in {stand}: no runs)" if stand else "\n(no runs)")
        if self.on_cpu_verl:
            return f"{head}\nCPU stand-in {self.model}, trained by verl on a CPU"
        if self.model != self.paper_model:
            return f"{head}\nCPU stand-in {self.model}, emulated precision"
        return head

    @property
    def one_line(self) -> str:
        """The title on one line, as a table's column or row names the setting: "setting (second line)"."""
        head, _, rest = self.title.partition("\n")
        if not rest:
            return head
        return f"{head} {rest}" if rest.startswith("(") else f"{head} ({rest})"


def on_cpu_verl(run: RunInfo) -> bool:
    """Whether verl trained the run on a CPU (its cluster's ``device: cpu``), not the CPU engine or GPUs."""
    cluster = run.config.get("cluster") if isinstance(run.config, dict) else None
    return isinstance(cluster, dict) and cluster.get("trainer") == "verl" and cluster.get("device") == "cpu"


def panel_keys(runs: Iterable[RunInfo]) -> list[PanelKey]:
    """The paper's four settings in order (empty when no run has them), then any other setting found; a model
    trained both by the CPU engine and by verl on a CPU gets a panel for each."""
    found: dict[tuple[str, str], set[tuple[str, bool]]] = {}
    for r in runs:
        found.setdefault(r.setting, set()).add((r.model or "?", on_cpu_verl(r)))
    keys: list[PanelKey] = []
    for setting in labels.paper_settings():
        models = sorted(found.pop(setting, set()))
        keys.extend(PanelKey(*setting, m, v) for m, v in models) if models else keys.append(
            PanelKey(*setting, None)
        )
    for setting in sorted(found):
        keys.extend(PanelKey(*setting, m, v) for m, v in sorted(found[setting]))
    return keys


def runs_in_panel(runs: Iterable[RunInfo], key: PanelKey) -> list[RunInfo]:
    return [
        r for r in runs if r.setting == (key.paper_model, key.precision) and (r.model or "?") == key.model
        and on_cpu_verl(r) == key.on_cpu_verl
    ]


def last_steps(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """run_id -> (number of logged steps, last step)."""
    if not run_ids or not table_exists(con, "metrics"):
        return {}
    rows = con.execute(
        "SELECT run_id, count(DISTINCT step), max(step) FROM metrics WHERE run_id IN (SELECT unnest(?::VARCHAR[])) "
        "GROUP BY run_id",
        [list(run_ids)],
    ).fetchall()
    return {r[0]: (int(r[1]), int(r[2])) for r in rows}


# --------------------------------------------------------------------------------------- token level


@dataclass(frozen=True)
class StudyInfo:
    """One token-level study: its id, config and what it ran on."""

    study_id: str
    config: dict[str, Any]
    n_seeds: int

    def _get(self, *path: str) -> Any:
        cur: Any = self.config
        for p in path:
            if not isinstance(cur, dict):
                return None
            cur = cur.get(p)
        return cur

    def describe(self) -> str:
        """'backend, scale, precision' in words, for labels that must never be confused with the paper's."""
        model = self._get("model", "name") or self._get("model")
        model = model if isinstance(model, str) else "unknown model"
        stands = curves.paper_model(model, self.config)
        precision = self._get("precision", "name") or self._get("precision")
        precision = precision if isinstance(precision, str) else "unknown precision"
        cluster = self._get("cluster", "name") or self._get("cluster") or self._get("backend")
        cpu = stands is not None and model != stands
        backend = "CPU engine" if cpu or cluster in (None, "local") else f"cluster ({cluster})"
        scale = f"{model} (stand-in for {labels.model_label(stands)})" if cpu else labels.model_label(model)
        prec = labels.precision_label(precision) + (" emulated" if cpu else "")
        return f"{backend}, {scale}, {prec}"


def load_studies(con: duckdb.DuckDBPyConnection) -> list[StudyInfo]:
    """Every token-level study, newest first."""
    if not table_exists(con, "token_level_studies"):
        return []
    has_seeds = table_exists(con, "token_level_seeds")
    count = "(SELECT count(*) FROM token_level_seeds s WHERE s.study_id = t.study_id)" if has_seeds else "0"
    rows = con.execute(
        f"SELECT study_id, config, {count} FROM token_level_studies t ORDER BY created_at DESC NULLS LAST, study_id"
    ).fetchall()
    return [StudyInfo(sid, curves.json_object(cfg), int(n)) for sid, cfg, n in rows]


def pick_study(studies: Sequence[StudyInfo], study_id: str | None) -> StudyInfo | None:
    """The requested study (ValueError naming the valid ids if unknown), else the one with the most seeds, the
    newest among equals (a drift grid's cells have few seeds each; the study run with ``--seeds 61`` wins)."""
    if study_id is not None:
        for s in studies:
            if s.study_id == study_id:
                return s
        raise ValueError(
            f"unknown study {study_id!r}; stored: {', '.join(s.study_id for s in studies) or 'none'}"
        )
    with_seeds = [s for s in studies if s.n_seeds > 0]
    if with_seeds:
        return max(with_seeds, key=lambda s: s.n_seeds)  # max keeps the first (newest) of equals
    return studies[0] if studies else None


def seed_rows(con: duckdb.DuckDBPyConnection, study_id: str) -> pl.DataFrame:
    """The token_level_seeds rows of one study, as stored (empty when the table does not exist)."""
    return curves.study_rows(con, "token_level_seeds", study_id, "seed").drop("study_id", strict=False)


def study_table(con: duckdb.DuckDBPyConnection, table: str, study_id: str) -> pl.DataFrame:
    """One study's rows of a study-level table (``analysis.store.STUDY_RESULT_KEYS``: the criteria judged on its
    tokens), as stored, without ``study_id``; empty when the database has no such table yet."""
    if table not in STUDY_RESULT_KEYS:
        raise ValueError(f"unknown study-level table {table!r}; valid: {', '.join(STUDY_RESULT_KEYS)}")
    return curves.study_rows(con, table, study_id).drop("study_id", strict=False)


#: the sweeps the training figures and Table 2 draw by default (conf/sweep/<name>.yaml)
MAIN_SWEEP, TIGHT_SWEEP = "main_comparison", "tight_threshold"


# -------------------------------------------------------------------------------------- variational family

#: the family's default sweep (conf: `python -m sweeps variational_reasoning`) and its stage runs without a score
VR_SWEEP = "variational_reasoning"
VR_FAMILY = "variational"


@dataclass(frozen=True)
class VrKey:
    """What a variational-family run is compared by: method, a final recipe's data setting and estimator
    (None for the baselines and the prior), its traces' regime when an ablation varies it (vr_scores)."""

    method: str | None
    data: str | None = None
    estimator: str | None = None
    regime: str | None = None

    @property
    def label(self) -> str:
        head = labels.vr_method_label(self.method)
        head = f"{head} · {labels.vr_data_label(self.data)}" if self.data else head
        return f"{head} · {self.regime}" if self.regime else head


def vr_key(run: RunInfo) -> VrKey:
    m = run.config.get("method") if isinstance(run.config.get("method"), dict) else {}
    data, est = m.get("data"), m.get("estimator")
    return VrKey(run.method, data if isinstance(data, str) else None, est if isinstance(est, str) else None)


def variational_runs(runs: Sequence[RunInfo]) -> list[RunInfo]:
    """The runs of the variational family: its stage runs (config ``family: variational``) and the engine runs
    (GRPO) of the sweeps that hold them."""
    family = {r.run_id for r in runs if r.config.get("family") == VR_FAMILY}
    sweeps = {s for r in runs if r.run_id in family for s in r.sweeps}
    return [r for r in runs
            if r.run_id in family or (r.config.get("family") is None and not sweeps.isdisjoint(r.sweeps))]


def final_values(
    con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], prefix: str
) -> dict[str, dict[str, float]]:
    """``analysis.results.curves.last_values`` without the names whose last value is missing or not finite."""
    out: dict[str, dict[str, float]] = {}
    for run_id, values in curves.last_values(con, run_ids, prefix).items():
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                out.setdefault(run_id, {})[name] = float(value)
    return out


def vr_trace_rows(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str] | None = None) -> pl.DataFrame:
    """The vr_traces rows (of the given weights-stage runs; None: all), empty when the table does not exist."""
    if not table_exists(con, "vr_traces"):
        return pl.DataFrame()
    if run_ids is None:
        return con.sql("SELECT * FROM vr_traces ORDER BY run_id, question, trace").pl()
    return con.sql(
        "SELECT * FROM vr_traces WHERE run_id IN (SELECT unnest(?::VARCHAR[])) ORDER BY run_id, question, trace",
        params=[list(run_ids)],
    ).pl()


@dataclass(frozen=True)
class WeightingAnalysis:
    """The newest accuracy-weighting analysis: its id, config and rows (accuracy_weighting)."""

    analysis_id: str
    config: dict[str, Any]
    rows: pl.DataFrame


def latest_weighting(con: duckdb.DuckDBPyConnection) -> WeightingAnalysis | None:
    """The newest analysis of accuracy_weighting_analyses with its rows (None without one)."""
    if not table_exists(con, "accuracy_weighting") or not table_exists(con, "accuracy_weighting_analyses"):
        return None
    found = con.execute(
        "SELECT analysis_id, config FROM accuracy_weighting_analyses ORDER BY created_at DESC NULLS LAST, "
        "analysis_id LIMIT 1"
    ).fetchall()
    if not found:
        return None
    aid, cfg = found[0]
    rows = con.sql(
        "SELECT * FROM accuracy_weighting WHERE analysis_id = ? ORDER BY method, source, accuracy", params=[aid]
    ).pl()
    return WeightingAnalysis(str(aid), curves.json_object(cfg), rows)
