"""Expand a variational-reasoning sweep (a sweep file with ``family: variational``) into its chain of stage
runs.

Per seed: a ``posterior`` (q_phi), its ``traces``, their ``weights`` and the finals (``sft``, ``rft``, the
vr_* recipes at both ``method.data`` settings, and ``grpo``); one ``prior`` (pi_theta0, at seed 0) serves
every seed and runs whenever a final does (its evaluation is the baseline); a stage run is planned only when
some final reads it. Each stage run keeps only the sections that determine it (``STAGE_SECTIONS``), with
``inputs`` = the run ids it reads, and its id is the stable id of that config: a changed final setting keeps
every upstream run, a changed posterior setting changes everything downstream. The grpo final is an ordinary
train run on the same first ``data.questions`` problems. Axes and which overrides reach which runs:
``python -m sweeps --help``.

On a cluster (``cluster.trainer: verl``) the chain is the cluster's stage graph (``predmask.vr_stages``): the
rft final reads an ``rft_samples`` run, and every evaluated model gets an ``eval`` run after it (its
``method`` is the evaluated run's, so tables group it with that recipe)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from omegaconf import DictConfig, OmegaConf

from predmask.config import bare_key, conf_dir, group_options, stable_id
from predmask.schemas.variational_schema import DATA_MODES, VRMethodConfig
from predmask.vr_stages import CLUSTER_STAGES, STAGES, stage_inputs, with_upstream
from sweeps.compose import (
    RunSpec,
    SweepError,
    cell_runs,
    check_group_values,
    check_values,
    cluster_seeds,
    compose_run,
    config_at_seed,
    override_key,
    override_values,
    parse_axes,
    plural,
    unique_runs,
)

FAMILY = "variational"
PRIMARY = "variational"
#: the config group of the final recipes (conf/vr_method), packaged at ``method``
METHOD_GROUP = "vr_method"
#: the final recipe that is an ordinary engine run (conf/method/grpo.yaml), not a VR stage
GRPO = "grpo"
#: ``method.data`` of the vr_* recipes (the schema's own list)
DATA_SETTINGS: tuple[str, ...] = DATA_MODES
#: the top-level keys every stage run keeps (cluster and cache_dir are launcher keys: in the config, not in the id)
COMMON_SECTIONS: tuple[str, ...] = ("family", "stage", "seed", "method", "model", "task", "base", "inputs",
                                    "cache_dir", "cluster")
#: the further sections that determine each stage (upstream settings enter through the upstream run ids)
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "prior": ("eval",),
    "posterior": ("data", "hint", "sft", "posterior"),
    "traces": ("data", "hint", "traces"),
    "weights": ("data", "hint", "weights"),
    "final": ("data", "sft", "final", "eval"),
    "rft_samples": ("rft",),
    "eval": ("eval",),
}
#: the further sections of a final recipe's config beyond STAGE_SECTIONS["final"]
RECIPE_SECTIONS: dict[str, tuple[str, ...]] = {"rft": ("rft",)}
#: the ``method`` keys of a variational stage run (the schema's fields)
VR_METHOD_KEYS: tuple[str, ...] = tuple(f.name for f in fields(VRMethodConfig))
#: what each stage run is, for its ``method.label``
STAGE_LABELS: dict[str, str] = {
    "prior": "pi_theta0 (the cached base model, stand-in)",
    "posterior": "q_phi (base model fine-tuned on hint prompts)",
    "traces": "K traces per question from q_phi",
    "weights": "trace weights (all three estimators)",
    "rft_samples": "rft.samples responses per question from pi_theta0",
}
#: root keys of command-line overrides that go to the grpo run only (conf/train.yaml), or to every run
TRAIN_ONLY_ROOTS: tuple[str, ...] = ("trainer", "rollout", "precision", "delta", "top_k")
SHARED_ROOTS: tuple[str, ...] = ("model", "task", "base", "cluster")
#: groups checked up front with a one-line error (the method axis has its own check)
GROUPS_CHECKED: tuple[str, ...] = ("model", "task", "base", "cluster", "precision")


def method_names() -> list[str]:
    """The final recipes of the method axis: conf/vr_method's options and grpo."""
    return [*group_options(METHOD_GROUP), GRPO]


