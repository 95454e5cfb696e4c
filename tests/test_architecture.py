"""The dependency rules of docs/architecture.md, read from every module's imports with ``ast`` (lazy ones included).

The graph is built from the source text alone (nothing is imported), so a rule broken inside a function body is
caught as surely as one at the top of a file. Checked: the order of the project's rooms (``LAYERS``: a room imports
only its own and lower rooms), no import cycle between modules nor between the packages of any level (the children
of one package, the top-level rooms included), the runner/reader split of ``analysis`` (``ANALYSIS_ROLES``), and
the rules on verl, the plugin, the launch layer, sweeps and the results library. Each rule is checked against the
real tree and, so that the checker itself cannot pass vacuously, against small made-up trees that break it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Mapping
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the project's own top-level packages and the scripts folder (tests are not part of the architecture)
PACKAGES: tuple[str, ...] = ("predmask", "launch", "sweeps", "analysis", "reports", "conf", "scripts")
#: third-party roots whose import is confined to the VeRL plugin (vLLM is not: the token-level study may sample with it)
VERL_ROOTS: tuple[str, ...] = ("verl",)
#: the cluster stack that the plugin's verl-free modules never import, not even lazily
CLUSTER_STACK: tuple[str, ...] = ("verl", "ray", "tensordict", "megatron")
#: the parts of the plugin (and data preparation) that must import on a machine without verl
VERL_FREE: tuple[str, ...] = (
    "predmask.verl",
    "predmask.verl._hooks",
    "predmask.verl.gather",
    "predmask.verl.loss",
    "predmask.verl.overrides",
    "predmask.verl.packing",
    "predmask.verl.records",
    "predmask.verl.rollout_hook",
    "predmask.verl.settings",
    "predmask.verl.loss_stats",
    "predmask.verl.vr_cluster",
    "predmask.verl.cpu_standin",
    "sweeps.datasets",
    "sweeps.verl_inputs",
)

#: what the notebook library analysis.results may import of the project (docs/architecture.md, "Rooms")
RESULTS_MAY_IMPORT: tuple[str, ...] = ("predmask", "analysis.store", "analysis.training", "analysis.token_level.summary.study_stats",
                                       "analysis.token_level.summary.study_tables", "analysis.results")

#: the project's rooms from the lowest up (docs/architecture.md, "Rooms, lowest first"): a module imports only its
#: own room and lower ones, and two rooms of one tier never import each other
LAYERS: tuple[tuple[str, ...], ...] = (
    ("conf",),  # data: the config tree
    ("predmask",),  # the method, its engines and plugin, the config layer, the run directory
    ("launch",),  # the launch layer: executors, jobs, Ray inside Slurm, the follow loop
    ("analysis",),  # the studies that run, and the store, statistics and frames that read results
    ("sweeps", "reports"),  # the sweep command; figures and tables from the database
    ("scripts",),  # install, test and device checks
)

RUNNER, READER, COMMAND, SHARED = "runner", "reader", "command", "shared"
#: the role of each part of ``analysis`` (a name covers its sub-modules; the longest one wins): a runner runs a study
#: (trains, samples, fans out through the launch layer), a reader reads, stores or summarises results, a command is
#: a command line that uses both, a shared module is a pure helper of either. Runners and readers never import each
#: other nor a command, readers never import the launch layer, shared modules import none of the three, and
#: ``reports`` imports no runner and no command.
ANALYSIS_ROLES: dict[str, str] = {
    "analysis.token_level.compute": RUNNER,
    "analysis.calibrate_runs": RUNNER,
    "analysis.accuracy_weighting.measure": RUNNER,
    "analysis.store": READER,
    "analysis.results": READER,
    "analysis.training": READER,
    "analysis.paired": READER,
    "analysis.token_level.summary": READER,
    "analysis.__main__": COMMAND,
    "analysis.calibrate": COMMAND,
    "analysis.accuracy_weighting.cli": COMMAND,
    "analysis.token_level.__main__": COMMAND,
    "analysis.token_level.cli": COMMAND,
    "analysis.token_level.drift": COMMAND,
    "analysis.token_level.bench": COMMAND,
    "analysis.accuracy_weighting.theory": SHARED,
    "analysis.token_columns": SHARED,
}
#: package cycles known and not yet resolved, each with why it exists; the test fails when one is gone (remove it here)
KNOWN_PACKAGE_CYCLES: dict[str, str] = {}
#: the package markers (``__init__``) of ``analysis``, shared by name only (their sub-modules need a role of their own)
ANALYSIS_PACKAGES: tuple[str, ...] = ("analysis", "analysis.token_level", "analysis.accuracy_weighting")
#: the files that may share a basename, as families of the same role in parallel places (fnmatch patterns relative to
#: the root, each with why); two files of one basename outside one family are a naming defect: each is named by its role
PARALLEL_FAMILIES: dict[tuple[str, ...], str] = {
    ("*/__init__.py",): "a package's marker",
    ("*/__main__.py",): "a package's `python -m` entry",
    ("reports/figures/*.py", "reports/tables/*.py"): "one report family's figures and its tables (token_level, variational)",
    ("predmask/bench.py", "predmask/rl/bench.py", "analysis/token_level/bench.py", "reports/bench.py"):
        "the measurements of one part, each printed by the one entry scripts/benchmark.py",
    ("analysis/*/cli.py",): "a study's command line (`python -m analysis <study>`)",
}

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


def imports_of(path: Path, root: Path, known: set[str]) -> set[str]:
    """Every module ``path`` imports anywhere in its body: project modules as their most specific known name,
    others by their full dotted name."""
    module = module_name(path, root)
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = (
                _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module or ""
            )
            for alias in node.names:
                child = f"{target}.{alias.name}"
                out.add(child if child in known else target)
    return {m for m in out if m and m != module}


def build_graph(root: Path, packages: Iterable[str] = PACKAGES) -> Graph:
    files = [p for pkg in packages if (root / pkg).is_dir() for p in sorted((root / pkg).rglob("*.py"))]
    files = [p for p in files if "__pycache__" not in p.parts]
    known = {module_name(p, root) for p in files}
    return {module_name(p, root): imports_of(p, root, known) for p in files}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def tier_of(module: str) -> int | None:
    """The index in ``LAYERS`` of the room holding ``module``; None for a module outside the project."""
    return next((i for i, rooms in enumerate(LAYERS) for room in rooms if _within(module, room)), None)


def layer_rule(importer: str, dep: str) -> str | None:
    """The broken layer rule of one import, or None."""
    low, high = tier_of(importer), tier_of(dep)
    if low is None or high is None or importer.split(".")[0] == dep.split(".")[0]:
        return None
    order = " < ".join("/".join(rooms) for rooms in LAYERS)
    if high > low:
        return f"a room imports only its own and lower rooms ({order})"
    if high == low:
        return f"rooms of one tier never import each other ({order})"
    return None


def role_of(module: str) -> str | None:
    """The role of a module of ``analysis`` (``ANALYSIS_ROLES``); None for one without a role or outside analysis."""
    if module in ANALYSIS_PACKAGES:
        return SHARED
    names = [name for name in ANALYSIS_ROLES if _within(module, name)]
    return ANALYSIS_ROLES[max(names, key=len)] if names else None


def role_rule(importer: str, dep: str) -> str | None:
    """The broken runner/reader rule of one import, or None."""
    mine, theirs = role_of(importer), role_of(dep)
    if mine == RUNNER and theirs in (READER, COMMAND):
        return "a runner imports no reader of results and no command"
    if mine == READER and (theirs in (RUNNER, COMMAND) or _within(dep, "launch")):
        return "a reader of results imports nothing that runs (no runner, no command, no launch layer)"
    if mine == SHARED and theirs in (RUNNER, READER, COMMAND):
        return "a shared module of analysis imports no runner, reader or command"
    if _within(importer, "reports") and theirs in (RUNNER, COMMAND):
        return "reports reads results: it imports no runner or command of analysis"
    return None


def violations(graph: Mapping[str, set[str]]) -> list[str]:
    """Every broken dependency rule, one line each ("importer -> imported: rule")."""
    rules: list[tuple[str, tuple[str, ...], str]] = [
        # (importer prefix, forbidden prefixes, rule)
        ("reports", ("launch",), "reports runs nothing: it never imports launch"),
        ("reports.tables", ("reports.figures",), "a table never imports a figure module"),
        ("launch", ("predmask.verl",), "the launch layer runs commands: it never imports the verl plugin"),
    ]
    found: list[str] = [f"{m}: a module of analysis without a role (ANALYSIS_ROLES)" for m in sorted(graph)
                        if _within(m, "analysis") and role_of(m) is None]
    for importer, imported in sorted(graph.items()):
        for dep in sorted(imported):
            found += [f"{importer} -> {dep}: {rule}" for rule in (layer_rule(importer, dep), role_rule(importer, dep))
                      if rule]
            for prefix, forbidden, rule in rules:
                if _within(importer, prefix) and any(_within(dep, f) for f in forbidden):
                    found.append(f"{importer} -> {dep}: {rule}")
            if _within(importer, "sweeps") and _within(dep, "analysis") and not _within(dep, "analysis.store"):
                found.append(f"{importer} -> {dep}: sweeps uses only the results store of analysis")
            project = any(_within(dep, p) for p in PACKAGES)
            if _within(importer, "analysis.results") and project and not any(_within(dep, a) for a in RESULTS_MAY_IMPORT):
                found.append(f"{importer} -> {dep}: the results library reads only the store and the statistics")
            if any(_within(dep, v) for v in VERL_ROOTS) and not _within(importer, "predmask.verl"):
                found.append(f"{importer} -> {dep}: only predmask/verl/ imports verl")
            if importer in VERL_FREE and any(_within(dep, v) for v in CLUSTER_STACK):
                found.append(f"{importer} -> {dep}: a verl-free part of the plugin imports the cluster stack")
            if _within(dep, "predmask.verl") and not (
                _within(importer, "predmask.verl") or _within(importer, "sweeps") or _within(importer, "scripts")
            ):
                found.append(f"{importer} -> {dep}: only the cluster launcher and data preparation use the plugin")
    return found


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself): import cycles."""
    nodes = set(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # Tarjan's algorithm; the project's graph is small enough for recursion
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ()) & nodes):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def package_graphs(graph: Mapping[str, set[str]]) -> dict[str, Graph]:
    """For every package (the root ``""`` included), the graph of its children: one child imports another when a
    module under the one imports a module under the other; a package's own ``__init__`` is its child ``__init__``."""
    nodes = set(graph)
    packages = {m for m in nodes if any(n.startswith(m + ".") for n in nodes)}

    def path(module: str) -> list[str]:
        return [*module.split("."), "__init__"] if module in packages else module.split(".")

    out: dict[str, Graph] = defaultdict(lambda: defaultdict(set))
    for importer, imported in graph.items():
        for dep in imported & nodes:
            a, b = path(importer), path(dep)
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            out[".".join(a[:k])][a[k]].add(b[k])
    return {parent: dict(children) for parent, children in out.items()}


