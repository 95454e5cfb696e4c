"""The dependency rules of docs/architecture.md, read from every module's imports with ``ast`` (lazy ones included).

The graph is built from the source text alone (nothing is imported), so a rule broken inside a function body is
caught as surely as one at the top of a file. Each rule is checked against the real tree and, so that the checker
itself cannot pass vacuously, against small made-up trees that break it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

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
    "predmask.verl.rollout",
    "predmask.verl.settings",
    "predmask.verl.stats",
    "predmask.verl.variational",
    "sweeps.data",
)

#: what the notebook library analysis.results may import of the project (docs/architecture.md, "may import")
RESULTS_MAY_IMPORT: tuple[str, ...] = ("predmask", "analysis.store", "analysis.training", "analysis.token_level.summary.stats",
                                       "analysis.results")

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


def violations(graph: Mapping[str, set[str]]) -> list[str]:
    """Every broken dependency rule, one line each ("importer -> imported: rule")."""
    rules: list[tuple[str, tuple[str, ...], str]] = [
        # (importer prefix, forbidden prefixes, rule)
        ("predmask", ("launch", "sweeps", "analysis", "reports"),
         "predmask imports none of launch, sweeps, analysis, reports"),
        ("sweeps", ("reports",), "sweeps never imports reports"),
        ("analysis", ("reports",), "analysis never imports reports"),
        ("reports", ("sweeps", "launch"), "reports runs nothing: it never imports sweeps or launch"),
        ("reports.tables", ("reports.figures",), "a table never imports a figure module"),
        ("analysis", ("sweeps",), "analysis never imports sweeps"),
        ("launch", ("sweeps", "analysis", "reports", "predmask.verl"),
         "the launch layer stands below sweeps and analysis"),
        ("conf", ("predmask", "sweeps", "analysis", "reports"), "conf/ is data: it imports nothing of the project"),
    ]
    found: list[str] = []
    for importer, imported in sorted(graph.items()):
        for dep in sorted(imported):
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
    assert violations(g) == ["reports.b -> sweeps.submit: reports runs nothing: it never imports sweeps or launch"]


@pytest.mark.parametrize(
    ("importer", "imported", "rule"),
    [
        ("predmask.methods", "analysis.store", "predmask imports none of"),
        ("analysis.token_level.compute.fanout", "sweeps.compose", "analysis never imports sweeps"),
        ("analysis.calibrate", "sweeps", "analysis never imports sweeps"),
        ("launch.follow", "sweeps", "the launch layer stands below"),
        ("predmask.rl.train", "launch.procs", "predmask imports none of"),
        ("sweeps.submit", "analysis.token_level.summary.stats", "sweeps uses only the results store"),
        ("launch.follow", "sweeps.runs", "the launch layer stands below"),
        ("predmask.rl.engine", "verl.utils", "only predmask/verl/ imports verl"),
        ("analysis.store.ingest", "predmask.verl.overrides", "only the cluster launcher"),
        ("reports.tables", "launch.slurm", "reports runs nothing"),
        ("reports.tables", "sweeps.plan", "reports runs nothing"),
        ("reports.tables.main_results", "reports.figures.training", "a table never imports a figure module"),
        ("predmask.verl.packing", "verl.utils", "a verl-free part of the plugin"),
        ("sweeps.data", "ray", "a verl-free part of the plugin"),
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
        "reports.paper": {"analysis.store", "analysis.token_level.summary.stats", "predmask.config"},
        "sweeps.submit": {"predmask.verl.overrides"},
        "predmask.verl.topk_loss": {"verl.utils", "predmask.verl.packing"},
        "analysis.results.library": {"pandas", "polars", "analysis.store", "analysis.training.stats",
                                     "analysis.token_level.summary.stats", "analysis.results.curves", "predmask.methods"},
    }
    assert violations(allowed) == []
