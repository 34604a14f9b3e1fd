"""The repository's shape as DESIGN.md §1 states it: imports flow one way, the infrastructure never names a model,
args are read-only after check_args, and the repo cites only itself.

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

# Bottom first. The infrastructure reaches the model files only through importlib (contract.model_file), at run time.
LAYERS = ["parallel", "lora", "metrics", "data", "config", "contract", "arguments", "checkpoint", "rope", "convert",
          "transformer", "deepseek", "gpt", "bert", "t5", "mamba", "llava", "retrieval", "retro", "posttrain", "tools",
          "train"]


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


# ---------------------------------------------------------------------------------------------- no model names
# The infrastructure asks a model file (contract.py) and never names one: no import of a model file, no model's name
# in a string it uses (docstrings and comments may name examples) or in an identifier (a `_`-separated word of it).
INFRASTRUCTURE = ["parallel", "lora", "metrics", "data", "config", "contract", "arguments", "checkpoint", "retrieval",
                  "posttrain", "tools", "train"]


def model_names_in(source: str, models) -> list[str]:
    """Where a source names one of `models`: 'line N: what' for each import, string or identifier that does."""
    tree, found = ast.parse(source), []
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    word = re.compile(r"\b(" + "|".join(models) + r")\b", re.I)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"line {node.lineno}: import {n}" for n in names if n.split(".")[0] in models]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if word.search(node.value):
                found.append(f"line {node.lineno}: string {node.value[:60]!r}")
        else:
            ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
                node.arg if isinstance(node, (ast.arg, ast.keyword)) and node.arg else \
                node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None
            if ident and set(ident.lower().split("_")) & set(models):
                found.append(f"line {node.lineno}: identifier {ident}")
    return found


def test_the_infrastructure_never_names_a_model():
    import contract
    models = contract.model_files()
    assert {"gpt", "bert", "t5", "retro", "mamba", "llava"} <= set(models)
    bad = {m: model_names_in((ROOT / f"{m}.py").read_text(), models) for m in INFRASTRUCTURE}
    assert not {m: v for m, v in bad.items() if v}


def test_a_named_model_is_caught():
    """Negative control: an import, a string and an identifier that name a model are each found; a docstring is not."""
    src = ('def f(args):\n    """BERT, as an example."""\n    import bert\n'
           '    if args.model == "mamba":\n        return args.retro_chunk_length\n')
    assert model_names_in(src, ["bert", "mamba", "retro"]) == [
        "line 3: import bert", "line 4: string 'mamba'", "line 5: identifier retro_chunk_length"]


# ---------------------------------------------------------------------------------------------- args are read-only
def assignments_to_args(source: str, allowed=("check_args",)) -> list[str]:
    """'line N: args.X = ...' (or setattr(args, ...)) outside the functions in `allowed`."""
    tree, found = ast.parse(source), []
    skip = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in allowed for n in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        found += [f"line {node.lineno}: args.{t.attr} =" for t in targets
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "args"]
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args and \
                isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
            found.append(f"line {node.lineno}: setattr(args, ...)")
    return found


def test_nothing_assigns_to_args_after_check_args():
    """Statically: no module writes args.X (check_args fills the derived flags on its own copy); at run time: the
    Args check_args returns refuse any assignment (every test that trains goes through them)."""
    import arguments
    bad = {p.name: assignments_to_args(p.read_text()) for p in sorted(ROOT.glob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}
    args = arguments.check_args(arguments.parse_args(["--vocab-size", "512"]), 1)
    with pytest.raises(AttributeError, match=r"read-only after check_args \(args.vocab_size = 1000\)"):
        args.vocab_size = 1000
    with pytest.raises(AttributeError, match="read-only"):
        del args.lr
    assert args.global_batch_size == 16 and args.data_parallel_size == 1  # derived: micro x DP


def test_an_assignment_to_args_is_caught():
    """Negative control for the static check: a write, an augmented write and a setattr are each found, except
    inside check_args."""
    src = ("def check_args(args):\n    args.x = 1\n"
           "def setup(args):\n    args.vocab_size = 5\n    args.lr += 1\n    setattr(args, 'y', 2)\n")
    assert assignments_to_args(src) == ["line 4: args.vocab_size =", "line 5: args.lr =", "line 6: setattr(args, ...)"]
