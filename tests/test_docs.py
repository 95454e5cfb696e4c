"""The project's documents and every reference to them resolve: links, files, sections and the code names they cite.

Read from the files alone (nothing is imported). The files are the repository's own: what ``git ls-files`` lists,
tracked or new but not ignored. Checked:

- every relative link (and image) in README.md and docs/*.md names a file of the repository, and its ``#anchor``
  a heading of that file (GitHub's heading anchors);
- every docs page is reachable from README.md by such links;
- every reference to a docs page (a path through a ``docs/`` folder) and every section reference of the form
  ``<file>.md §<N>`` in any file (code, docstrings, help texts, scripts, conf comments, docs) names a file of the
  repository and, where it names a section, a numbered heading of that file;
- the repository paths, dotted code names and test names that docs/math.md and docs/architecture.md cite exist.

Each checker is also run on small made-up trees that break its rule, so that it cannot pass vacuously.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the pages whose cited paths, code names and test names must exist
CODE_CITING_DOCS: tuple[str, ...] = ("docs/math.md", "docs/architecture.md")
#: the project's top-level packages: a dotted name starting with one of them is a code name
PACKAGES: tuple[str, ...] = ("predmask", "launch", "sweeps", "analysis", "reports", "conf", "scripts")

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_SECTION_NUMBER = re.compile(r"^(\d+(?:\.\d+)*)\.?(?:\s|$)")
#: a path through a docs folder, e.g. ``docs/results.md`` or ``../docs/math.md#anchor``
_DOCS_REF = re.compile(r"(?<![\w.-])((?:\.{1,2}/|/)?(?:[\w.-]+/)*docs/[\w.-]+\.md)(#[\w-]+)?")
_SECTION_RUN = r"§\s*\d+(?:\.\d+)*(?:\s*[-–]\s*\d+(?:\.\d+)*)?"
#: ``<file>.md §N`` with ``§1-3``, ``§3.1, §3.3`` and ``§2 and §4`` forms
_SECTION_REF = re.compile(
    r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)((?:\s*(?:,|and)?\s*" + _SECTION_RUN + r")+)"
)
_SECTION_ITEM = re.compile(r"§\s*(\d+(?:\.\d+)*)(?:\s*[-–]\s*(\d+(?:\.\d+)*))?")
_PATH_SPAN = re.compile(r"^(?:" + "|".join(PACKAGES + ("tests", "docs")) + r")(?:/[\w.-]+)*/?$")
_DOTTED_SPAN = re.compile(r"^(?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+$")
_TEST_SPAN = re.compile(r"^(tests/[\w./-]+\.py)?::(\w+)$")
_TEST_FILE_SPAN = re.compile(r"^tests/[\w./-]+\.py$")


# ----------------------------------------------------------------------------------------------- the files
@dataclass(frozen=True)
class Tree:
    """A repository: its root and its files (posix paths relative to the root) with their text."""

    root: Path
    files: Mapping[str, str]

    def has(self, path: str) -> bool:
        return path in self.files or any(f.startswith(path.rstrip("/") + "/") for f in self.files)


def _is_text(path: Path) -> bool:
    try:
        head = path.read_bytes()[:8192]
    except OSError:
        return False
    return b"\0" not in head


def repository_files(root: Path) -> list[str]:
    """The repository's files: tracked, or new and not ignored (``git ls-files -co --exclude-standard``)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=root, check=True, capture_output=True, text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"the documents are checked in a git checkout of the project ({err})")
    return sorted(p for p in out.split("\0") if p and (root / p).is_file())


@cache
def repository() -> Tree:
    files = {p: (ROOT / p).read_text(errors="replace") for p in repository_files(ROOT) if _is_text(ROOT / p)}
    return Tree(ROOT, files)


def markdown_pages(tree: Tree) -> list[str]:
    """README.md and the pages of docs/."""
    return sorted(p for p in tree.files if p == "README.md" or re.fullmatch(r"docs/[^/]+\.md", p))


