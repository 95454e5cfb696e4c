"""pyproject.toml's extras against what verl 0.9.1 declares (its installed requirement metadata) and needs.

Independent truth: ``importlib.metadata.requires("verl")`` (verl's own wheel metadata, with its extras' markers),
``packaging``'s specifier semantics, and verl's real ``DataProto.to_tensordict`` for the tensordict floor its
metadata does not declare. An extra of ours may be narrower than verl's range, never wider: every version probed
near the bounds of either range that ours admits, verl's must admit too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[2]
VERL = "verl"
pytestmark = pytest.mark.verl


def _verl_requires() -> list[Requirement]:
    try:
        return [Requirement(r) for r in metadata.requires(VERL) or []]
    except metadata.PackageNotFoundError:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip("verl is not installed; install the 'verl' extra")
        raise  # unreachable


def _marker_holds(marker: Marker | None, extra: str) -> bool:
    return marker is None or marker.evaluate({"extra": extra})


def verl_constraints(requires: Iterable[Requirement], extra: str) -> dict[str, SpecifierSet]:
    """package -> the intersection of verl's specifiers for it when installed as ``verl[extra]`` (its base
    requirements, the extra's own and those of the verl extras it names in turn); ``extra`` "" is plain verl."""
    requires = list(requires)
    out: dict[str, SpecifierSet] = {}
    seen: set[str] = set()
    todo = [""] if not extra else ["", extra]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for req in requires:
            if not _marker_holds(req.marker, current) or (current and req.marker is None):
                continue
            name = canonicalize_name(req.name)
            if name == VERL:
                todo.extend(req.extras)
                continue
            out[name] = out.get(name, SpecifierSet()) & req.specifier
    return out


def _bounds(spec: SpecifierSet) -> list[Version]:
    out = []
    for s in spec:
        try:
            out.append(Version(s.version.removesuffix(".*")))
        except InvalidVersion:
            continue
    return out


def probe_versions(*specs: SpecifierSet) -> list[Version]:
    """Versions at, just below and just above every bound of ``specs`` (and far below and above them all)."""
    out = {Version("0"), Version("0.0.1"), Version("99999")}
    for spec in specs:
        for v in _bounds(spec):
            rel = list(v.release)
            out |= {v, Version(f"{v.base_version}.post1"), Version(".".join(map(str, [*rel[:-1], rel[-1] + 1])))}
            if rel[-1] > 0:
                out.add(Version(".".join(map(str, [*rel[:-1], rel[-1] - 1]))))
            out |= {Version(f"{rel[0]}.{(rel[1] if len(rel) > 1 else 0) + 1}"), Version(f"{rel[0] + 1}")}
            if len(rel) > 1 and rel[1] > 0:
                out.add(Version(f"{rel[0]}.{rel[1] - 1}.99"))
    return sorted(out)


def wider_than(ours: SpecifierSet, theirs: SpecifierSet) -> list[Version]:
    """Probe versions ``ours`` admits and ``theirs`` refuses (empty: ours lies within theirs at every probe)."""
    return [v for v in probe_versions(ours, theirs) if ours.contains(v, prereleases=True)
            and not theirs.contains(v, prereleases=True)]


def disagreements(extras: Mapping[str, list[str]], requires: Iterable[Requirement]) -> list[str]:
    """One line per requirement of an extra of ours that admits a version verl (as ``verl[<that extra>]``, or plain
    verl where it has no such extra) refuses, or that admits no version at all."""
    requires = list(requires)
    verl_extras = {e for r in requires for e in _extras_in(r.marker)}
    lines = []
    for extra, reqs in extras.items():
        theirs = verl_constraints(requires, extra if extra in verl_extras else "")
        for text in reqs:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name == VERL or name not in theirs:
                continue
            if not any(req.specifier.contains(v, prereleases=True) for v in probe_versions(req.specifier)):
                lines.append(f"[{extra}] {text}: admits no version")
            wide = wider_than(req.specifier, theirs[name])
            if wide:
                lines.append(f"[{extra}] {text}: admits {wide[0]}, which verl refuses ({name}{theirs[name]})")
    return lines


