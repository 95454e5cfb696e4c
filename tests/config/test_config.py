"""predmask.config: every primary config and sweep composes, the schemas reject bad keys and types, labels and
stand-ins come from conf/, and the stable id is a fixed function of the resolved config minus launcher keys."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pytest
import yaml
from omegaconf import MISSING

from predmask.config import (
    LAUNCHER_KEYS,
    ConfigError,
    closest_keys,
    compose,
    conf_dir,
    config_keys,
    cpu_standin,
    group_entry,
    group_options,
    label,
    option_choices,
    stable_id,
    to_container,
    typed_view,
)
from predmask.schemas import cluster_schema
from predmask.schemas.cluster_schema import (
    ClusterConfig,
    ClusterModelConfig,
    SlurmClusterConfig,
    VerlClusterConfig,
)
from sweeps.compose import TRAIN_FAMILY, sweep_family


def _primary(name: str) -> dict[str, Any]:
    """A primary YAML as written (read with PyYAML, not with the code under test)."""
    return yaml.safe_load((conf_dir() / f"{name}.yaml").read_text())


def _primary_keys(name: str) -> list[str]:
    """Top-level keys of the composed primary: its own keys and the groups of its defaults list."""
    doc = _primary(name)
    groups = [k for d in doc["defaults"] if isinstance(d, dict) for k in d if "/" not in k]
    return groups + [k for k in doc if k != "defaults"]


def _schema(name: str, **types: type) -> type:
    """A dataclass with one field per top-level key of the primary ``name`` (type Any unless given), no defaults."""
    return dataclasses.make_dataclass(f"{name}_schema", [(k, types.get(k, Any), dataclasses.field(default=MISSING))
                                                          for k in _primary_keys(name)])


def test_primaries_sit_at_the_top_of_conf_and_the_study_copy_is_gone() -> None:
    assert sorted(p.stem for p in conf_dir().glob("*.yaml")) == ["accuracy_weighting", "drift", "token_level", "train", "variational"]
    assert not (conf_dir() / "analysis").exists()


@pytest.mark.parametrize("group", ["method", "model", "precision", "cluster", "setting", "task", "base"])
def test_every_option_of_every_group_composes_into_train(group: str) -> None:
    key = "+setting" if group == "setting" else group
    for option in group_options(group):
        cfg = to_container(compose("train", [f"{key}={option}"]))
        assert "hydra" not in cfg
        if group != "setting":
            assert cfg[group]["name" if group in ("method", "model", "precision", "cluster") else "seed"] is not None


@pytest.mark.parametrize("sweep", [s for s in group_options("sweep") if sweep_family(s) == TRAIN_FAMILY])
def test_every_sweep_composes_and_names_its_delta(sweep: str) -> None:
    cfg = compose("train", [f"+sweep={sweep}"], return_hydra_config=True)
    assert cfg.sweep_name == sweep
    assert float(group_entry("sweep", sweep)["delta"]) == cfg.delta > 0
    for setting in str(cfg.hydra.sweeper.params["+setting"]).split(","):
        assert setting in group_options("setting")


def test_training_and_the_study_compose_the_same_task_and_base() -> None:
    train = to_container(compose("train"))
    study = to_container(compose("token_level", schemas={"token_level_schema": _schema("token_level")}))
    assert study["task"] == train["task"] and study["base"] == train["base"]
    assert study["task"]["max_number"] == 255 and train["base"]["steps"] == 1000
    for name in ("train", "token_level"):  # the values live once, in conf/task and conf/base
        assert {"task": "arithmetic"} in _primary(name)["defaults"] and "task" not in _primary(name)


def test_the_study_composes_with_its_own_schema() -> None:
    from analysis.token_level.compute.study_config import SCHEMA, StudyConfig

    cfg = to_container(compose("token_level", ["delta=0.1", "model=cpu_m"], schemas={SCHEMA: StudyConfig}))
    assert sorted(cfg) == sorted(_primary_keys("token_level"))
    assert cfg["delta"] == 0.1 and cfg["model"]["name"] == "cpu_m" and cfg["task"]["seed"] == 1234
    with pytest.raises(ConfigError, match="bad value for sequences: 'many' is not an integer"):
        compose("token_level", ["sequences=many"], schemas={SCHEMA: StudyConfig})


def test_a_study_schema_is_applied_to_the_study_config() -> None:
    narrow = dataclasses.make_dataclass("narrow", [(k, Any, dataclasses.field(default=MISSING))
                                                   for k in _primary_keys("token_level") if k != "sequences"])
    with pytest.raises(ConfigError, match="Key 'sequences' not in 'narrow'") as err:
        compose("token_level", schemas={"token_level_schema": narrow})
    assert "\n" not in str(err.value)
    typed = _schema("token_level", sequences=int)
    cfg = compose("token_level", ["sequences=64"], schemas={"token_level_schema": typed})
    assert cfg.sequences == 64
    with pytest.raises(ConfigError, match="bad value for sequences: 'many' is not an integer"):
        compose("token_level", ["sequences=many"], schemas={"token_level_schema": typed})


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.bogus=1"], "unknown config key 'trainer.bogus'"),
    (["+trainer.bogus=1"], "unknown trainer keys ['bogus']"),
    (["+task.bogus=1"], "unknown task keys ['bogus']"),
    (["+base.bogus=1"], "unknown base keys ['bogus']"),
    (["trainer.steps=many"], "bad value for trainer.steps: 'many' is not an integer"),
    (["rollout.temperature=hot"], "bad value for rollout.temperature: 'hot' is not a float"),
    (["base.lr=fast"], "bad value for base.lr: 'fast' is not a float"),
    (["task.train_ops=oops"], "task.train_ops=oops"),
    (["method=nope"], "Could not find 'method/nope'"),
    (["cluster=h20_4x8", "cluster.nodes=many"], "bad value for cluster.nodes: 'many' is not an integer"),
    (["cluster=h20_4x8", "+cluster.variational.bogus=1"], "unknown cluster.variational keys ['bogus']"),
    (["model=qwen3_4b_base", "model.batch.lr=fast"], "bad value for model.batch.lr: 'fast' is not a float"),
    (["model=qwen3_4b_base", "+model.parallel.bogus=1"], "unknown model.parallel keys ['bogus']"),
])
def test_the_schemas_reject_unknown_keys_and_wrong_types_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose("train", overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("override", "suggested"), [
    ("lr=1e-3", "trainer.lr"),                       # a leaf named without its section
    ("trainer.stepz=3", "trainer.steps"),            # a typo in the leaf
    ("rollout.temprature=2", "rollout.temperature"),
])
def test_an_unknown_key_names_the_closest_known_keys(override: str, suggested: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose("train", [override])
    text = str(err.value)
    assert "did you mean" in text and suggested in text.split("did you mean")[1] and "\n" not in text
    key = override.split("=")[0]
    assert config_keys(compose("train")).count(suggested) == 1 and key not in config_keys(compose("train"))


def test_cluster_settings_live_only_in_conf_and_run_configs_are_checked_against_them() -> None:
    """Every field of the cluster schemas is MISSING in Python; the composed conf files give them all, and a run
    config's section missing, adding or mistyping a field fails in one line naming it."""
    for schema in [v for v in vars(cluster_schema).values() if dataclasses.is_dataclass(v)]:
        assert all(f.default is MISSING for f in dataclasses.fields(schema)), schema
    for name, schema in (("local", ClusterConfig), ("slurm_emulated", SlurmClusterConfig), ("h20_4x8", VerlClusterConfig)):
        assert isinstance(typed_view(schema, compose("train", [f"cluster={name}"]).cluster, "cluster", "x"), schema)
    for name in [m for m in group_options("model") if m.startswith("qwen3_")]:
        model = to_container(compose("train", [f"model={name}"]))["model"]
        assert typed_view(ClusterModelConfig, model, "model", "x").batch.val_temperature == model["batch"]["temperature"]
    cluster = to_container(compose("train", ["cluster=h20_4x8"]))["cluster"]
    for change, message in [
        (lambda c: c["variational"]["prior"].pop("lr"), "run config is missing cluster.variational.prior.lr (needed for x)"),
        (lambda c: c["variational"]["vllm"].update(tp=2), "unknown cluster.variational.vllm key 'tp'; allowed: tensor_parallel"),
        (lambda c: c.update(nodes="four"), "bad value for cluster.nodes: Value 'four' of type 'str' could not be converted"),
        (lambda c: c["variational"]["traces"].update(k=0), "cluster.variational.traces.k must be a positive int, got 0"),
    ]:
        bad = json.loads(json.dumps(cluster))
        change(bad)
        with pytest.raises(ValueError) as err:
            typed_view(VerlClusterConfig, bad, "cluster", "x")
        assert message in str(err.value) and "\n" not in str(err.value)


