"""The repository's shape as DESIGN.md §1 states it: imports flow one way, and the repo cites only itself.

Imports: every top-level module may import only modules below it in LAYERS (module-level and function-level imports
alike), so there is no cycle and a reader can take the files bottom-up. Citations: code, tests and docs cite the
repo's own DESIGN.md, papers and Megatron's files — no file outside the repo, no tracker issue number.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom first. train.py reaches the model files only through importlib (--model NAME), at run time.
LAYERS = ["parallel", "lora", "data", "arguments", "checkpoint", "rope", "convert", "transformer", "config", "deepseek",
          "gpt", "bert", "t5", "mamba", "llava", "retrieval", "retro", "metrics", "posttrain", "train"]


def project_imports(source: str, modules) -> set[str]:
    """The project modules a file imports anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found & set(modules)


def upward_imports(sources: dict[str, str]) -> list[str]:
    """'a imports b' for every import of a module at or above a's own layer."""
    rank = {m: i for i, m in enumerate(LAYERS)}
    return sorted(f"{a} imports {b}" for a, src in sources.items() for b in project_imports(src, rank)
                  if b != a and rank[b] >= rank[a])


def test_imports_flow_one_way():
    files = {p.stem for p in ROOT.glob("*.py")}
    assert files == set(LAYERS), f"top-level modules {sorted(files ^ set(LAYERS))} are missing from LAYERS or the repo"
    sources = {m: (ROOT / f"{m}.py").read_text() for m in LAYERS}
    assert upward_imports(sources) == []


def test_upward_import_is_caught():
    """Negative control: a function-level import of a model file in convert.py is an upward import."""
    sources = {"convert": "def f():\n    import gpt\n", "gpt": "import convert\n"}
    assert upward_imports(sources) == ["convert imports gpt"]


# A sibling folder of the checkout, a lower-case design doc, a tracker number ("[Ii]ssue" "#N"): spelled in
# pieces here so that this file itself does not read as such a citation to a plain grep.
CITATION = re.compile(r"\.\./" + "shared/|" + "shared/" + "design|" + "design" + r"\.md|\b[Ii]ssue" + r" #\d+")


def outside_citations(text: str) -> list[str]:
    """Lines that cite something outside the repo. Megatron's own tracker ("Megatron-LM issue #1754", "its issue
    #1754") is a public source and allowed; DESIGN.md (upper case) is the repo's own document."""
    return [line.strip() for line in text.splitlines() if CITATION.search(line)
            and not re.search(r"(Megatron(-LM)?|its) issue #\d+", line)]


@pytest.mark.parametrize("pattern", ["*.py", "tests/*.py", "bench/*", "*.md", "Makefile"])
def test_the_repo_cites_only_itself(pattern):
    files = [p for p in ROOT.glob(pattern) if p.is_file()]
    assert files
    bad = {str(p.relative_to(ROOT)): outside_citations(p.read_text()) for p in files}
    assert not {k: v for k, v in bad.items() if v}


def test_outside_citation_is_caught():
    lower, tracker = "design" + ".md §2", "the issue" + " #3 promises"
    assert outside_citations(f"see {lower}\nsee DESIGN.md §2\nMegatron-LM issue #1754\n{tracker}") == [f"see {lower}", tracker]
