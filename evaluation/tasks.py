"""evaluation/tasks.py — the lm-evaluation-harness tasks the repository ships (evaluation/tasks/), and their builder.

Three tasks a small model trained here can do, built from data on this machine (no download), each a YAML file lm-eval
reads (`--include_path evaluation/tasks`) and a JSON-lines file of its examples, small enough for a test to run:
  stdlib_next_line  multiple choice: which of four lines follows a snippet of Python (accuracy; chance 0.25)
  stdlib_heldout    perplexity: whole held-out documents scored token by token (word/byte perplexity, bits per byte)
  brackets          generation, exact match: close the brackets of a line of Python (the RL task's held-out prompts)
The snippets and documents come from the default run's validation documents (the stdlib's files that --split 95,5 and
--seed 1234 hold out: data.split_documents), so the default run never trained on them; the bracket prompts are
posttraining/rl.py's held-out ones. The shipped files were built from Python 3.11's stdlib: another Python's stdlib
builds other examples. Mirrors the task folders of lm-evaluation-harness (lm_eval/tasks/*/ : YAML + a dataset).
EvalScope reads the same examples converted to its custom-dataset formats (evalscope_records): general_mcq (question,
A-D, the answer's letter) and general_qa (query, response); it has no perplexity task.

    .venv/bin/python tools.py eval-tasks --out evaluation/tasks      # rebuilds the shipped files (~30 s)
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import data
from posttraining import rl

HERE = Path(__file__).resolve().parent
TASKS = ("stdlib_next_line", "stdlib_heldout", "brackets")
SIZES = {"stdlib_next_line": 40, "stdlib_heldout": 20, "brackets": 40}

# lm-eval task configs; data_files are relative to the repository's root (evaluation/evaluate.py runs lm-eval there)
YAML = {
    "stdlib_next_line": """\
task: stdlib_next_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: evaluation/tasks/stdlib_next_line.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: context
target_delimiter: "\\n"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
""",
    "stdlib_heldout": """\
task: stdlib_heldout
dataset_path: json
dataset_kwargs:
  data_files:
    test: evaluation/tasks/stdlib_heldout.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
    "brackets": """\
task: brackets
dataset_path: json
dataset_kwargs:
  data_files:
    test: evaluation/tasks/brackets.jsonl
test_split: test
output_type: generate_until
doc_to_text: prompt
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    regexes_to_ignore: ["\\\\s"]
metadata:
  version: 1.0
""",
}


# EvalScope's custom datasets (evaluation/evaluate.py --harness evalscope): task -> (its benchmark, the split it reads)
EVALSCOPE = {"stdlib_next_line": ("general_mcq", "val"), "brackets": ("general_qa", "test")}


def evalscope_records(task: str, limit: int | None = None) -> list[dict]:
    """The first `limit` examples of a shipped task in EvalScope's format for it (EVALSCOPE)."""
    rows = [json.loads(line) for line in (HERE / "tasks" / f"{task}.jsonl").read_text().splitlines()][:limit]
    if task == "stdlib_next_line":
        return [{"id": i, "question": r["context"], **dict(zip("ABCD", r["choices"])), "answer": "ABCD"[r["label"]]}
                for i, r in enumerate(rows)]
    return [{"id": i, "query": r["prompt"], "response": r["answer"]} for i, r in enumerate(rows)]


def held_out_documents() -> list[str]:
    """The default run's validation documents (train.py's defaults: --split 95,5, --seed 1234), in order."""
    docs = data.load_documents(None)
    _, valid, _ = data.split_documents(len(docs), 0.05, 1234)
    return [docs[i] for i in valid]


def code_line(s: str) -> bool:
    t = s.strip()
    return 12 <= len(t) <= 60 and not t.startswith(("#", '"', "'")) and len(s) <= 80


def next_line_examples(docs: list[str], n: int, rng: random.Random) -> list[dict]:
    """n snippets (up to 6 lines, <= 300 characters) and the line that follows each, among three lines drawn from
    the other held-out documents (of code, 12-60 characters, as the answer); the answer's place drawn at random."""
    lines = [[s for s in d.splitlines() if s.strip()] for d in docs]
    out, seen = [], set()
    while len(out) < n:
        k = rng.randrange(len(docs))
        i = rng.randrange(6, max(7, len(lines[k])))
        if i >= len(lines[k]) or not code_line(lines[k][i]) or lines[k][i] in seen:
            continue
        context = "\n".join(lines[k][i - 6:i])[-300:]
        others = [s for j, ls in enumerate(lines) if j != k for s in ls if code_line(s) and s.strip() !=
                  lines[k][i].strip()]
        choices = rng.sample(others, 3)
        label = rng.randrange(4)
        choices.insert(label, lines[k][i])
        seen.add(lines[k][i])
        out.append({"context": context, "choices": choices, "label": label})
    return out


def build(out: Path) -> dict[str, int]:
    """Write each task's YAML and JSON lines under `out`; {task: examples}."""
    rng, docs = random.Random(0), held_out_documents()
    examples = {
        "stdlib_next_line": next_line_examples(docs, SIZES["stdlib_next_line"], rng),
        # each document's first 2,000 characters, cut at a line's end: a few context windows each
        "stdlib_heldout": [{"text": d[:2000].rsplit("\n", 1)[0] + "\n" if len(d) > 2000 else d}
                           for d in rng.sample(docs, SIZES["stdlib_heldout"])],
        "brackets": rl.bracket_records(held_out=True)[:SIZES["brackets"]],
    }
    out.mkdir(parents=True, exist_ok=True)
    for task in TASKS:
        (out / f"{task}.yaml").write_text(YAML[task])
        (out / f"{task}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples[task]))
    return {t: len(e) for t, e in examples.items()}


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="Build the lm-eval tasks the repository ships (evaluation/tasks.py).")
    p.add_argument("--out", default=str(HERE / "tasks"), help="the folder to write the YAML and JSON lines to")
    a = p.parse_args(argv)
    for task, n in build(Path(a.out)).items():
        print(f"{a.out}/{task}.yaml: {n} examples")
    return 0