# ----------------------------------------------------------------------------------------------- markdown
def prose_lines(text: str) -> Iterable[tuple[int, str]]:
    """(line number, line) of a markdown text outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    heading suffixed ``-1``, ``-2``, ..."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        title = _INLINE_LINK.sub(lambda link: re.sub(r"^!?\[|\]\(.*$", "", link.group(0)), m.group(2))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def section_numbers(text: str) -> set[str]:
    """The numbers of a page's numbered headings: ``## 3. Title`` is "3", ``### 3.1 Title`` is "3.1"."""
    numbers: set[str] = set()
    for _, line in prose_lines(text):
        m = _HEADING.match(line)
        if m:
            n = _SECTION_NUMBER.match(m.group(2))
            if n:
                numbers.add(n.group(1))
    return numbers


def page_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every relative link and image of a markdown page (code spans and blocks left out)."""
    out: list[tuple[int, str]] = []
    for number, line in prose_lines(text):
        prose = _CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in _INLINE_LINK.finditer(prose)]
        ref = _REF_LINK.match(prose)
        if ref:
            targets.append(ref.group(1))
        out.extend((number, t) for t in targets if not _SCHEME.match(t))
    return out


def _normalise(base: str, target: str) -> str | None:
    """``target`` relative to the folder of the file ``base``, as a repository path; None when it leaves the root."""
    parts: list[str] = []
    for part in PurePosixPath(base).parent.joinpath(target).parts:
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    return "/".join(parts)


def link_problem(tree: Tree, page: str, target: str) -> str | None:
    """Why a relative link of ``page`` does not resolve, or None."""
    path, _, anchor = target.partition("#")
    resolved = page if not path else _normalise(page, path)
    if resolved is None:
        return f"{target} leaves the repository"
    if not tree.has(resolved):
        return f"{target} names no file of the repository"
    if anchor:
        if resolved not in tree.files or not resolved.endswith(".md"):
            return f"{target}: an anchor into something that is not a markdown page"
        if anchor not in heading_anchors(tree.files[resolved]):
            return f"{target}: {resolved} has no heading with the anchor #{anchor}"
    return None


def broken_links(tree: Tree) -> list[str]:
    return [
        f"{page}:{line}: {problem}"
        for page in markdown_pages(tree)
        for line, target in page_links(tree.files[page])
        if (problem := link_problem(tree, page, target)) is not None
    ]


def unreachable_pages(tree: Tree, start: str = "README.md") -> list[str]:
    """The docs pages no chain of relative links from ``start`` leads to."""
    seen, todo = {start}, [start]
    while todo:
        page = todo.pop()
        for _, target in page_links(tree.files.get(page, "")):
            path = target.partition("#")[0]
            resolved = _normalise(page, path) if path else None
            if resolved and resolved.endswith(".md") and resolved in tree.files and resolved not in seen:
                seen.add(resolved)
                todo.append(resolved)
    return [p for p in markdown_pages(tree) if p != start and p not in seen]


# ----------------------------------------------------------------------------------------------- references
def _resolve_reference(tree: Tree, source: str, ref: str) -> tuple[str | None, str | None]:
    """(repository path, None) of a file reference in ``source``, or (None, why it does not resolve)."""
    if ref.startswith("/"):
        return None, f"{ref} is an absolute path; name the file relative to the repository root"
    if "/" not in ref:
        named = [f for f in tree.files if PurePosixPath(f).name == ref]
        if len(named) == 1:
            return named[0], None
        if not named:
            return None, f"{ref} names no file of the repository"
        return None, f"{ref} is ambiguous ({', '.join(named)}); name it with its folder"
    path = _normalise(source, ref) if ref.startswith(".") else ref
    if path is None or path not in tree.files:
        return None, f"{ref} names no file of the repository"
    return path, None


def reference_problems(tree: Tree, exclude: Iterable[str] = ()) -> list[str]:
    """Every docs-page and ``<file>.md §N`` reference in the repository's text files that does not resolve."""
    skip = set(exclude)
    problems: list[str] = []
    for source, text in sorted(tree.files.items()):
        if source in skip:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{source}:{number}"
            for m in _DOCS_REF.finditer(line):
                path, why = _resolve_reference(tree, source, m.group(1))
                if why:
                    problems.append(f"{where}: {why}")
                elif m.group(2) and m.group(2)[1:] not in heading_anchors(tree.files[str(path)]):
                    problems.append(f"{where}: {path} has no heading with the anchor {m.group(2)}")
            for m in _SECTION_REF.finditer(line):
                path, why = _resolve_reference(tree, source, m.group(1))
                if why:
                    problems.append(f"{where}: {why}")
                    continue
                have = section_numbers(tree.files[str(path)])
                for item in _SECTION_ITEM.finditer(m.group(2)):
                    for section in filter(None, item.groups()):
                        if section not in have:
                            problems.append(f"{where}: {path} has no section {section} (it has: "
                                            f"{', '.join(sorted(have)) or 'no numbered headings'})")
    return problems


