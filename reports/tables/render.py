"""How a table is written: a TextTable as Markdown or LaTeX (escaped), and its files in the output folder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from predmask.io import atomic_write_text
from reports.artefact import Artefact, ArtefactResult, ReportContext, Source, declare


@dataclass
class TextTable:
    """A rendered-anywhere table: a title, a note, header cells and rows of cells (plain text)."""

    title: str
    note: str
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        def cell(s: str) -> str:
            return s.replace("|", "\\|").replace("\n", " ")

        lines = [
            f"### {self.title}",
            "",
            self.note,
            "",
            "| " + " | ".join(cell(h) for h in self.header) + " |",
        ]
        lines.append("|" + "|".join("---" for _ in self.header) + "|")
        lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"

    def latex(self) -> str:
        cols = "l" + "l" * (len(self.header) - 1)
        lines = [
            "% requires \\usepackage{booktabs}",
            "\\begin{table}[t]",
            "\\centering",
            "\\small",
            f"\\caption{{{latex_escape(self.title)}. {latex_escape(self.note)}}}",
            f"\\begin{{tabular}}{{{cols}}}",
            "\\toprule",
            " & ".join(latex_escape(h) for h in self.header) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join(latex_escape(c) for c in row) + " \\\\" for row in self.rows]
        lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
        return "\n".join(lines) + "\n"


_LATEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "δ": r"$\delta$",
    "±": r"$\pm$",
    "Δ": r"$\Delta$",
    "—": "---",
    "≈": r"$\approx$",
    "≥": r"$\geq$",
    "−": "-",
    "·": r"$\cdot$",
    "\n": " ",
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in text)


def write_tables(out: Path, name: str, *tables: TextTable) -> list[Path]:
    """Write out/<name>.md and out/<name>.tex atomically, the tables a blank line apart; the paths written."""
    texts = {
        out / f"{name}.md": "\n".join(t.markdown() for t in tables),
        out / f"{name}.tex": "\n".join(t.latex() for t in tables),
    }
    for path, text in texts.items():
        atomic_write_text(path, text)
    return list(texts)


def table(title: str, source: Source = "runs") -> Callable[[Callable[[ReportContext], ArtefactResult]], Artefact]:
    """Declare a table function named as its files are; it sets the result's `drawn` to their TextTables."""
    return declare("table", title, source, lambda r, ctx: write_tables(ctx.out, r.name, *r.drawn))
