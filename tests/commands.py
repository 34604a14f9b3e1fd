"""The shell commands the repository documents, found where a reader finds them: README.md, DESIGN.md,
bench/README.md (```bash blocks and inline `code` spans), the Makefile's comments, examples/*.yaml's comments, and
the docstrings of every module (bench/ included). tests/test_commands.py runs them; this module only finds them.

A command is a line that starts with a program a reader runs (PROGRAMS); a trailing `\\` continues it on the next
line; it ends at a `#` comment, or at two spaces followed by `(` (a docstring's "(~1 min ...)" note). `time ` in front
is dropped.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ("make", "python", ".venv/bin/python", "torchrun", ".venv/bin/torchrun", "tensorboard",
            ".venv/bin/tensorboard", "bash", "d=$(mktemp")
MARKDOWN = ["README.md", "DESIGN.md", "bench/README.md"]


@dataclass(frozen=True)
class Command:
    text: str  # the command as printed (continuations joined, comment cut)
    where: str  # FILE:LINE


def _command(line: str) -> str | None:
    """The command a line starts with, or None."""
    s = line.strip()
    s = s[5:].lstrip() if s.startswith("time ") else s
    if not any(s == p or s.startswith(p + " ") for p in PROGRAMS):
        return None
    s = re.split(r"\s+#|\s{2,}\(", s)[0]  # a comment, or a docstring's note "  (~1 min ...)"
    return s.strip() or None


def _lines(lines, where, first=1):
    """Commands in consecutive lines (joining `\\` continuations)."""
    out, i = [], 0
    while i < len(lines):
        start, text = i, lines[i].rstrip()
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + lines[i].strip()
        if (c := _command(text)) is not None:
            out.append(Command(c, f"{where}:{first + start}"))
        i += 1
    return out


def from_markdown(path: Path) -> list[Command]:
    lines, out, i = path.read_text().splitlines(), [], 0
    name = str(path.relative_to(ROOT))
    while i < len(lines):
        if lines[i].strip().startswith("```"):
            fence, j = lines[i].strip(), i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            if fence in ("```bash", "```sh", "```shell"):
                out += _lines(lines[i + 1:j], name, i + 2)
            i = j + 1
            continue
        for span in re.findall(r"`([^`\n]+)`", lines[i]):  # a span of two words or more: `python` names a program
            if " " in span.strip() and (c := _command(span)) is not None:
                out.append(Command(c, f"{name}:{i + 1}"))
        i += 1
    return out


def from_comments(path: Path) -> list[Command]:
    """Commands in `#` comment lines (the Makefile, examples/*.yaml)."""
    lines = [line.lstrip()[1:] if line.lstrip().startswith("#") else "" for line in path.read_text().splitlines()]
    return _lines(lines, str(path.relative_to(ROOT)))


def from_docstrings(path: Path) -> list[Command]:
    """Commands in a Python file's docstrings (module, classes, functions), with their line numbers."""
    tree, out = ast.parse(path.read_text()), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) and \
                isinstance(node.body[0].value.value, str):
            doc = node.body[0].value
            lines = [re.sub(r"^\s*(Run|Run its tests|Usage|Example):\s*", "", line) for line in doc.value.splitlines()]
            out += _lines(lines, str(path.relative_to(ROOT)), doc.lineno)
    return out


def documented() -> list[Command]:
    """Every documented command, in the order a reader meets them: the README first, then the other documents,
    the Makefile, the examples, the modules' docstrings."""
    out = [c for name in MARKDOWN for c in from_markdown(ROOT / name)]
    out += from_comments(ROOT / "Makefile")
    out += [c for p in sorted(ROOT.glob("examples/*.yaml")) for c in from_comments(p)]
    packages = [p for p in sorted(ROOT.glob("*/*.py")) if p.parent.name not in ("tests", "bench")]
    out += [c for p in [*packages, *sorted(ROOT.glob("*.py")), *sorted(ROOT.glob("bench/*.py"))] for c in from_docstrings(p)]
    return out


if __name__ == "__main__":
    for c in documented():
        print(f"{c.where:28} {c.text}")