def _root(override: str) -> str:
    return bare_key(override).split(".", 1)[0].split("@", 1)[0]


def stage_config(full: dict[str, Any], stage: str, inputs: dict[str, str]) -> dict[str, Any]:
    """The config of one stage run: the sections of the resolved ``full`` config that determine ``stage``,
    with ``stage`` and ``inputs`` set; its ``method`` names the stage (an eval run's: the evaluated run's)."""
    recipe = str(full["method"]["name"])
    keys = (*COMMON_SECTIONS, *STAGE_SECTIONS[stage], *(RECIPE_SECTIONS.get(recipe, ()) if stage == "final" else ()))
    out = {k: full[k] for k in keys if k in full}
    # the method keys a variational run has (a verl cluster's recipe also sets engine-loss keys, e.g.
    # method.loss_agg_mode, which no variational stage reads)
    out["method"] = {k: v for k, v in full["method"].items() if k in VR_METHOD_KEYS}
    out["stage"], out["inputs"] = stage, dict(inputs)
    of_prior = stage == "prior" or (stage == "eval" and "prior" in inputs)
    if stage not in ("final", "eval") or of_prior:
        out["method"] = {"name": "prior" if of_prior else stage, "label": STAGE_LABELS["prior" if of_prior else stage]}
    if of_prior:
        out["seed"] = 0  # seed-independent: one pi_theta0 per sweep
    return out


def grpo_schedule(full: dict[str, Any]) -> tuple[int, int]:
    """(trainer.steps, trainer.train_batch_size) of the grpo final: data.questions problems in batches of
    sft.questions_per_step, final.epochs times."""
    questions, per_step = int(full["data"]["questions"]), int(full["sft"]["questions_per_step"])
    epochs = int(full["final"]["epochs"])
    if per_step < 1 or questions % per_step:
        raise SweepError(f"grpo needs data.questions ({questions}) to be a multiple of sft.questions_per_step "
                         f"({per_step}); choose data.questions or drop grpo from method=")
    return questions // per_step * epochs, per_step


def default_choice(group: str) -> str:
    """The option of ``group`` that conf/variational.yaml's defaults list selects (e.g. ``model: cpu_s``)."""
    for item in OmegaConf.load(conf_dir() / f"{PRIMARY}.yaml").get("defaults", []):
        if isinstance(item, DictConfig) and group in item:
            return str(item[group])
    raise SweepError(f"conf/{PRIMARY}.yaml selects no {group}; give {group}=NAME")


def _spec(sweep: str, overrides: Sequence[str], config: dict[str, Any]) -> RunSpec:
    """A stage run's spec. Its base-model cache is made absolute here: the job runs inside its run directory and
    reads config.yaml as written, so a relative ``results/cache`` would build a base model per run (the path is a
    launcher key: not part of the run id)."""
    if "cache_dir" in config:
        config = {**config, "cache_dir": str(Path(str(config["cache_dir"])).resolve())}
    return RunSpec(stable_id(config), sweep, tuple(overrides), config)


def on_cluster(cfg: Any) -> bool:
    """Whether a composed config's runs are verl jobs (the cluster's stage graph)."""
    return cfg.cluster.get("trainer", "cpu") == "verl"