def _extras_in(marker: Marker | None) -> set[str]:
    if marker is None:
        return set()
    text = str(marker)
    return {part.split('"')[1] for part in text.split("extra == ")[1:]}


def our_extras() -> dict[str, list[str]]:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def our_dependencies() -> list[str]:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


# ------------------------------------------------------------------------------------------------------ the tests
def test_every_extra_lies_within_what_verl_declares() -> None:
    assert disagreements(our_extras(), _verl_requires()) == []


def test_the_extras_pin_the_versions_verl_is_built_with() -> None:
    extras = our_extras()
    verl_pin = {canonicalize_name(Requirement(r).name): Requirement(r).specifier for r in extras["verl"]}
    assert verl_pin[VERL] == SpecifierSet("==0.9.1") and metadata.version(VERL) == "0.9.1"
    # the GPU environment is verl's own vllm extra (vLLM 0.24.0 and the torch, transformers and mbridge it needs), not
    # vLLM beside our own pins
    assert verl_constraints(_verl_requires(), "vllm")["vllm"] == SpecifierSet("==0.24.0")
    (gpu,) = (Requirement(r) for r in extras["vllm"])
    assert (canonicalize_name(gpu.name), gpu.extras, gpu.specifier) == (VERL, {"vllm"}, SpecifierSet("==0.9.1"))


def test_the_check_fails_on_a_spec_wider_than_verls() -> None:
    """The same check on deliberately wrong extras: an unpinned vllm, the old tensordict range's lower half, a ray
    below verl's floor, a spec that admits nothing."""
    requires = _verl_requires()
    wrong = {"vllm": ["vllm"], "verl": ["tensordict>=0.7,<=0.10.0", "ray>=2.40", "numpy>=3,<2"]}
    lines = disagreements(wrong, requires)
    assert [line.split(":")[0] for line in lines] == [
        "[vllm] vllm", "[verl] tensordict>=0.7,<=0.10.0", "[verl] ray>=2.40", "[verl] numpy>=3,<2"]
    assert lines[0].endswith("admits 0, which verl refuses (vllm==0.24.0)")
    assert lines[3].endswith("admits no version")
    assert disagreements({"verl": ["ray>=2.41.0", "tensordict==0.10.0"], "vllm": ["vllm==0.24.0"]}, requires) == []


def _to_tensordict_runs_at(version: Version) -> bool:
    """Whether verl's real ``DataProto.to_tensordict`` converts a tiny batch when tensordict reports ``version``."""
    import tensordict
    import torch
    from verl.protocol import DataProto

    data = DataProto.from_dict(tensors={"x": torch.zeros(2, 3)})
    real = tensordict.__version__
    tensordict.__version__ = str(version)
    try:
        data.to_tensordict()
        return True
    except AssertionError:
        return False
    finally:
        tensordict.__version__ = real


def test_the_tensordict_pin_admits_only_versions_verls_dataproto_accepts() -> None:
    """verl's metadata declares tensordict >= 0.8, but its DataProto.to_tensordict (the actor update's path)
    asserts >= 0.10: our pin admits only versions that pass it; verl's declared range admits some that fail."""
    pytest.importorskip("verl.protocol")
    ours = next(Requirement(r) for r in our_extras()["verl"] if Requirement(r).name == "tensordict").specifier
    declared = verl_constraints(_verl_requires(), "")["tensordict"]
    probes = probe_versions(ours, declared)
    admitted = [v for v in probes if ours.contains(v)]
    assert admitted and all(_to_tensordict_runs_at(v) for v in admitted)
    assert not all(_to_tensordict_runs_at(v) for v in probes if declared.contains(v))


def test_the_installed_environment_satisfies_our_pins() -> None:
    """Every requirement of our dependencies and of the verl and cluster extras that names an installed package
    admits the installed version (vllm is not installed on a CPU machine)."""
    extras = our_extras()
    wrong = []
    for text in [*our_dependencies(), *extras["verl"], *extras["cluster"], *extras["vllm"]]:
        req = Requirement(text)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue
        if not req.specifier.contains(have, prereleases=True):
            wrong.append(f"{text} (installed {have})")
    assert wrong == [], f"{sys.prefix}: {wrong}"
