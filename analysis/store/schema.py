"""The results store's tables: column names and types of `runs`, `run_sweeps`, `metrics`, the token-level study
(its rows and its study-level results), the drift grid, the variational family's traces and the accuracy-weighting
analysis, and their DDL."""

from __future__ import annotations

from collections.abc import Mapping

from analysis import token_columns
from analysis.token_columns import CRITERIA, DD_ALL, PREDICTIVE, TAIL_COLUMNS

RUN_COLUMNS: dict[str, str] = {
    "run_id": "VARCHAR PRIMARY KEY",
    "sweep": "VARCHAR",
    "method": "VARCHAR",
    "delta": "DOUBLE",
    "model": "VARCHAR",
    "precision": "VARCHAR",
    "seed": "INTEGER",
    "backend": "VARCHAR",  # "local" (CPU engine) | "slurm" (VeRL on a cluster)
    "status": "VARCHAR",
    "config": "JSON",
    "job_id": "VARCHAR",
    "log_path": "VARCHAR",
    "run_dir": "VARCHAR",
    "created_at": "TIMESTAMP",
    "updated_at": "TIMESTAMP",
}

# One row per (run, sweep whose folder holds it): run ids are content hashes of a run's config, so two sweeps can
# hold the same run, each in its own folder (runs/<sweep>/<run_id>), and the run belongs to both. Written by ingest
# with the run's `runs` row (whose ``sweep`` is the newest ingest's); (run_id, sweep) is unique.
RUN_SWEEP_COLUMNS: dict[str, str] = {
    "run_id": "VARCHAR NOT NULL",
    "sweep": "VARCHAR NOT NULL",
    "run_dir": "VARCHAR",  # the run's directory in that sweep's folder
}

# Per-seed summary of a token-level study (docs/math.md §5): each predictive criterion compared with the ratio
# criterion on their disagreement set (the names: ``analysis.token_columns``). For a side c of a comparison:
# n_keep_c = disagreement tokens c keeps, n_unsafe_c = those with dD_c > 0, n_corrective_c = those with dD_c < 0,
# unsafe_keep_c = n_unsafe_c / n_keep_c (NULL when n_keep_c = 0).
# Extra columns in the frames written by upsert_token_level are added to the table.
SEED_COLUMNS: dict[str, str] = {
    "study_id": "VARCHAR NOT NULL",
    "seed": "INTEGER NOT NULL",
    "n_tokens": "BIGINT",
    "n_outside": "BIGINT",
    **{token_columns.disagree_column(s): "BIGINT" for _ddot, s in PREDICTIVE.values()},
    **{token_columns.unsafe_keep_column(c): "DOUBLE" for c in CRITERIA},
    **{n: "BIGINT" for c in CRITERIA for n in token_columns.count_columns(c)},
    **{
        column: kind
        for side in (token_columns.ratio_side(s) for _ddot, s in PREDICTIVE.values() if s)
        for column, kind in (
            (token_columns.unsafe_keep_column(side), "DOUBLE"),
            *((n, "BIGINT") for n in token_columns.count_columns(side)),
        )
    },
    # context of the seed: batch statistics and where the time went
    "reward_mean": "DOUBLE",
    "d_pre_mean": "DOUBLE",
    "nonzero_adv_frac": "DOUBLE",
    "seconds_rollout": "DOUBLE",
    "seconds_stale": "DOUBLE",
    "seconds_masks": "DOUBLE",
    "seconds_ground_truth": "DOUBLE",
    "seconds": "DOUBLE",
    "cpu_seconds": "DOUBLE",
    "host": "VARCHAR",
}

# One row per studied token (D_pre > delta). position: the token's index in the seed's flattened batch,
# or, when `sequence` is given, its position inside that sequence's response. (study_id, seed,
# sequence, position) is unique; upsert_token_level checks it.
TOKEN_COLUMNS: dict[str, str] = {
    "study_id": "VARCHAR NOT NULL",
    "seed": "INTEGER NOT NULL",
    "sequence": "INTEGER",
    "position": "BIGINT NOT NULL",
    "d_pre": "DOUBLE",
    "r": "DOUBLE",
    "a": "DOUBLE",
    **dict.fromkeys(TAIL_COLUMNS, "DOUBLE"),
    **{keep: "BOOLEAN" for keep, _dd in CRITERIA.values()},
    **{dd: "DOUBLE" for _keep, dd in CRITERIA.values()},
    DD_ALL: "DOUBLE",  # optional: dD after the unmasked reference step (sign-accuracy / first-order checks)
    # per-token ground truths (docs/math.md §5.1; their meaning: analysis.token_columns); NULL in the rows of a study
    # computed before them; the Adam one is optional. Distinct (context, token id) pairs are counted by context_id
    **dict.fromkeys((*token_columns.NETWORK_TRUTHS, token_columns.COUNTERFACTUAL), "DOUBLE"),
    token_columns.CONTEXT_ID: "BIGINT",
}