def test_closest_keys_prefers_the_whole_path_then_the_last_part() -> None:
    known = ["trainer.lr", "base.lr", "trainer.steps", "rollout.n"]
    assert closest_keys("trainer.lrr", known)[0] == "trainer.lr"
    assert set(closest_keys("lr", known)) == {"trainer.lr", "base.lr"}
    assert closest_keys("zzzz", known) == []


def test_schema_values_keep_their_types() -> None:
    cfg = to_container(compose("train", ["trainer.lr=1e-3", "rollout.n=4", "task.seed=7"]))
    assert cfg["trainer"]["lr"] == 1e-3 and isinstance(cfg["rollout"]["n"], int) and cfg["task"]["seed"] == 7
    assert cfg["trainer"]["betas"] == [0.9, 0.999]


@pytest.mark.parametrize("group", ["method", "model", "setting", "precision"])
def test_every_option_reports_show_has_a_label(group: str) -> None:
    assert group_options(group)
    for option in group_options(group):
        text = label(group, option)
        assert isinstance(text, str) and text.strip(), (group, option)


def test_stand_ins_and_paper_models_name_each_other() -> None:
    """The facts reports read instead of their own tables: which CPU model stands in for which paper model."""
    models = {m: group_entry("model", m) for m in group_options("model")}
    cpu = {m for m, e in models.items() if e["backend"] == "cpu"}
    paper = {m for m, e in models.items() if e["backend"] == "hf"}
    assert cpu and paper
    for m in paper:
        standin = models[m]["cpu_standin"]
        assert standin in cpu and models[standin]["stands_in_for"] == m
    assert {models[m]["stands_in_for"] for m in cpu} == paper


