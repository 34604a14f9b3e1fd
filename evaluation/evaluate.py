"""evaluation/evaluate.py — a saved run evaluated by lm-evaluation-harness (or EvalScope) on the shipped tasks
(evaluation/tasks/), through our OpenAI-compatible server or through lm-eval's `hf` model on a Hugging Face export.

Server: `tools.py serve` started on a free port (under torchrun at --nproc > 1, as `make serve` starts it), lm-eval's
`local-completions` for the log-likelihood tasks (echo + logprobs: the server scores the prompt; context tokens are
counted with the run's own tokenizer through vLLM's /tokenize) and `local-chat-completions` for the generation task
(a user turn of the run's chat template, as posttraining/rl.py poses it; --no-chat: plain completions), then SIGTERM.
--hf DIR: the same tasks through `hf` (transformers) on `tools.py export --hf-out DIR`'s folder. lm-eval's API model
keeps max_length - 1 prompt tokens and scores all but the first; hf feeds max_length tokens and scores one more: so
the server gets max_length = the context, hf the context - 2, and both score each token after the same window (their
per-example log-likelihoods agree). Offline: nothing is fetched (HF_*_OFFLINE=1; the tasks' JSON lines are local).
Results (lm-eval's, and each example's log-likelihoods or answer) go to RUN.eval.json beside the run (--hf:
RUN.hf-eval.json); one table is printed. Mirrors lm-eval's `lm_eval --model local-completions` (lm_eval/__main__.py).
--harness evalscope: `evalscope eval` (.venv-evalscope's, a subprocess) against the same server, on the tasks in its
custom formats (tasks.evalscope_records; a question cut from the left to fit the context, as lm-eval cuts), greedy,
through the chat template; its files in RUN.evalscope/, ours (each example's prompt, answer, the server's own answer
to it asked directly) in RUN.evalscope.json. Not the perplexity task: EvalScope has no log-likelihood mode.

    make eval RUN=runs/gpt                                           # the three tasks through the server
    .venv/bin/python tools.py eval --load runs/gpt --hf runs/gpt-hf --limit 10   # through the export, 10 each
    make eval RUN=runs/gpt ARGS="--harness evalscope"                # EvalScope's evalscope eval, same server
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from evaluation import tasks as shipped
from interop import tokenizer_files
from posttraining import recipes

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
GENERATION = ("brackets",)
EVALSCOPE = ROOT / ".venv-evalscope" / "bin" / "evalscope"  # (make .venv-evalscope/.stamp builds it)
NO_LOGLIKELIHOOD = "EvalScope scores generated answers only: it has no log-likelihood (perplexity) mode over an API"
MCQ_TEMPLATE = "{question}\n\n{choices}\nANSWER:"  # EvalScope's own (an instruction first) is ~60 tokens longer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Evaluate a saved run with lm-evaluation-harness on the shipped tasks "
                                "(evaluation/evaluate.py).")
    p.add_argument("--load", required=True, help="the run (a directory train.py saved into)")
    p.add_argument("--harness", choices=("lm-eval", "evalscope"), default="lm-eval",
                   help="evalscope: EvalScope's `evalscope eval` (from .venv-evalscope) against the server")
    p.add_argument("--hf", help="evaluate this Hugging Face folder (tools.py export --hf-out) with lm-eval's hf model "
                   "instead of the server")
    p.add_argument("--tasks", default=",".join(shipped.TASKS), help="comma-separated shipped tasks")
    p.add_argument("--limit", type=int, help="the first N examples of each task")
    p.add_argument("--nproc", type=int, default=1, help="server ranks (torchrun; --tensor-model-parallel-size = this)")
    p.add_argument("--no-chat", action="store_true", help="generation through /v1/completions, not the chat template")
    p.add_argument("--output", help="the results JSON (default: RUN.eval.json beside the run, RUN.hf-eval.json)")
    a = p.parse_args(argv)
    unknown = sorted(set(a.tasks.split(",")) - set(shipped.TASKS))
    if unknown or (a.limit is not None and a.limit < 1) or a.nproc < 1:
        p.error(f"--tasks: one of {', '.join(shipped.TASKS)} (not {unknown}); --limit and --nproc >= 1")
    if a.harness == "evalscope" and (a.hf or a.no_chat or not set(a.tasks.split(",")) & set(shipped.EVALSCOPE)):
        p.error(f"--harness evalscope: through the server's chat API (not --hf, --no-chat), on "
                f"{' or '.join(shipped.EVALSCOPE)} ({NO_LOGLIKELIHOOD})")
    return a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


@contextlib.contextmanager
def serving(load: str, nproc: int):
    """`tools.py serve` on a free port (torchrun at nproc > 1); yields (base URL, model name, context); SIGTERM after."""
    port, name = free_port(), "run"
    argv = ["tools.py", "serve", "--load", str(load), "--port", str(port), "--served-model-name", name,
            "--tensor-model-parallel-size", str(nproc)]
    if nproc > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *argv]
    env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if nproc > 1 else {})}
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    try:
        while True:
            with contextlib.suppress(OSError):
                if get(base + "/health") == {"status": "ok"}:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up:\n{proc.communicate(timeout=10)[0][-3000:]}")
            time.sleep(0.1)
        yield base, name, get(base + "/v1/models")["data"][0]["max_model_len"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def lm_eval(model: str, model_args: dict, task_names: list[str], limit, chat: bool) -> dict:
    """lm_eval.simple_evaluate on shipped tasks, run in the repository's root (the tasks' data_files are relative)."""
    os.environ.update(OFFLINE)
    import functools

    import lm_eval as harness
    import torch.utils.collect_env as collect_env
    from lm_eval.tasks import TaskManager
    # Each simple_evaluate records torch's collect_env report (it runs `pip list`: ~1.5 s); a process's environment does
    # not change, so it is collected once (an evaluation calls lm-eval once per kind of task)
    if not hasattr(collect_env.get_pretty_env_info, "cache_info"):
        collect_env.get_pretty_env_info = functools.cache(collect_env.get_pretty_env_info)
    with contextlib.chdir(ROOT):
        return harness.simple_evaluate(
            model=model, model_args=model_args, tasks=task_names, limit=limit, log_samples=True,
            apply_chat_template=chat, task_manager=TaskManager(include_path=str(shipped.HERE / "tasks"), include_defaults=False),
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def per_example(samples: list[dict]) -> list:
    """Each example's responses in document order: [log-likelihood per choice] (multiple choice), the document's
    log-likelihood (perplexity), or the generated text."""
    out = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        r = [x[0] if isinstance(x, (list, tuple)) else x for x in s["filtered_resps"]]
        out.append(r[0] if len(r) == 1 else r)
    return out


def evaluate(a) -> dict:
    names = a.tasks.split(",")
    likelihood, generation = [t for t in names if t not in GENERATION], [t for t in names if t in GENERATION]
    runs = []  # (lm-eval model, its args, tasks, chat template?)
    if a.hf:
        import transformers
        context = transformers.AutoConfig.from_pretrained(a.hf).max_position_embeddings
        args = {"pretrained": str(Path(a.hf).resolve()), "dtype": "float32", "device": "cpu", "batch_size": 1,
                "max_length": context - 2}
        runs = [("hf", args, likelihood, False), ("hf", args, generation, not a.no_chat)]
        return collect(runs, a.limit, "hf")
    with serving(a.load, a.nproc) as (base, name, context):
        common = {"model": name, "max_length": context, "num_concurrent": 4, "max_retries": 1, "timeout": 600}
        runs = [("local-completions", {**common, "base_url": base + "/v1/completions", "tokenizer_backend": "remote"},
                 likelihood, False)]
        if a.no_chat:
            runs.append(("local-completions", {**common, "base_url": base + "/v1/completions",
                                               "tokenizer_backend": "remote"}, generation, False))
        else:
            runs.append(("local-chat-completions", {**common, "base_url": base + "/v1/chat/completions",
                                                    "tokenizer_backend": "none"}, generation, True))
        return collect(runs, a.limit, "server")


def collect(runs, limit, through: str) -> dict:
    out = {"through": through, "results": {}, "per_example": {}, "models": {}}
    for model, args, task_names, chat in runs:
        if not task_names:
            continue
        r = lm_eval(model, args, task_names, limit, chat)
        for t in task_names:
            out["results"][t] = {k: v for k, v in r["results"][t].items() if k != "alias"}
            out["per_example"][t] = per_example(r["samples"][t])
            out["models"][t] = f"{model}{' (chat template)' if chat else ''}"
    return out


def post(url: str, body: dict):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.load(r)


def fit(record: dict, tok, room: int) -> dict:
    """A multiple-choice record whose chat prompt (MCQ_TEMPLATE, the choices as EvalScope lays them out, the run's
    chat template: the server's ids) is at most `room` tokens: its question's first lines dropped, then its first
    characters (lm-eval keeps a prompt's end alike)."""
    def tokens(question):
        text = MCQ_TEMPLATE.format(question=question, choices="\n".join(f"{k}) {record[k]}" for k in "ABCD"))
        return len(recipes.chat_prompt_ids([{"role": "user", "content": text}], tok))
    question = record["question"]
    while question and tokens(question) > room:
        question = question.split("\n", 1)[1] if "\n" in question else question[1:]
    if tokens(question) > room:
        raise RuntimeError(f"stdlib_next_line example {record['id']}: its choices alone exceed the run's context")
    return {**record, "question": question}


def evalscope(a) -> dict:
    """`evalscope eval` on the shipped tasks against the served run; EvalScope's results and each example's."""
    names = [t for t in a.tasks.split(",") if t in shipped.EVALSCOPE]
    gen = yaml.safe_load(shipped.YAML["brackets"])["generation_kwargs"]  # the generation task's settings, for both
    config = {"max_tokens": gen["max_gen_toks"], "temperature": 0.0, "stop_seqs": gen["until"]}
    work = Path(str(a.load).rstrip("/") + ".evalscope")
    shutil.rmtree(work, ignore_errors=True)
    (work / "data").mkdir(parents=True)
    out = {"through": "server", "harness": "evalscope", "results": {}, "per_example": {}, "models": {},
           "examples": {}, "server_answers": {}, "skipped": {t: NO_LOGLIKELIHOOD for t in a.tasks.split(",")
                                                             if t not in shipped.EVALSCOPE}}
    with serving(a.load, a.nproc) as (base, name, context):
        tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(Path(a.load) / "tokenizer.json"))
        dataset_args = {}
        for t in names:
            bench, split = shipped.EVALSCOPE[t]
            records = [fit(r, tok, context - config["max_tokens"]) if bench == "general_mcq" else r
                       for r in shipped.evalscope_records(t, a.limit)]
            (work / "data" / f"{t}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            dataset_args[bench] = {"local_path": str(work / "data"), "subset_list": [t]} | (
                {"prompt_template": MCQ_TEMPLATE} if bench == "general_mcq" else
                {"prompt_template": "{question}", "metric_list": ["Rouge"]})  # (its BLEU needs NLTK data: a download)
        argv = [str(EVALSCOPE), "eval", "--model", name, "--api-url", base + "/v1", "--api-key", "EMPTY",
                "--eval-type", "openai_api", "--datasets", *dataset_args, "--dataset-args", json.dumps(dataset_args),
                "--generation-config", json.dumps(config), "--work-dir", str(work), "--no-timestamp", "--seed", "0"]
        r = subprocess.run(argv, env={**os.environ, **OFFLINE}, capture_output=True, text=True)
        (work / "evalscope.log").write_text(r.stdout + r.stderr)
        if r.returncode:
            raise RuntimeError(f"evalscope eval failed ({work / 'evalscope.log'}):\n{(r.stdout + r.stderr)[-3000:]}")
        for t in names:
            bench = shipped.EVALSCOPE[t][0]
            report = json.loads((work / "reports" / name / f"{bench}.json").read_text())
            primary = next(m for m in report["metrics"] if m["identity"] == report["primary_metric_identity"])
            subset = next(x for c in primary["categories"] for x in c["subsets"] if x["name"] == t)
            reviews = [json.loads(line) for line in (work / "reviews" / name / f"{bench}_{t}.jsonl").read_text()
                       .splitlines()]
            examples = []
            for x in sorted(reviews, key=lambda x: x["index"]):
                score = x["sample_score"]["score"]
                examples.append({"messages": [{"role": m["role"], "content": m["content"]} for m in x["messages"]
                                              if m["role"] != "assistant"], "target": x["target"],
                                 "answer": score["prediction"], "extracted": score["extracted_prediction"],
                                 "score": score["value"][score["main_score_name"]]})
            metric = reviews[0]["sample_score"]["score"]["main_score_name"]  # (the primary metric's own name)
            out["results"][t] = {metric: subset["score"], "n": subset["num"]}
            if t in GENERATION:  # lm-eval's metric for it, on EvalScope's answers (whitespace ignored, as its YAML)
                out["results"][t]["exact_match"] = sum("".join(e["answer"].split()) == "".join(
                    "".join(e["target"]).split()) for e in examples) / len(examples)
            out["examples"][t], out["per_example"][t] = examples, [e["answer"] for e in examples]
            out["models"][t] = f"evalscope {bench} (chat template)"
            out["server_answers"][t] = [post(base + "/v1/chat/completions", {
                "model": name, "messages": e["messages"], "max_tokens": config["max_tokens"], "temperature": 0.0,
                "stop": config["stop_seqs"]})["choices"][0]["message"]["content"] for e in examples]
    return out


def table(out: dict) -> str:
    rows = [("task", "through", "metric", "value", "stderr", "n")]
    for t, metrics in out["results"].items():
        for k, v in metrics.items():
            if ("," not in k and out.get("harness") != "evalscope") or "_stderr" in k or k == "n" or \
                    not isinstance(v, (int, float)):
                continue
            err = metrics.get(k.replace(",", "_stderr,", 1)) if "," in k else None
            rows.append((t, out["models"][t], k.split(",")[0], f"{v:.4f}" if abs(v) < 1e4 else f"{v:.4g}",
                         f"{err:.4f}" if isinstance(err, (int, float)) else "", str(len(out["per_example"][t]))))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    return "\n".join([" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows] +
                     [f"{t}: skipped ({why})" for t, why in out.get("skipped", {}).items()] +
                     [f"{t}: {sum(x == y for x, y in zip(v, out['per_example'][t]))} of EvalScope's {len(v)} answers "
                      "are the server's own to the same messages, asked directly" for t, v in
                      out.get("server_answers", {}).items()])


def main(argv=None) -> int:
    a = parse_args(argv)
    if not (Path(a.load) / "tokenizer.json").exists() and not a.hf:
        print(f"tools.py eval: error: --load {a.load}: not a saved run (train.py --save DIR first)", file=sys.stderr)
        return 2
    if a.harness == "evalscope" and not EVALSCOPE.exists():
        print(f"tools.py eval: error: {EVALSCOPE} is missing (make .venv-evalscope/.stamp builds it)", file=sys.stderr)
        return 2
    out = evalscope(a) if a.harness == "evalscope" else evaluate(a)
    out["run"], out["limit"] = str(a.load), a.limit
    suffix = ".evalscope.json" if a.harness == "evalscope" else ".hf-eval.json" if a.hf else ".eval.json"
    path = Path(a.output or str(Path(a.load)).rstrip("/") + suffix)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(table(out))
    print(f"wrote {path}")
    return 0
