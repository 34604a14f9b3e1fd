"""evaluation/: lm-evaluation-harness on the shipped tasks, through the server and through the Hugging Face export.

  - the shipped task files are what evaluation/tasks.py writes (its YAML), each example well formed, and lm-eval reads
    them offline;
  - `tools.py eval` on a tiny run (random weights, a 64-position context: prompts get truncated, documents span many
    windows) through the server (local-completions, local-chat-completions) and through the export (lm-eval's hf
    model) gives the same accuracies and generated answers, and per-example log-likelihoods that agree: 1e-4 for a
    multiple-choice answer; a document's (a sum over hundreds of tokens, each ~1e-7 apart in float32: the server's
    packed forward against transformers') to 1e-4 + 1e-7 relative. Negative control: the examples paired off by one
    fail the same comparison.
  - `tools.py eval --harness evalscope` (EvalScope's `evalscope eval` from .venv-evalscope, which `make test` builds)
    on a tiny run of a 1,024-position context (EvalScope does not truncate; the choices alone exceed 64 positions):
    each of EvalScope's answers is the server's greedy answer to the same messages asked directly, its targets are
    the shipped answers, and its accuracy and example count are the mean and count of its per-example scores.
    Negative controls: the answers or the targets paired off by one fail.
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


def tiny_run(root, context: int):
    tokenizer_files.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], str(root / "tokenizer.json"), 384)
    torch.manual_seed(0)
    args = parse_args(["--tokenizer-file", str(root / "tokenizer.json"), "--vocab-size", "384", "--num-layers", "2",
                       "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                       "--max-position-embeddings", str(context), "--init-method-std", "0.3",
                       "--data-cache-dir", str(root / "cache")])
    model, tok, settings = checkpoint.model_from_flags(args)
    return checkpoint.save_weights(model, tok, root / "run", settings)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("eval"), 64)


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


def assert_evalscope_agrees(out, answers, targets):
    """EvalScope's answer to each example is `answers`' (the server's, asked directly), its target `targets`'; its
    accuracy (score) and count are its per-example scores' mean and count."""
    for task in ("stdlib_next_line", "brackets"):
        examples = out["examples"][task]
        assert [e["answer"] for e in examples] == answers[task], f"{task}: EvalScope's answers are not the server's"
        assert [e["target"] for e in examples] == targets[task], f"{task}: EvalScope's targets are not the tasks'"
        assert out["results"][task]["n"] == len(examples) == len(out["per_example"][task]) == LIMIT
        score = next(v for k, v in out["results"][task].items() if k not in ("n", "exact_match"))
        assert score == pytest.approx(sum(e["score"] for e in examples) / LIMIT), task


def test_evalscope_through_the_server(tmp_path_factory, tmp_path):
    run = tiny_run(tmp_path_factory.mktemp("evalscope"), 1024)
    assert evaluate.main(["--load", str(run), "--harness", "evalscope", "--limit", str(LIMIT),
                          "--output", str(tmp_path / "e.json")]) == 0
    out = json.loads((tmp_path / "e.json").read_text())
    assert set(out["results"]) == {"stdlib_next_line", "brackets"} and "stdlib_heldout" in out["skipped"]
    shipped = {t: tasks.evalscope_records(t, LIMIT) for t in ("stdlib_next_line", "brackets")}
    targets = {"stdlib_next_line": [[r["answer"]] for r in shipped["stdlib_next_line"]],
               "brackets": [[r["response"]] for r in shipped["brackets"]]}
    assert_evalscope_agrees(out, out["server_answers"], targets)
    assert out["results"]["brackets"]["exact_match"] == sum(
        "".join(e["answer"].split()) == r["response"] for e, r in zip(out["examples"]["brackets"], shipped["brackets"])) / LIMIT
    rolled = {t: v[1:] + v[:1] for t, v in out["server_answers"].items()}
    assert rolled != out["server_answers"] and all(v[0] != v[1] for v in targets.values())  # (the controls can fail)
    with pytest.raises(AssertionError, match="EvalScope's answers are not the server's"):
        assert_evalscope_agrees(out, rolled, targets)
    with pytest.raises(AssertionError, match="EvalScope's targets are not the tasks'"):
        assert_evalscope_agrees(out, out["server_answers"], {t: v[1:] + v[:1] for t, v in targets.items()})