# ----------------------------------------------------------------------------------------------- code names
def _module_file(tree: Tree, parts: list[str]) -> str | None:
    base = "/".join(parts)
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in tree.files:
            return candidate
    return None


def _top_level_names(source: str) -> dict[str, ast.AST]:
    """A module's top-level names (definitions, assignments, imports) -> their node."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def _class_members(node: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return members


def dotted_name_problem(tree: Tree, name: str) -> str | None:
    """Why a dotted code name (``package.module.attribute[.member]``) does not exist in the tree, or None."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(tree, parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        names = _top_level_names(tree.files[module])
        node = names.get(rest[0])
        if node is None:
            return f"{name}: {module} defines no {rest[0]}"
        if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in _class_members(node):
            return f"{name}: class {rest[0]} of {module} has no member {rest[1]}"
        return None
    return f"{name}: no module of the repository"


def _test_defined(source: str, name: str) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
               for n in ast.walk(ast.parse(source)))


def citation_problems(tree: Tree, page: str) -> list[str]:
    """The paths, code names and tests that ``page`` cites in code spans and that do not exist.

    A span ``::test_name`` belongs to the test file named last before it on the page."""
    problems: list[str] = []
    last_test_file: str | None = None
    for number, line in prose_lines(tree.files[page]):
        for span in (s[1:-1].strip() for s in _CODE_SPAN.findall(line)):
            where = f"{page}:{number}"
            test = _TEST_SPAN.match(span)
            if _TEST_FILE_SPAN.match(span):
                last_test_file = span
            if test:
                file = test.group(1) or last_test_file
                last_test_file = file
                if file is None:
                    problems.append(f"{where}: {span} follows no test file")
                elif file not in tree.files:
                    problems.append(f"{where}: {file} names no file of the repository")
                elif not _test_defined(tree.files[file], test.group(2)):
                    problems.append(f"{where}: {file} defines no {test.group(2)}")
            elif _PATH_SPAN.match(span) and "/" in span:
                if not tree.has(span):
                    problems.append(f"{where}: {span} names no file or folder of the repository")
            elif _DOTTED_SPAN.match(span):
                why = dotted_name_problem(tree, span)
                if why:
                    problems.append(f"{where}: {why}")
    return problems


# ----------------------------------------------------------------------------------------------- the real tree
def test_relative_links_in_readme_and_docs_resolve() -> None:
    tree = repository()
    assert "README.md" in tree.files
    problems = broken_links(tree)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    tree = repository()
    missing = unreachable_pages(tree)
    assert not missing, f"no chain of links from README.md leads to: {', '.join(missing)}"


def test_references_to_docs_and_sections_name_files_and_sections_that_exist() -> None:
    tree = repository()
    own = str(Path(__file__).resolve().relative_to(ROOT).as_posix())
    problems = reference_problems(tree, exclude=[own])
    assert not problems, "references that do not resolve:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", CODE_CITING_DOCS)
def test_the_code_a_page_cites_exists(page: str) -> None:
    tree = repository()
    assert page in tree.files, f"{page} is not in the repository"
    problems = citation_problems(tree, page)
    assert not problems, f"{page} cites what does not exist:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------------------------- made-up trees
def _tree(files: Mapping[str, str]) -> Tree:
    return Tree(Path("/nonexistent"), dict(files))


