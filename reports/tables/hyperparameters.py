"""Table 1: the training hyperparameters per model-precision setting and the method parameters per method, read
from the composed configs stored with the runs; a short form keeps only the keys that differ between settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from predmask import config
from predmask.command_text import sweep_command
from predmask.methods import method_anchor
from reports import queries
from reports.artefact import ArtefactResult, ReportContext
from reports.labels import method_label
from reports.style import method_rank
from reports.tables.render import TextTable, table
from reports.tables.value_sources import value_source

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
    elif cfg is not None and not (isinstance(cfg, list) and any(isinstance(v, (Mapping, list)) for v in cfg)):
        text = "[" + ", ".join(_fmt(v) for v in cfg) + "]" if isinstance(cfg, list) else _fmt(cfg)
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


SOURCE_NOTE = (
    "The source column says where each value comes from: the paper, verl's DPPO recipe (the DPPO authors' "
    "examples/dppo_trainer script in verl, where the paper is silent) or our choice with its reason "
    "(reports/tables/value_sources.py)."
)

APPLIES_RULE = (
    "A key of a config group (model.*, precision.*, cluster.*, setting.*, task.*, base.*) applies to a setting only "
    "when the setting's option of that group sets it in its own file, conf/<group>/<option>.yaml; a key the runs "
    "carry only from a group default, a schema or the engine is left out here. Other keys apply wherever the runs "
    "carry them."
)


def hyperparameter_tables(runs: Sequence[queries.RunInfo]) -> tuple[TextTable, TextTable, TextTable]:
    """(every training hyperparameter per setting, only those that differ between settings where they apply,
    method parameters per method) from the runs' configs."""
    keys = [k for k in queries.panel_keys(runs) if k.model is not None]
    columns = [
        [(r, {key: v for key, v in flatten(r.config).items() if not key.startswith("method.")})
         for r in queries.runs_in_panel(runs, k)]
        for k in keys
    ]
    row_keys = sorted({key for column in columns for _, f in column for key in f})
    header = ["hyperparameter"] + [k.one_line for k in keys]
    n_cpu = sum(r.is_cpu for r in runs)
    source = (
        f"From the composed configs of {len(runs)} run(s) ({n_cpu} on the CPU engine: small stand-in models, "
        "emulated precision). Values that differ between runs of a setting are joined with ' / '."
    )
    train = TextTable(
        title="Table 1: training hyperparameters per model-precision setting",
        note=f"{source} {SOURCE_NOTE}",
        header=[*header, "source"],
        rows=_rows(row_keys, columns),
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
    flats = [
        (r, {**flatten(section := r.config.get("method", {})), "anchor": method_anchor(section)})
        for r in runs
        if r.method and isinstance(r.config, dict)
    ]
    m_keys = sorted({k for _, f in flats for k in f} - {"name", "label"})
    method_table = TextTable(
        title="Table 1 (continued): method parameters",
        note=(
            "method.* of the same configs; δ is the trust-region threshold of the divergence methods; anchor is "
            "what the ratio is anchored on: old = π_old (the training policy before the batch's first update, "
            "verl's recomputed old_log_prob), rollout = the rollout's μ of the sampled token."
        ),
        header=["parameter"] + [method_label(m) for m in methods] + ["source"],
        rows=_rows(m_keys, [[(r, f) for r, f in flats if r.method == m] for m in methods], "method."),
    )
    return train, differing, method_table


#: a column of a table: each of its runs with its flattened config (``flatten``)
Column = list[tuple[queries.RunInfo, dict[str, str]]]


def _rows(keys: Sequence[str], columns: Sequence[Column], prefix: str = "") -> list[list[str]]:
    """Per key: its values in each column, then their source (``value_source`` of prefix + key)."""
    return [
        [key] + [_merge_values([f.get(key) for _, f in column]) for column in columns]
        + [_merge_values([value_source(prefix + key, r.config) for c in columns for r, f in c if key in f])]
        for key in keys
    ]


def _differing_rows(row_keys: Sequence[str], columns: Sequence[Column]) -> list[list[str]]:
    """Rows of the keys whose applicable values differ between settings; "" where a key does not apply."""
    rows = []
    for key in row_keys:
        cells: list[str | None] = []
        for column in columns:
            values = [f.get(key) for r, f in column if key in f and applies(r.config, key)]
            cells.append(_merge_values(values) if values else None)
        shown = [c for c in cells if c is not None]
        if len(columns) > 1 and (len(set(shown)) > 1 or (shown and len(shown) < len(cells))):
            rows.append([key] + [c if c is not None else "" for c in cells])
    return rows


@table("Table 1: hyperparameters from the runs' configs")
def table1_hyperparameters(ctx: ReportContext) -> ArtefactResult:
    sel = queries.select_runs(ctx.runs, None, ctx.sweeps, None)
    # the variational family's stage runs are not RL runs: their parameters are in conf/variational.yaml
    runs = [r for r in sel.runs if r.config and r.config.get("family") != queries.VR_FAMILY]
    result = ArtefactResult(
        title="Table 1: hyperparameters",
        caption=(
            "Rendered from the composed configs stored with each run (runs.config); the files (Markdown and LaTeX) "
            "hold the full table."
        ),
        runs=runs,
        selection_rule=sel.rule,
        has_data=bool(runs),
        command=sweep_command(queries.MAIN_SWEEP),
    )
    train, differing, method_table = hyperparameter_tables(runs)
    result.tables = {"differing": differing, "training": train, "method": method_table}
    result.drawn = (train, method_table)
    return result