def test_each_setting_selects_a_paper_model_and_a_precision() -> None:
    main_axis = group_entry("sweep", "main_comparison")["hydra"]["sweeper"]["params"]["+setting"].split(",")
    assert sorted(main_axis) == group_options("setting")
    for setting in group_options("setting"):
        choices = option_choices("setting", setting)
        assert group_entry("model", choices["model"])["backend"] == "hf"
        assert choices["precision"] in group_options("precision")
        cfg = to_container(compose("train", [f"+setting={setting}", "cluster=h20_4x8"]))
        assert (cfg["model"]["name"], cfg["precision"]["name"]) == (choices["model"], choices["precision"])
        assert cfg["setting"]["name"] == setting


def test_unknown_options_and_missing_labels_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'nope'; valid: cpu_m, ") as err:
        group_entry("model", "nope")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="cluster 'local' has no label"):
        label("cluster", "local")


def test_stable_id_is_the_sha256_of_the_sorted_compact_json_minus_launcher_keys() -> None:
    config = {"seed": 1, "method": {"name": "m", "delta": 0.15}, "run_dir": "/x", "cluster": {"name": "c"},
              "cache_dir": "/c", "hydra": {"job": 1}}
    expected = hashlib.sha256(b'{"method":{"delta":0.15,"name":"m"},"seed":1}').hexdigest()[:12]
    assert stable_id(config) == expected == "71887bc217b1"  # the run ids and study ids already in databases
    assert stable_id(dict(reversed(list(config.items())))) == expected
    assert stable_id({**config, "run_dir": "/elsewhere", "cluster": {"name": "other"}}) == expected
    assert stable_id({**config, "seed": 2}) != expected
    assert stable_id({**config, "method": {"name": "m", "delta": 0.05}}) != expected
    assert stable_id(config, exclude=("launcher", "paths")) != expected
    assert set(LAUNCHER_KEYS) == {"cluster", "run_dir", "cache_dir", "hydra", "trainer.logger"}


def test_a_dotted_launcher_key_leaves_its_section_otherwise_in_the_id() -> None:
    """The trackers a run logs to (trainer.logger) are not part of it; the rest of trainer is."""
    config = {"seed": 1, "trainer": {"lr": 1e-4, "logger": ["console", "file"]}}
    plain = hashlib.sha256(b'{"seed":1,"trainer":{"lr":0.0001}}').hexdigest()[:12]
    assert stable_id(config) == plain
    assert stable_id({**config, "trainer": {"lr": 1e-4, "logger": ["file", "tensorboard"]}}) == plain
    assert stable_id({**config, "trainer": {"lr": 2e-4, "logger": ["file"]}}) != plain
    assert stable_id({"seed": 1, "trainer": "not a section"}) != plain  # nothing to strip: left as it is