def _chain(sweep: str, composed: dict[str, tuple[DictConfig, list[str]]], train_ovs: list[str],
           seed: int) -> list[RunSpec]:
    """Every run of one cell at one seed: the stage runs, one final per recipe in ``composed`` (recipe key ->
    its composed config and overrides) and, on a cluster, the eval runs."""
    first_cfg, first_ovs = next(iter(composed.values()))
    cluster = on_cluster(first_cfg)
    full = config_at_seed(first_cfg, seed)
    ovs = [*first_ovs, f"seed={seed}"]
    stages: dict[str, RunSpec] = {}
    for stage in (s for s in (CLUSTER_STAGES if cluster else STAGES) if s not in ("final", "eval")):
        inputs = {need: stages[need].run_id for need in stage_inputs(stage, cluster=cluster)}  # earlier stages only
        stages[stage] = _spec(sweep, [*ovs, f"stage={stage}"], stage_config(full, stage, inputs))
    finals: list[RunSpec] = []
    evals: list[RunSpec] = []
    needed: set[str] = set()
    for key, (item_cfg, item_ovs) in composed.items():
        method = key.split(":", 1)[0]
        if method == GRPO:
            steps, batch = grpo_schedule(full)
            chosen = any(bare_key(o) == "model" for o in train_ovs)
            model = [] if chosen else [f"model={default_choice('model')}"]  # the same model as the stages
            batch_ovs = [f"method={GRPO}", *model, *train_ovs,
                         f"trainer.steps={steps}", f"trainer.train_batch_size={batch}"]
            finals += [spec for _, spec in cell_runs(sweep, batch_ovs, [seed], sweep_file=False)]
            continue
        cfg = config_at_seed(item_cfg, seed)
        wanted = stage_inputs("final", method, cluster=cluster)
        needed.update(wanted)
        final = _spec(sweep, [*item_ovs, f"seed={seed}", "stage=final"],
                      stage_config(cfg, "final", {k: stages[k].run_id for k in wanted}))
        finals.append(final)
        if cluster:  # the SFT job cannot sample: its model's evaluation is a run of its own
            evals.append(_spec(sweep, [*item_ovs, f"seed={seed}", "stage=eval"],
                               stage_config(cfg, "eval", {"final": final.run_id})))
    if any(spec.stage == "final" for spec in finals):
        needed.add("prior")  # pi_theta0's own evaluation: the baseline every final is compared with
        if cluster:
            evals.insert(0, _spec(sweep, [*first_ovs, "seed=0", "stage=eval"],
                                  stage_config(full, "eval", {"prior": stages["prior"].run_id})))
    needed = with_upstream(needed, cluster=cluster)  # the stage runs some final reads, and what they read in turn
    return [*(spec for stage, spec in stages.items() if stage in needed), *finals, *evals]


def cluster_skipped(overrides: Sequence[str]) -> list[str]:
    """The recipes of the method axis that the cell's trainer cannot run (VeRL: those outside
    ``CLUSTER_RECIPES``); a sweep's own method axis leaves them out, a ``method=`` naming one is refused by
    the trainer's check."""
    cfg, _ = compose_run(PRIMARY, list(overrides))
    if not on_cluster(cfg):
        return []
    from predmask.verl.vr_cluster import CLUSTER_RECIPES  # verl-free: commands only

    return [m for m in group_options(METHOD_GROUP) if m not in CLUSTER_RECIPES]


def _axis_values(parsed: list[Any], key: str) -> list[str] | None:
    """The values the last ``key=`` override names, None when there is none."""
    given = [ov for ov in parsed if override_key(ov) == key]
    return override_values(given[-1]) if given else None