def test_link_checker_catches_a_missing_file_a_missing_anchor_and_a_link_out_of_the_tree() -> None:
    tree = _tree({
        "README.md": "See [a](docs/a.md), [b](docs/b.md), [c](docs/a.md#no-such), [d](../outside.md),\n"
                     "[ok](docs/a.md#the-title-1), [self](#readme), ![img](docs/pic.png), [web](https://x.org)\n"
                     "`[span](docs/zzz.md)`\n```\n[code](docs/zzz.md)\n```\n# Readme\n",
        "docs/a.md": "# The title\n## The title\n",
        "docs/pic.png": "",
    })
    problems = broken_links(tree)
    assert len(problems) == 3, problems
    assert any("docs/b.md names no file" in p for p in problems)
    assert any("#no-such" in p for p in problems)
    assert any("leaves the repository" in p for p in problems)


def test_heading_anchors_follow_github() -> None:
    anchors = heading_anchors("# 3.1 Top-K KL\n## The `run` directory: locks (and Ḋ)\n## Twice\n## Twice\n")
    assert anchors == {"31-top-k-kl", "the-run-directory-locks-and-ḋ", "twice", "twice-1"}


def test_reachability_follows_chains_of_links() -> None:
    tree = _tree({"README.md": "[x](docs/x.md)", "docs/x.md": "[y](y.md)", "docs/y.md": "", "docs/z.md": ""})
    assert unreachable_pages(tree) == ["docs/z.md"]


def test_reference_checker_catches_missing_files_sections_and_absolute_paths() -> None:
    tree = _tree({
        "docs/math.md": "## 1. One\n### 3.1 Sub\n## 3. Three\n## 5. Five\n# Anchor here\n",
        "pkg/mod.py": '"""Formulas of math.md §1-3 and math.md §3.1, §3.3; see docs/math.md#anchor-here."""\n'
                      "# the study of math.md §5 item 2 (paper §4.2)\n",
        "pkg/help.py": 'HELP = "see docs/cluster-facts.md and /abs/docs/x.md, docs/math.md#nowhere"\n',
        "scripts/x.sh": "# other.md §2 names nothing\n",
    })
    problems = reference_problems(tree)
    assert any("pkg/mod.py:1: docs/math.md has no section 3.3" in p for p in problems), problems
    assert any("docs/cluster-facts.md names no file" in p for p in problems)
    assert any("absolute path" in p for p in problems)
    assert any("#nowhere" in p for p in problems)
    assert any("other.md names no file" in p for p in problems)
    assert len(problems) == 5, problems


def test_a_bare_name_must_name_one_file() -> None:
    tree = _tree({"a/notes.md": "## 1. x\n", "b/notes.md": "## 1. x\n", "c.py": "# notes.md §1\n"})
    assert any("ambiguous" in p for p in reference_problems(tree))


def test_citation_checker_catches_missing_paths_names_and_tests() -> None:
    tree = _tree({
        "docs/math.md": (
            "`predmask/metrics.py` `predmask/nothere.py` `predmask.metrics.merge_micro_batches`\n"
            "`predmask.metrics.no_such` `predmask.methods.MethodParams.delta` `predmask.methods.MethodParams.nope`\n"
            "`predmask.METHODS` `tests/method/test_x.py::test_real` `::test_missing` `tests/nope.py::test_a`\n"
            "`predmask.anchor=old` `python -m sweeps smoke`\n"
        ),
        "predmask/__init__.py": "from predmask.methods import METHODS\n",
        "predmask/metrics.py": "def merge_micro_batches(parts):\n    return parts\n",
        "predmask/methods.py": "METHODS = {}\nclass MethodParams:\n    delta: float = 0.15\n",
        "tests/method/test_x.py": "def test_real():\n    pass\n",
    })
    problems = citation_problems(tree, "docs/math.md")
    expected = ("predmask/nothere.py names no file", "defines no no_such", "has no member nope",
                "defines no test_missing", "tests/nope.py names no file")
    for part in expected:
        assert any(part in p for p in problems), (part, problems)
    assert len(problems) == len(expected), problems