def test_labels_at_any_depth_are_not_part_of_the_id() -> None:
    config = {"seed": 1, "method": {"name": "m", "delta": 0.15}}
    expected = stable_id(config)
    labelled = {"seed": 1, "label": "study", "method": {"name": "m", "delta": 0.15, "label": "M"},
                "stack": [{"label": "x"}]}
    assert stable_id(labelled) == stable_id({**config, "stack": [{}]})
    assert stable_id({**labelled, "method": {"name": "m", "delta": 0.15, "label": "renamed"}}) == stable_id(labelled)
    assert stable_id({**labelled, "method": {"name": "m", "delta": 0.05, "label": "M"}}) != stable_id(labelled)
    assert stable_id({**config, "method": {"name": "m", "delta": 0.15, "label": "M"}}) == expected
    assert stable_id({**config, "labels": ["a"]}) != expected  # only the key named `label` is display text


def test_editing_a_label_in_conf_keeps_the_run_id() -> None:
    a = to_container(compose("train"))
    b = to_container(compose("train", ["method.label=Another name", "model.label=x", "task.label=y"]))
    assert a != b and stable_id(a) == stable_id(b)


def test_stable_id_of_a_composed_config_ignores_where_it_runs() -> None:
    a = to_container(compose("train"))
    b = to_container(compose("train", ["run_dir=/tmp/elsewhere", "cluster=slurm_emulated"]))
    assert stable_id(a) == stable_id(b)
    # a verl cluster is more than a place: it trains with verl's DPPO recipe's method values (conf/cluster/recipe)
    verl = to_container(compose("train", ["cluster=h20_4x8"]))
    assert stable_id(a) != stable_id(verl)
    assert stable_id({**a, "method": verl["method"]}) == stable_id(verl)
    assert stable_id(a) != stable_id(to_container(compose("train", ["seed=1"])))
    assert json.loads(json.dumps(a)) == a  # plain data: what the id hashes is what a run records


def test_cpu_standin_maps_paper_models_to_cpu_models() -> None:
    for name in group_options("model"):
        entry = to_container(compose("train", [f"model={name}"]))["model"]
        resolved = cpu_standin(entry)
        if entry["backend"] == "cpu":
            assert resolved == entry
        else:
            assert resolved["name"] == entry["cpu_standin"] and resolved["backend"] == "cpu"
            assert resolved["resolved_from"] == name and resolved["stands_in_for"] == name
    with pytest.raises(ConfigError, match="names no cpu_standin; use model=cpu_m, cpu_moe, cpu_s or cpu_s32"):
        cpu_standin({"name": "big", "backend": "hf"})
    with pytest.raises(ConfigError, match="cpu_standin 'cpu_xl' of model 'big' has no conf/model/cpu_xl.yaml"):
        cpu_standin({"name": "big", "backend": "hf", "cpu_standin": "cpu_xl"})


@pytest.mark.parametrize("sweep", [s for s in group_options("sweep") if sweep_family(s) != TRAIN_FAMILY])
def test_every_family_sweep_expands_to_runs_of_composed_configs(sweep: str) -> None:
    from sweeps.families import expand

    specs = expand(sweep)
    assert specs and all(spec.run_id and spec.config["method"]["name"] for spec in specs)


@pytest.mark.parametrize("recipe", group_options("vr_method"))
def test_every_variational_recipe_composes_into_variational(recipe: str) -> None:
    cfg = to_container(compose("variational", [f"vr_method@method={recipe}"]))
    assert cfg["method"]["name"] == recipe and cfg["family"] == "variational"


def test_variational_recipes_and_their_files_are_one_list() -> None:
    """The final recipes are conf/vr_method's files (today's five); each vr_<e> recipe names the registered estimator
    <e> (predmask.vr_weights.ESTIMATORS), and every estimator has its recipe."""
    from predmask.schemas.variational_schema import FINAL_RECIPES
    from predmask.vr_weights import ESTIMATORS

    assert FINAL_RECIPES == ("rft", "sft", "vr_acc", "vr_gml", "vr_likelihood")
    named = {r: group_entry("vr_method", r).get("estimator") for r in FINAL_RECIPES if r.startswith("vr_")}
    assert named == {f"vr_{e}": e for e in ESTIMATORS}