def expand_variational(sweep: str, overrides: Sequence[str] | None = None) -> list[RunSpec]:
    """Expand the variational sweep ``sweep`` with command-line ``overrides`` into its runs, in wave order."""
    parsed_user, parsed, seeds = parse_axes(sweep, overrides)
    user_methods = _axis_values(parsed_user, "method")
    methods = _axis_values(parsed, "method") or method_names()
    check_values("method", methods, method_names())
    data = _axis_values(parsed, "method.data") or list(DATA_SETTINGS)
    check_values("method.data", data, DATA_SETTINGS)
    rest = [ov for ov in parsed if override_key(ov) not in ("method", "method.data")]
    check_group_values(rest, GROUPS_CHECKED)
    (batches,) = BasicSweeper.split_arguments(rest, None) if rest else ([[]],)
    recipes = [(m, d) for m in methods for d in (data if m.startswith("vr_") else [None])]
    runs: list[RunSpec] = []
    for batch in batches:
        train_ovs = [o for o in batch if _root(o) in (*TRAIN_ONLY_ROOTS, *SHARED_ROOTS)]
        vr_ovs = [o for o in batch if _root(o) not in TRAIN_ONLY_ROOTS]
        composed: dict[str, tuple[DictConfig, list[str]]] = {}  # a cluster model on the CPU -> its stand-in
        skipped = [] if user_methods else cluster_skipped(vr_ovs)
        cell_recipes = [r for r in recipes if r[0] not in skipped]
        for method, setting in cell_recipes:
            recipe = "sft" if method == GRPO else method  # grpo reads the family's data/sft/final settings
            extra = [f"method.data={setting}"] if setting else []
            recipe_ovs = [*vr_ovs, f"{METHOD_GROUP}@method={recipe}", *extra]
            composed[f"{method}:{setting}"] = compose_run(PRIMARY, recipe_ovs)
        cell_seeds = seeds if seeds is not None else cluster_seeds(next(iter(composed.values()))[0])
        for seed in cell_seeds:
            runs += _chain(sweep, composed, train_ovs, seed)
    specs = unique_runs(runs)  # the prior is one run for every seed (and every cell that shares it)
    order = depth(specs)
    return sorted(specs, key=lambda spec: order[spec.run_id])  # stable: seed by seed within a wave


def depth(specs: Sequence[RunSpec]) -> dict[str, int]:
    """Run id -> its wave: 0 for a run that reads no other run, else one more than the deepest run it reads.
    An input that is not among ``specs`` is an error (one line naming the run and the missing id)."""
    by_id = {spec.run_id: spec for spec in specs}
    out: dict[str, int] = {}

    def visit(spec: RunSpec) -> int:
        if spec.run_id not in out:
            missing = [rid for rid in spec.inputs.values() if rid not in by_id]
            if missing:
                raise SweepError(f"run {spec.run_id} ({spec.cell}) reads run {missing[0]}, which is not in the sweep")
            out[spec.run_id] = 1 + max((visit(by_id[rid]) for rid in spec.inputs.values()), default=-1)
        return out[spec.run_id]

    for spec in specs:
        visit(spec)
    return out


def waves(specs: Sequence[RunSpec]) -> list[list[RunSpec]]:
    """The runs in waves: every run of a wave reads only runs of earlier waves (order kept within a wave)."""
    order = depth(specs)
    out: list[list[RunSpec]] = [[] for _ in range(max(order.values(), default=-1) + 1)]
    for spec in specs:
        out[order[spec.run_id]].append(spec)
    return out



def describe_chain(specs: Sequence[RunSpec]) -> str:
    """How many runs of each kind, e.g. ``37 runs (1 prior + 3 seeds x (posterior, traces, weights + 9 finals))``."""
    if not specs:
        return "0 runs"
    finals = [spec for spec in specs if spec.stage in (None, "final")]
    stages = [spec for spec in specs if spec not in finals]
    seeds = sorted({spec.seed for spec in finals} | {spec.seed for spec in stages if spec.stage != "prior"})
    parts = [f"{sum(1 for s in stages if s.stage == stage)} {stage}" for stage in CLUSTER_STAGES
             if stage != "final" and any(s.stage == stage for s in stages)]
    per_seed = len(finals) / len(seeds) if seeds else 0
    shown = f"{per_seed:g}" if per_seed == int(per_seed) else f"{len(finals)} in all"
    return (f"{plural(len(specs), 'run')} ({', '.join(parts) or 'no stage runs'}; "
            f"{plural(len(seeds), 'seed')} x {shown} final{'s' if shown != '1' else ''})")