# Study-level results of the criteria judged on a study's tokens (docs/math.md §5.1), one set of rows per study,
# spanning all its stored seeds: rewritten in the transaction that writes any of its seeds
# (``upsert_token_level``'s ``derive``). The store fixes each table's key (with study_id); the other columns are
# those of the frames written (``analysis.token_level.summary.criteria`` builds them), added on the first write.
# token_level_criteria: pooled rates per token set x ground truth x criterion; token_level_criteria_seeds: the
# per-seed rates behind them; token_level_sign_agreement: per network-aware truth x logit-space Ddot.
STUDY_RESULT_KEYS: dict[str, dict[str, str]] = {
    "token_level_criteria": {"token_set": "VARCHAR", "truth": "VARCHAR", "criterion": "VARCHAR"},
    "token_level_criteria_seeds": {
        "token_set": "VARCHAR",
        "truth": "VARCHAR",
        "criterion": "VARCHAR",
        "seed": "BIGINT",
    },
    "token_level_sign_agreement": {"truth": "VARCHAR", "ddot": "VARCHAR"},
}

# One row per cell of a drift grid (``python -m analysis drift``): the grid, the cell's parameters as the cell's
# composed study config has them, and the study that holds the cell's seeds (token_level_studies/_seeds/_tokens).
# ``params`` is the JSON of the grid axes' values of the cell; (grid_id, study_id) is unique.
GRID_COLUMNS: dict[str, str] = {
    "grid_id": "VARCHAR NOT NULL",
    "grid_name": "VARCHAR",
    "cell": "INTEGER NOT NULL",  # the cell's index in the grid's expansion order
    "study_id": "VARCHAR NOT NULL",
    "precision": "VARCHAR",
    "lr": "DOUBLE",
    "staleness": "INTEGER",
    "minibatches": "INTEGER",
    "sequences": "INTEGER",
    "params": "JSON",
    "created_at": "TIMESTAMP",
}

# One row per trace of a variational-reasoning `weights` stage run (docs/math.md §8): the run's weights.parquet
# (predmask.rl.vr_runner) with the run's id and seed; filled by ingest of the run directory. (run_id, question,
# trace) is unique.
_VR_TRACE_FIELDS: dict[str, str] = {
    "run_id": "VARCHAR NOT NULL",
    "seed": "INTEGER",
    "question": "INTEGER NOT NULL",  # index into the stage's N questions
    "trace": "INTEGER NOT NULL",  # k of the question's K traces
    "trace_tokens": "INTEGER",  # |z|
    "answer_tokens": "INTEGER",  # |y'| incl. <eos>
    "log_prior": "DOUBLE",  # Σ log π_θ0(z|x)
    "log_posterior": "DOUBLE",  # Σ log q_φ(z|x,y')
    "log_ratio": "DOUBLE",  # (log_prior − log_posterior) / |z|, 0 when |z| = 0
    "answer_logp": "DOUBLE",  # Σ log π_θ0(y'|x,z)
    "acc": "DOUBLE",  # mean correctness of the M answers sampled from π_θ0(·|x,z)
    "posterior_correct": "BOOLEAN",
}


def vr_weight_columns() -> tuple[str, ...]:
    """`vr_traces`' weight columns: weight_<estimator> of every registered estimator (``predmask.vr_weights``,
    imported here: it loads torch, which only a writer and ingest need), normalised over the K traces of a question."""
    from predmask.vr_weights import ESTIMATORS, weight_column

    return tuple(weight_column(name) for name in ESTIMATORS)


