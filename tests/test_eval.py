"""evaluation/: lm-evaluation-harness on the shipped tasks, through the server and through the Hugging Face export.

  - the shipped task files are what evaluation/tasks.py writes (its YAML), each example well formed, and lm-eval reads
    them offline;
  - `tools.py eval` on a tiny run (random weights, a 64-position context: prompts get truncated, documents span many
    windows) through the server (local-completions, local-chat-completions) and through the export (lm-eval's hf
    model) gives the same accuracies and generated answers, and per-example log-likelihoods that agree: 1e-4 for a
    multiple-choice answer; a document's (a sum over hundreds of tokens, each ~1e-7 apart in float32: the server's
    packed forward against transformers') to 1e-4 + 1e-7 relative. Negative control: the examples paired off by one
    fail the same comparison.
"""
from __future__ import annotations

import json

import pytest
import torch

import checkpoint
import tools
from arguments import parse_args
from evaluation import evaluate, tasks
from harness import SNIPPET
from interop import tokenizer_files

LIMIT = 2


def test_the_shipped_task_files_are_the_builders():
    for name in tasks.TASKS:
        assert (tasks.HERE / "tasks" / f"{name}.yaml").read_text() == tasks.YAML[name]
        rows = [json.loads(line) for line in (tasks.HERE / "tasks" / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == tasks.SIZES[name]
    mc = [json.loads(line) for line in (tasks.HERE / "tasks" / "stdlib_next_line.jsonl").read_text().splitlines()]
    assert all(len(r["choices"]) == 4 and 0 <= r["label"] < 4 and len(set(r["choices"])) == 4 for r in mc)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    tokenizer_files.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], str(root / "tokenizer.json"), 384)
    torch.manual_seed(0)
    args = parse_args(["--tokenizer-file", str(root / "tokenizer.json"), "--vocab-size", "384", "--num-layers", "2",
                       "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                       "--max-position-embeddings", "64", "--init-method-std", "0.3",
                       "--data-cache-dir", str(root / "cache")])
    model, tok, settings = checkpoint.model_from_flags(args)
    return checkpoint.save_weights(model, tok, root / "run", settings)


def flat(values):
    return [v for x in values for v in (x if isinstance(x, list) else [x])]


def assert_agree(served, exported):
    """Multiple choice to 1e-4, a document's log-likelihood to 1e-4 + 1e-7 relative, the answers exactly."""
    for task in tasks.TASKS:
        a, b = served["per_example"][task], exported["per_example"][task]
        assert len(a) == len(b) == LIMIT, task
        if task == "brackets":
            assert a == b
        else:
            assert flat(a) == pytest.approx(flat(b), rel=1e-7 if task == "stdlib_heldout" else 0, abs=1e-4), task


def test_server_and_export_agree_through_lm_eval(run, tmp_path):
    tools.main(["export", "--load", str(run), "--hf-out", str(tmp_path / "hf")])
    assert evaluate.main(["--load", str(run), "--limit", str(LIMIT), "--output", str(tmp_path / "s.json")]) == 0
    assert evaluate.main(["--load", str(run), "--hf", str(tmp_path / "hf"), "--limit", str(LIMIT),
                          "--output", str(tmp_path / "h.json")]) == 0
    served, exported = (json.loads((tmp_path / f).read_text()) for f in ("s.json", "h.json"))
    assert served["models"]["brackets"] == "local-chat-completions (chat template)"
    assert_agree(served, exported)
    for task in tasks.TASKS:  # the aggregates follow: the same accuracy, exact match
        for k, v in served["results"][task].items():
            if k.split(",")[0] in ("acc", "acc_norm", "exact_match"):
                assert v == exported["results"][task][k], (task, k)
    shifted = {**exported, "per_example": {t: v[1:] + v[:1] for t, v in exported["per_example"].items()}}
    with pytest.raises(AssertionError):  # each example against another's
        assert_agree(served, shifted)