def package_cycles(graph: Mapping[str, set[str]]) -> list[str]:
    """Every import cycle between the children of one package, one line each ("package: a <-> b")."""
    return [f"{parent or '<root>'}: {' <-> '.join(cycle)}"
            for parent, children in sorted(package_graphs(graph).items()) for cycle in cycles(children)]


def project_files(root: Path, packages: Iterable[str] = PACKAGES) -> list[str]:
    """Every Python file of the project's packages, as a path relative to ``root``."""
    return sorted(p.relative_to(root).as_posix() for pkg in packages if (root / pkg).is_dir()
                  for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def family_of(path: str) -> tuple[str, ...] | None:
    """The first family of ``PARALLEL_FAMILIES`` whose patterns match ``path``; None for a file in none."""
    return next((family for family in PARALLEL_FAMILIES if any(fnmatch(path, pat) for pat in family)), None)


def shared_basenames(paths: Iterable[str]) -> list[str]:
    """Every basename that files outside one parallel family share, one line each ("name: path, path, ...")."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        by_name[PurePosixPath(path).name].append(path)
    return [f"{name}: {', '.join(group)}" for name, group in sorted(by_name.items())
            if len(group) > 1 and (len({family_of(p) for p in group}) > 1 or family_of(group[0]) is None)]


@pytest.fixture(scope="module")
def graph() -> Graph:
    g = build_graph(ROOT)
    assert {"predmask", "sweeps", "analysis", "reports"} <= set(g), "the project's packages were not found"
    return g


def test_the_project_keeps_its_dependency_rules(graph: Graph) -> None:
    broken = violations(graph)
    assert not broken, "dependency rules broken:\n" + "\n".join(broken)


def test_no_import_cycle_lazy_imports_counted(graph: Graph) -> None:
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycle_between_packages_at_any_level(graph: Graph) -> None:
    found = package_cycles(graph)
    new = [line for line in found if line not in KNOWN_PACKAGE_CYCLES]
    assert not new, "import cycles between packages:\n" + "\n".join(new)
    assert set(KNOWN_PACKAGE_CYCLES) <= set(found), "a known package cycle is gone: remove it from KNOWN_PACKAGE_CYCLES"
    root = package_graphs(graph)[""]
    assert {"predmask", "launch", "analysis", "sweeps", "reports"} <= set(root).union(*root.values())


def test_no_two_files_share_a_basename_outside_a_parallel_family() -> None:
    files = project_files(ROOT)
    found = shared_basenames(files)
    assert not found, "files sharing a basename (name each by its role, or declare a PARALLEL_FAMILIES family):\n" + \
        "\n".join(found)
    unused = [family for family in PARALLEL_FAMILIES
              if not any(len([f for f in files if family_of(f) == family and PurePosixPath(f).name == name]) > 1
                         for name in {PurePosixPath(f).name for f in files})]
    assert not unused, f"families no two files share a basename in (remove them from PARALLEL_FAMILIES): {unused}"


def test_a_shared_basename_is_caught_in_a_made_up_tree(tmp_path: Path) -> None:
    for path in ("predmask/__init__.py", "predmask/stats.py", "predmask/verl/__init__.py", "predmask/verl/stats.py",
                 "analysis/__init__.py", "analysis/store/token_level.py", "reports/__init__.py",
                 "reports/figures/token_level.py", "reports/tables/token_level.py", "reports/figures/draw.py",
                 "reports/tables/draw.py", "analysis/training/stats.py", "analysis/token_level/summary/stats.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert shared_basenames(project_files(tmp_path)) == [
        ("stats.py: analysis/token_level/summary/stats.py, analysis/training/stats.py, predmask/stats.py, "
         "predmask/verl/stats.py"),
        "token_level.py: analysis/store/token_level.py, reports/figures/token_level.py, reports/tables/token_level.py",
    ]
    assert shared_basenames(["predmask/bench.py", "reports/bench.py",
                             "reports/figures/draw.py", "reports/tables/draw.py", "a/__init__.py", "b/c/__init__.py"]) == []


def test_the_layers_hold_every_room_once() -> None:
    rooms = [room for tier in LAYERS for room in tier]
    assert sorted(rooms) == sorted(PACKAGES)


def test_a_package_cycle_is_caught_where_no_module_cycle_is() -> None:
    g = {
        "analysis.token_level.compute.a": {"analysis.token_level.summary.b"},
        "analysis.token_level.summary.c": {"analysis.token_level.compute.d"},
        "analysis.token_level.compute.d": set(),
        "analysis.token_level.summary.b": set(),
        "predmask.rl.x": {"predmask"},
        "predmask": {"predmask.rl.y"},
        "predmask.rl.y": set(),
    }
    assert cycles(g) == []
    assert package_cycles(g) == ["analysis.token_level: compute <-> summary", "predmask: __init__ <-> rl"]
    assert package_cycles({"analysis.store.a": {"analysis.results.b"}, "analysis.results.b": {"predmask.io"},
                           "predmask.io": set()}) == []


def test_the_tiers_of_a_made_up_tree(tmp_path: Path) -> None:
    for room, text in (("conf", "import predmask.config\n"), ("predmask", "def f():\n    import analysis.store\n"),
                       ("sweeps", "from reports import tables\n"), ("analysis", "import numpy\nimport launch.follow\n")):
        (tmp_path / room).mkdir()
        (tmp_path / room / "__init__.py").write_text("")
        (tmp_path / room / "m.py").write_text(text)
    g = build_graph(tmp_path, ("conf", "predmask", "sweeps", "analysis"))
    broken = sorted(line.split(": ")[0] for line in violations(g) if "room" in line)
    assert broken == ["conf.m -> predmask.config", "predmask.m -> analysis.store", "sweeps.m -> reports"]


def test_the_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "reports"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from reports.a import g\n    import sweeps.submit\n")
    g = build_graph(tmp_path, ("reports",))
    assert g["reports.a"] == {"reports.b"}
    assert g["reports.b"] == {"reports.a", "sweeps.submit"}
    assert cycles(g) == [["reports.a", "reports.b"]]
    order = "conf < predmask < launch < analysis < sweeps/reports < scripts"
    assert violations(g) == [f"reports.b -> sweeps.submit: rooms of one tier never import each other ({order})"]


@pytest.mark.parametrize(
    ("importer", "imported", "rule"),
    [
        ("predmask.methods", "analysis.store", "a room imports only its own and lower rooms"),
        ("analysis.token_level.compute.fanout", "sweeps.compose", "a room imports only its own and lower rooms"),
        ("analysis.calibrate", "sweeps", "a room imports only its own and lower rooms"),
        ("launch.follow", "sweeps", "a room imports only its own and lower rooms"),
        ("predmask.rl.train", "launch.procs", "a room imports only its own and lower rooms"),
        ("conf", "predmask.config", "a room imports only its own and lower rooms"),
        ("launch.slurm", "analysis.store", "a room imports only its own and lower rooms"),
        ("launch.ray_job", "predmask.verl.settings", "the launch layer runs commands"),
        ("analysis.token_level.compute.fanout", "analysis.token_level.summary.study_stats", "a runner imports no reader"),
        ("analysis.token_level.compute.study", "analysis.store", "a runner imports no reader"),
        ("analysis.calibrate_runs", "analysis.training.stats", "a runner imports no reader"),
        ("analysis.accuracy_weighting.measure", "analysis.accuracy_weighting.cli", "a runner imports no reader"),
        ("analysis.token_level.summary.study_stats", "analysis.token_level.compute.study", "a reader of results imports"),
        ("analysis.token_level.summary.report", "analysis.token_level.cli", "a reader of results imports"),
        ("analysis.store.ingest", "launch.follow", "a reader of results imports"),
        ("analysis.training.stats", "analysis.calibrate_runs", "a reader of results imports"),
        ("analysis.accuracy_weighting.theory", "analysis.store", "a shared module of analysis"),
        ("analysis.token_columns", "analysis.token_level.summary.study_stats", "a shared module of analysis"),
        ("analysis.token_level", "analysis.token_level.compute.fanout", "a shared module of analysis"),
        ("reports.figures.token_level", "analysis.token_level.compute.study", "reports reads results"),
        ("reports.paper", "analysis.calibrate", "reports reads results"),
        ("analysis.new_study", "numpy", "a module of analysis without a role"),
        ("sweeps.submit", "analysis.token_level.summary.study_stats", "sweeps uses only the results store"),
        ("launch.follow", "sweeps.run_dirs", "a room imports only its own and lower rooms"),
        ("predmask.rl.engine", "verl.utils", "only predmask/verl/ imports verl"),
        ("analysis.store.ingest", "predmask.verl.overrides", "only the cluster launcher"),
        ("reports.tables", "launch.slurm", "reports runs nothing"),
        ("reports.tables", "sweeps.plan", "rooms of one tier never import each other"),
        ("sweeps.submit", "reports.paper", "rooms of one tier never import each other"),
        ("reports.tables.main_results", "reports.figures.training", "a table never imports a figure module"),
        ("predmask.verl.packing", "verl.utils", "a verl-free part of the plugin"),
        ("sweeps.datasets", "ray", "a verl-free part of the plugin"),
        ("predmask.verl.settings", "verl.workers", "a verl-free part of the plugin"),
        ("analysis.results.library", "analysis.token_level.compute.study", "the results library reads only"),
        ("analysis.results.curves", "analysis.calibrate", "the results library reads only"),
    ],
)
def test_each_rule_catches_its_breach(importer: str, imported: str, rule: str) -> None:
    found = violations({importer: {imported}})
    assert any(rule in line for line in found), found


def test_allowed_edges_pass() -> None:
    allowed = {
        "sweeps.__main__": {"analysis.store", "predmask.config"},
        "analysis.token_level.compute.fanout": {"launch.follow", "predmask.io"},
        "analysis.token_level.cli": {"analysis.token_level.compute.fanout", "analysis.token_level.summary.study_stats",
                                     "analysis.store", "polars"},
        "analysis.calibrate": {"analysis.calibrate_runs", "analysis.training.stats", "predmask.config"},
        "analysis.calibrate_runs": {"launch.follow", "predmask.rundir"},
        "analysis.accuracy_weighting.measure": {"analysis.accuracy_weighting.theory", "predmask.rl.algo"},
        "analysis.token_level.summary.criteria": {"analysis.paired", "analysis.token_level.summary.study_stats",
                                                  "analysis.token_columns"},
        "analysis.token_level.compute.study": {"analysis.token_columns", "predmask.rl.algo"},
        "analysis.store.schema": {"analysis.token_columns"},
        "scripts.gpu_check": {"predmask.verl.records", "analysis.token_level.compute.study"},
        "reports.paper": {"analysis.store", "analysis.token_level.summary.study_stats", "predmask.config"},
        "sweeps.submit": {"predmask.verl.overrides"},
        "predmask.verl.topk_loss": {"verl.utils", "predmask.verl.packing"},
        "analysis.results.library": {"pandas", "polars", "analysis.store", "analysis.training.stats",
                                     "analysis.token_level.summary.study_stats", "analysis.results.curves", "predmask.methods"},
    }
    assert violations(allowed) == []