def vr_trace_columns() -> dict[str, str]:
    """The columns of `vr_traces` and their types."""
    return {**_VR_TRACE_FIELDS, **dict.fromkeys(vr_weight_columns(), "DOUBLE")}

# One row per (source, method, question) of an accuracy-weighting analysis (``python -m analysis
# accuracy_weighting``, docs/math.md §9): the weight the method's gradient puts on ∇ log p of the question, measured
# (projection on the estimate of ∇ log p; NULL when the batch has no correct sample) and predicted by the closed form.
# source: 'model' (real batches of a real model) or 'bandit' (a one-question softmax bandit, exact expectation);
# for 'bandit' rows ``question`` is the case index, ``accuracy`` its exact p and n_samples = group_size = G.
ACCURACY_WEIGHTING_COLUMNS: dict[str, str] = {
    "analysis_id": "VARCHAR NOT NULL",
    "source": "VARCHAR NOT NULL",
    "method": "VARCHAR NOT NULL",
    "question": "INTEGER NOT NULL",
    "accuracy": "DOUBLE",
    "measured_weight": "DOUBLE",
    "predicted_weight": "DOUBLE",
    "n_samples": "INTEGER",
    "group_size": "INTEGER",
    "model": "VARCHAR",
}


def _create(table: str, columns: Mapping[str, str], key: tuple[str, ...] = ()) -> str:
    """The CREATE TABLE IF NOT EXISTS statement of ``table`` (``key``: its PRIMARY KEY columns)."""
    lines = [f"{name} {kind}" for name, kind in columns.items()]
    if key:
        lines.append(f"PRIMARY KEY ({', '.join(key)})")
    body = ",\n  ".join(lines)
    return f"CREATE TABLE IF NOT EXISTS {table} (\n  {body}\n)"


#: the largest step `metrics.step` (INTEGER) holds; a line with a larger step is refused by ingest, one line naming
#: the file and line (a step that large is no training step; storing it would need a BIGINT column in every database)
STEP_MAX = 2**31 - 1
#: the parent row of a token-level study or an accuracy-weighting analysis, after its key column
_CONFIG_ROW = {"config": "JSON", "created_at": "TIMESTAMP"}


def schema_ddl() -> tuple[str, ...]:
    """Every CREATE TABLE IF NOT EXISTS of the store, then the ALTER TABLE ... ADD COLUMN IF NOT EXISTS that gives an
    older `vr_traces` the weight column of an estimator registered since (no-ops once the columns exist)."""
    return (
        _create("runs", RUN_COLUMNS),
        _create("run_sweeps", RUN_SWEEP_COLUMNS, ("run_id", "sweep")),
        # one row per (run_id, step, name), kept by ingest, the table's only writer (``ingest._write_metrics``
        # writes a run's rows from its de-duplicated files); no PRIMARY KEY: its index lives in memory whole on
        # every write (about 100 bytes a row, never spilled), which a long run's millions of rows would not fit. A
        # database created with one keeps it: the same statements write both. step: INTEGER, see STEP_MAX
        _create("metrics", {"run_id": "VARCHAR NOT NULL", "step": "INTEGER NOT NULL", "name": "VARCHAR NOT NULL",
                            "value": "DOUBLE"}),
        _create("token_level_studies", {"study_id": "VARCHAR PRIMARY KEY", **_CONFIG_ROW}),
        _create("token_level_seeds", SEED_COLUMNS, ("study_id", "seed")),
        _create("token_level_tokens", TOKEN_COLUMNS),
        *(
            _create(table, {"study_id": "VARCHAR NOT NULL", **{k: f"{t} NOT NULL" for k, t in keys.items()}},
                    ("study_id", *keys))
            for table, keys in STUDY_RESULT_KEYS.items()
        ),
        _create("token_level_grid", GRID_COLUMNS, ("grid_id", "study_id")),
        _create("vr_traces", vr_trace_columns(), ("run_id", "question", "trace")),
        _create("accuracy_weighting_analyses", {"analysis_id": "VARCHAR PRIMARY KEY", **_CONFIG_ROW}),
        _create("accuracy_weighting", ACCURACY_WEIGHTING_COLUMNS,
                ("analysis_id", "source", "method", "question")),
        *(f"ALTER TABLE vr_traces ADD COLUMN IF NOT EXISTS {column} DOUBLE" for column in vr_weight_columns()),
    )
