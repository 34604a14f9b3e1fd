"""Every shell command the repository documents runs as printed (tests/commands.py finds them: README.md, DESIGN.md,
bench/README.md, the Makefile's comments, examples/, every module's docstring), at a tiny size; and every entry
point answers --help. A changed default or a renamed flag breaks a documented command here first.

What "at a tiny size" changes, and nothing else:
  - train.py (directly, through torchrun, through `make train` / `make bench`'s ARGS, or a --config file): TINY's
    flags appended, which argparse lets win over earlier ones: 2 iterations, a 2-layer model of hidden size 64 (each
    model's own small shape), short sequences, one evaluation batch (LLaVA: a global batch of 2, not its default
    run's 32; online RL: 2 prompts of 2 completions a step, not its defaults' 16 of 8). A pretraining run whose
    command names no --data-path reads SMALL_CORPUS (40 small Python files) instead of the default corpus (the
    stdlib: ~25 s to tokenize); for a post-training task whose command names no --data-path, "the stdlib" is
    EXAMPLE_FILES (a few stdlib modules, tests/test_posttrain_data.py's): its example records
    (recipes.example_records) are their functions', not the whole stdlib's (~20 s to parse, then ~10 s per task to
    tokenize them all), and so is its tokenizer's corpus when it starts from no checkpoint.
  - tools.py sample: at most 4 new tokens; tools.py rl --eval: 8 held-out prompts, 1 sample each; tools.py
    import-megatron: the model's tiny shape appended (its flags are train.py's model flags); tools.py import-hf: a
    tiny Qwen2 folder where the command names one that does not exist; data.py preprocess: SMALL_CORPUS when the
    command names no --input.
  - tools.py eval (`make eval`) and eval-tasks: their arguments parsed (tests/test_eval.py runs them; COMMANDS=all
    runs them, eval on 2 examples a task).
  - tools.py serve (`make serve`): started on a free port, asked one completion over HTTP, stopped by SIGTERM; on several
    ranks its arguments are parsed only (COMMANDS=all runs it; tests/test_server.py serves at TP 2).
  - A bench script (bench/, `make bench`, `make soak`): its own size flags (BENCH), e.g. one round, one row. Each
    starts processes of its own (ranks, or one per row), tens of seconds even at that size, so `make test` parses
    its documented arguments with the script's own parser, and COMMANDS=all runs it too
    (`COMMANDS=all .venv/bin/python -m pytest -q tests/test_commands.py`, ~8 min on 2 cores).
What runs where: in a scratch copy of the repository (its tracked files, this checkout's .venv linked, one data cache
for the session), so no command touches your runs/; the commands run in document order, so a run one command makes
is there for the next (a command that starts a run in a directory it does not resume starts from an empty one).
Each distinct train.py run once: a run whose signature (its flags and values, numbers and paths by kind, less what
the tiny size overrides; its world size and model) equals an earlier run's, and whose directory no other command
names, has its flags parsed and checked (arguments.check_args) instead of training again; so has a run COVERED names
(a test trains its code path at its layout, e.g. the 4-rank cp 2 x tp 2 run). COMMANDS=all trains them all.
`python` and `torchrun` are .venv's. To stay within make test's budget, train.py, tools.py and data.py commands (and
`python -c` code) run in this process (train.main, ...), torchrun's on warm ranks (harness.launch: torchrun's
environment), and a make target runs the recipe `make -n` prints (so the Makefile's expansion is what runs); `make
lint` runs make itself. Not run, with the reason: `make test` and .ci/run (this suite itself), `make
setup` (builds a virtualenv: `make -n` only), pytest commands (the files and -k keywords they name are checked: the
suite runs them), a multi-node torchrun (its train.py flags are checked for its world size), bench/gpu_default_runs.sh
(a GPU machine's script: `bash -n`), tensorboard (a server: --version).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from commands import ROOT, Command, documented
from test_posttrain_data import FILES as EXAMPLE_FILES

import arguments
import config
import data
import harness
import tools
import train
from harness import SNIPPET
from interop import tokenizer_files
from posttraining import rl

FULL = os.environ.get("COMMANDS") == "all"  # also run the bench scripts (see the module docstring)
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
COMMON = ["--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1",
          "--micro-batch-size", "2", "--exit-duration-in-mins", "5"]
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "256"]
TINY = {  # each model's tiny shape (a run on a checkpoint takes the checkpoint's, so every run of a model shares it)
    "gpt": SHAPE + ["--seq-length", "32"],
    "bert": SHAPE + ["--seq-length", "32"],
    "t5": SHAPE + ["--seq-length", "32"],
    "retro": SHAPE[2:] + ["--num-layers", "6", "--seq-length", "32", "--retro-chunk-length", "16"],
    "mamba": SHAPE + ["--hybrid-layer-pattern", "M*", "--mamba-num-groups", "2", "--mamba-head-dim", "16",
                      "--mamba-state-dim", "16", "--mamba-chunk-size", "16", "--seq-length", "32"],
    "llava": ["--vision-num-layers", "1", "--seq-length", "80",  # (SMALL_CORPUS's BPE spells captions longer)
              "--global-batch-size", "2"],  # (its default run's is 32: 16 micro-batches of COMMON's 2 per iteration)
}
TASK_SEQ = ["--seq-length", "256"]  # a post-training task's records, in SMALL_CORPUS's BPE
BENCH = {  # size flags appended to each bench script
    "bench_activations.py": ["--tp", "1"], "bench_comm.py": ["--layouts", "tp2"], "bench_cp.py": ["--cp", "2",
    "--repeats", "1"], "bench_decode.py": ["--tokens", "16", "--budget", "1"], "bench_fp8.py": ["--sizes", "small",
    "--rounds", "1", "--steps", "1", "--warmup", "0"], "bench_hf.py": ["--rounds", "1", "--warmup", "0", "--only",
    "llama"], "bench_mamba_scan.py": ["--lengths", "64", "--repeat", "1", "--heads", "2", "--head-dim", "8",
    "--state", "8", "--chunk", "16"], "bench_memory.py": ["--dp", "1"], "bench_pipeline.py": ["--micro-batches", "4",
    "--t", "0.001"], "bench_moe_balance.py": ["--iters", "2", "--log-interval", "1",
    "--data-path", "small_corpus"], "soak.py": ["--minutes", "0.3"],
    "bench_quant.py": ["--concurrency", "1", "--new-tokens", "2", "--eval-batches", "1"],
    "bench_evalscope.py": ["--parallel", "1", "--number", "2", "--max-tokens", "4"],
    "bench_serve.py": ["--concurrency", "1", "2", "--new-tokens", "2", "--prompt-len", "2", "6", "--model-args",
                       "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --vocab-size 128"],
    "bench_gemm.py": ["--repeats", "1", "--warmup", "0", "--peak-size", "64", "--model-args", "--num-layers 2 "
                      "--hidden-size 64 --num-attention-heads 4 --micro-batch-size 2 --seq-length 32 --data-path "
                      "small_corpus"],
    "bench_scaling.py": ["--iters", "2", "--warmup", "1", "--global-batch", "2", "--layouts", "single", "dp2",
                         "--train-args", "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                         "--data-path small_corpus"],
    "bench_costs.py": ["--iters", "2", "--warmup", "1", "--global-batch", "4", "--layouts", "pp2", "--train-args",
                       "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --data-path small_corpus"]}
# The files the documents name as the reader's own, made in the scratch copy: a few records of each kind
RECORDS = {"sft": {"prompt": "Add 2 and 3.", "response": "5"}, "dpo": {"prompt": "Add 2 and 3.", "chosen": "5",
           "rejected": "6"}, "kto": {"prompt": "Add 2 and 3.", "completion": "5", "label": True}}
FIXTURES = {"my.jsonl": "text", "corpus.jsonl": "text", "chat.jsonl": "sft", "answers.jsonl": "sft",
            "pairs.jsonl": "dpo", "prefs.jsonl": "dpo", "kto.jsonl": "kto"}


class Skipped(Exception):
    """A command this test does not run, with the reason (see the module docstring)."""


def bench_module(name: str):
    """bench/NAME.py imported (not run: its main is behind __name__ == "__main__")."""
    if f"bench_{name}" not in sys.modules:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[f"bench_{name}"] = module
    return sys.modules[f"bench_{name}"]


# ---------------------------------------------------------------------------------------------- the scratch copy
@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    work = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, work / name)  # (mtimes kept: make sees the virtualenv up to date)
    for venv in (".venv", ".venv-evalscope"):  # (.venv-evalscope: EvalScope's, tools.py eval --harness evalscope)
        (work / venv).symlink_to(ROOT / venv)
    (work / "data_cache").mkdir()
    corpus = work / "small_corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    for name, kind in FIXTURES.items():
        rows = [{"text": SNIPPET.format(i=i)} for i in range(40)] if kind == "text" else [
            {**RECORDS[kind], "prompt": f"Add {i} and 3.", **({"label": i % 2 == 0} if kind == "kto" else {})}
            for i in range(12)]
        (work / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "my_docs").mkdir()
    for i in range(40):
        (work / "my_docs" / f"doc{i}.txt").write_text(SNIPPET.format(i=i))
    tok = tokenizer_files.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], None, vocab_size=512)
    tok.save(str(work / "tokenizer.json"))
    return work


@contextlib.contextmanager
def inside(work):
    home = os.getcwd()
    os.chdir(work)
    try:
        yield
    finally:
        os.chdir(home)


# ---------------------------------------------------------------------------------------------- running one command
def tiny_train(argv: list[str], work: Path) -> list[str]:
    """train.py's argv with the tiny size appended (see the module docstring)."""
    args = arguments.parse_args(argv, known_only=True)
    model = args.model
    for flag in ("--load", "--pretrained-checkpoint"):  # a run on a checkpoint: the checkpoint's model
        if flag in argv and (Path(work) / argv[argv.index(flag) + 1] / "latest_checkpointed_iteration.txt").exists():
            saved = Path(work) / argv[argv.index(flag) + 1]
            it = int((saved / "latest_checkpointed_iteration.txt").read_text())
            model = json.loads((saved / f"iter_{it:07d}" / "meta.json").read_text())["args"]["model"]
            break
    extra = COMMON + TINY[model]
    if isinstance(args.moe_layer_freq, list):  # a per-layer MoE pattern fixes the depth
        extra += ["--num-layers", str(len(args.moe_layer_freq))]
    if args.task != "pretrain":
        extra += TASK_SEQ
    elif args.data_path is None:
        extra += ["--data-path", str(work / "small_corpus")]
    if args.task in rl.TASKS:  # online RL: 2 prompts a step, 2 completions each (its defaults: 16 x 8)
        extra += ["--global-batch-size", "2", "--grpo-group-size", "2"]
    if args.save and args.load != args.save and not args.finetune:  # a run that starts afresh in --save
        shutil.rmtree(work / args.save, ignore_errors=True)
    return argv + extra


PATHS = {"--save", "--load", "--pretrained-checkpoint", "--retro-bert-load", "--tokenizer-file", "--data-path",
         "--data-cache-dir"}
RAN: list[tuple[frozenset, str]] = []  # the train.py runs made so far: (their signature, where documented)
NOW: list = [None]  # the command being run


def _number(word: str) -> bool:
    return re.fullmatch(r"[-+]?[\d.]+(e[-+]?\d+)?|\[[\d, ]*\]", word, re.I) is not None


def signature(argv: list[str], tiny: list[str], work: Path, nproc: int) -> frozenset:
    """What decides the code a tiny train.py run takes: each documented flag with its value, less what the tiny size
    appends (its values win), a number's value (any number takes the same path), a path's (its kind: a directory, a
    file's suffix, a run that exists or not); plus the world size and the model the run builds."""
    appended = {w for w in tiny[len(argv):] if w.startswith("--")}
    out, i = {("nproc", nproc), ("model", next((tiny[j + 1] for j in range(len(tiny) - 1) if tiny[j] == "--model"),
                                               "gpt"))}, 0
    while i < len(argv):
        flag, values = argv[i], []
        while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            i += 1
            values.append(argv[i])
        i += 1
        if not flag.startswith("--") or flag in appended:
            continue
        if flag in PATHS:
            paths = [work / v for v in values]
            values = ["dir" if q.is_dir() else q.suffix or ("prefix" if q.with_suffix(".bin").exists() else "none")
                      for q in paths]
        out.add((flag, tuple("#" if _number(v) else v for v in values)))
    return frozenset(out)


def needed(save: str | None) -> bool:
    """Another documented command names this run's directory (it loads, samples or exports it)."""
    return save is not None and any(re.search(rf"(?<![\w/.-]){re.escape(save)}(?![\w/.-])", c.text)
                                    for c in COMMANDS if c is not NOW[0])


# A documented run whose code path a test trains already, at its layout (the key: a part of exactly one documented
# command, test_covered_runs_name_one_command_each): its flags parsed and checked for its world, not trained again
COVERED = {
    "RUN=runs/cp2tp2 ": "tests/test_context_parallel.py's torchrun run at cp 2 x tp 2 + SP on 4 ranks",
    "RUN=runs/dsv3_aux ": "runs/dsv3's (the same model, expert bias for aux loss) and tests/test_moe_routing.py's "
                          "DeepSeek router with aux loss (sigmoid, shared expert, [0,1,1,1])",
}


def run_train(argv, work, nproc=1):
    tiny = tiny_train(argv, work)
    sig = signature(argv, tiny, work, nproc)
    twin = next((where for done, where in RAN if sig == done), None)
    covered = next((why for key, why in COVERED.items() if NOW[0] is not None and key in NOW[0].text + " "), None)
    if (twin or covered) and not FULL and not needed(arguments.parse_args(tiny, known_only=True).save):
        with inside(work):  # the same code path as a run made already: the flags parsed and checked only
            arguments.check_args(arguments.parse_args(tiny), nproc)
        raise Skipped((f"the same code path as {twin}'s run" if twin else f"trained by {covered}")
                      + ": its flags parsed and checked only")
    RAN.append((sig, NOW[0].where if NOW[0] else "?"))
    argv, examples = tiny, harness.Returns(EXAMPLE_FILES)  # "the stdlib" of a task's examples (the module docstring)
    if nproc > 1:
        return harness.launch(nproc, argv, cwd=work, patch={"data.default_corpus_files": examples})
    with inside(work), pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "default_corpus_files", examples)
        code = train.main(argv)
    assert code == 0, f"train.py exited {code}"


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny_hf_folder(path: Path, work: Path):
    """A Hugging Face folder as `save_pretrained` writes one (a Qwen2 at the tiny runs' shape, SHAPE; a byte-level
    BPE of SMALL_CORPUS with ChatML's tokens and template): what `tools.py import-hf --hf DIR` documents."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    texts = [p.read_text() for p in sorted((work / "small_corpus").iterdir())]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|im_end|>"))).save_pretrained(path)
    fast.save_pretrained(path)


def run_python(words: list[str], work: Path):
    """`python SCRIPT ARGS` (or -m, -c)."""
    if words[0] == "-m" and words[1] == "pytest":
        raise Skipped("pytest: collected, not run (the suite runs it)")  # (collected in test_pytest_commands)
    if words[0] == "-m" and words[1] in ("torch.distributed.run", "torchrun"):
        return run_torchrun(words[2:], work)
    if words[0] == "-c":  # its code, run here (the modules it imports are imported already)
        with inside(work):
            exec(compile(words[1], "<python -c>", "exec"), {"__name__": "__main__"})
        return
    script, argv = words[0], words[1:]
    if script == "train.py":
        return run_train(argv, work)
    if script == "tools.py" and argv[:1] == ["serve"]:
        return run_server(argv[1:], work)
    if script == "tools.py" and argv[:1] in (["eval"], ["eval-tasks"]):  # lm-eval (a server, minutes) or the tasks'
        from evaluation import evaluate, tasks  # builder (the stdlib read, ~30 s): tests/test_eval.py runs both
        if argv[:1] == ["eval"]:
            evaluate.parse_args(argv[1:])
        if not FULL:
            raise Skipped(f"tools.py {argv[0]}: its arguments parsed (tests/test_eval.py runs it)")
        with inside(work):
            assert (evaluate.main(argv[1:] + ["--limit", "2"]) if argv[:1] == ["eval"] else tasks.main(argv[1:])) == 0
        return
    if script == "tools.py" and argv[:1] == ["rl"]:  # the shipped task's SFT records, or a run's held-out reward
        with inside(work):  # (8 prompts, 1 sample)
            assert tools.main(argv + (["--prompts", "8", "--samples", "1"] if "--eval" in argv else [])) == 0
        return
    if script == "tools.py":
        if argv[:1] == ["sample"]:
            argv = argv + ["--max-new-tokens", "4"]
        for flag in ("--save", "--hf-out"):  # merge, export and the Megatron commands write into an empty directory
            if argv[:1] in (["merge"], ["export"], ["export-megatron"], ["import-megatron"]) and flag in argv:
                shutil.rmtree(work / argv[argv.index(flag) + 1], ignore_errors=True)
        if argv[:1] == ["import-hf"] and not (work / argv[argv.index("--hf") + 1]).exists():
            tiny_hf_folder(work / argv[argv.index("--hf") + 1], work)  # the documented folder, at the tiny shape
        if argv[:1] == ["import-hf"]:
            shutil.rmtree(work / argv[argv.index("--save") + 1], ignore_errors=True)
        if argv[:1] == ["import-megatron"]:  # its model flags: the tiny runs' shape (as train.py's are)
            argv = argv + TINY[argv[argv.index("--model") + 1] if "--model" in argv else "gpt"]
        with inside(work):
            tools.main(argv)
        return
    if script == "data.py":
        if argv[:1] == ["preprocess"] and "--input" not in argv:
            argv = argv + ["--input", str(work / "small_corpus")]
        with inside(work):
            assert data.main(argv) == 0
        return
    if script.startswith("bench/"):
        argv = argv + BENCH[Path(script).name]
        bench_module(Path(script).stem).parse_args(argv)  # its own parser takes the documented arguments
        if not FULL:
            raise Skipped("a bench script: its arguments parsed (COMMANDS=all runs it)")
        r = subprocess.run([PY, script, *argv], cwd=work, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        return
    raise AssertionError(f"no runner for python {script}")


def run_server(argv: list[str], work: Path, nproc: int = 1):
    """tools.py serve: started in `work` on a free port, one completion asked over HTTP, stopped by SIGTERM (exit 0). At
    TP > 1 only its arguments are parsed unless COMMANDS=all (tests/test_server.py serves at TP 2 itself)."""
    import signal
    import time
    import urllib.request

    from serving import server
    a = server.parse_args(argv)
    if nproc > 1 and not FULL:
        raise Skipped(f"tools.py serve on {nproc} ranks: its arguments parsed (tests/test_server.py serves at TP 2)")
    port = str(harness.free_port())
    argv = [w for i, w in enumerate(argv) if w != "--port" and argv[i - 1:i] != ["--port"]] + ["--port", port]
    launch = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [PY]
    proc = subprocess.Popen([*launch, str(ROOT / "tools.py"), "serve", *argv], cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        body = json.dumps({"model": a.served_model_name or Path(a.load).name, "prompt": "def", "max_tokens": 2})
        deadline = time.monotonic() + 120
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as r:
                    answer = json.load(r)  # (sampled: the tiny run may end its text early, at its end-of-document)
                n = answer["usage"]["completion_tokens"]
                assert n <= 2 and answer["choices"][0]["finish_reason"] == ("length" if n == 2 else "stop"), answer
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        assert "stopped: every request answered" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def run_torchrun(words: list[str], work: Path):
    p = argparse.ArgumentParser()
    p.add_argument("--nproc_per_node", "--nproc-per-node", type=int, default=1)
    p.add_argument("--nnodes", default="1")
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--rdzv-backend", "--rdzv_backend")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint")
    p.add_argument("--master-port", "--master_port")
    p.add_argument("script")
    launcher, argv = p.parse_known_args(words)
    if launcher.script == "tools.py" and argv[:1] == ["serve"]:
        return run_server(argv[1:], work, launcher.nproc_per_node)
    assert launcher.script == "train.py", launcher.script
    if launcher.nnodes != "1":  # a multi-node command: its flags, checked for the world it names
        world = int(launcher.nnodes) * launcher.nproc_per_node
        arguments.check_args(arguments.parse_args(argv), world)
        raise Skipped(f"needs {launcher.nnodes} nodes: its flags were checked for a world of {world}")
    return run_train(argv, work, launcher.nproc_per_node)


def run_make(words: list[str], work: Path):
    target = next((w for w in words if "=" not in w), "train")
    assigns = dict(w.split("=", 1) for w in words if "=" in w)
    if target == "test":
        raise Skipped("make test: this suite itself")
    if target in ("lint", "clean"):
        r = subprocess.run(["make", target, *[f"{k}={v}" for k, v in assigns.items()]], cwd=work,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        return
    if target == "setup":
        r = subprocess.run(["make", "-n", "setup"], cwd=work, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        raise Skipped("make setup: builds a virtualenv (make -n checked)")
    if target == "soak":
        assigns["ARGS"] = (assigns.get("ARGS", "") + " " + " ".join(BENCH["soak.py"])).strip()
    r = subprocess.run(["make", "-n", target, *[f"{k}={v}" for k, v in assigns.items()]], cwd=work,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for line in r.stdout.replace("\\\n", " ").splitlines():  # the recipe's python (torchrun) lines, joined
        words = shlex.split(line)
        while words and re.fullmatch(r"\w+=\S*", words[0]):
            words = words[1:]  # OMP_NUM_THREADS=1
        if words[:1] != [".venv/bin/python"] or "--check-only" in words:  # (make train's check before torchrun:
            continue  # the torchrun line runs the same flags; test_failures.py runs the check through make)
        if words[1:2] == ["train.py"] and target == "bench":
            words = words[:2] + ["--train-iters", "2", "--log-interval", "1"] + words[2:]
        run_python(words[1:], work)


def run(command: Command, work: Path):
    """Run one documented command (its parts, if joined by &&) at a tiny size; Skipped says why one is not run."""
    NOW[0] = command
    if command.text.startswith("d=$(mktemp"):
        raise Skipped("a fresh clone of this checkout: " + ("CI's own command (this suite)" if ".ci/run" in
                      command.text else "then make train, which runs here as its own command"))
    for part in command.text.split(" && "):
        words = shlex.split(part)
        env = {}
        while words and re.fullmatch(r"\w+=\S*", words[0]):
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        prog = words[0]
        if prog in ("python", ".venv/bin/python"):
            run_python(words[1:], work)
        elif prog in ("torchrun", ".venv/bin/torchrun"):
            run_torchrun(words[1:], work)
        elif prog == "make":
            run_make(words[1:], work)
        elif prog in ("tensorboard", ".venv/bin/tensorboard"):
            r = subprocess.run([str(ROOT / ".venv" / "bin" / "tensorboard"), "--version"], capture_output=True)
            assert r.returncode == 0
            raise Skipped("tensorboard: a server (--version checked)")
        elif prog == "bash" and words[1:2] == ["bench/gpu_default_runs.sh"]:
            assert subprocess.run(["bash", "-n", words[1]], cwd=work).returncode == 0
            raise Skipped("a GPU machine's script (bash -n checked)")
        elif prog.startswith("d=$(mktemp") or words[:2] == ["bash", ".ci/run"] or ".ci/run" in part:
            raise Skipped(".ci/run: this suite itself, in a clean clone")
        else:
            raise AssertionError(f"no runner for {prog!r}")


# ---------------------------------------------------------------------------------------------- the tests
DOCUMENTED = documented()
COMMANDS = list({c.text: c for c in DOCUMENTED[::-1]}.values())  # each command once, where it is first met
COMMANDS.sort(key=DOCUMENTED.index)  # in the order a reader meets them


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command_runs(command, scratch, capsys):
    try:
        run(command, scratch)
    except Skipped as e:
        pytest.skip(str(e))
    except (SystemExit, Exception) as e:  # noqa: BLE001 — report the command and where it is documented
        if isinstance(e, SystemExit) and e.code in (0, None):  # (--help exits 0)
            return
        out = capsys.readouterr()
        raise AssertionError(f"{command.where}: `{command.text}` fails: {type(e).__name__}: {e}\n"
                             f"{(out.out + out.err)[-2000:]}") from e


def test_pytest_commands_name_tests_that_exist():
    """The documented pytest commands (the suite runs their tests itself): every file (or the tests/ folder) they
    name exists, and a -k keyword names a test function in those files."""
    pytests = [shlex.split(c.text) for c in COMMANDS if " -m pytest " in c.text]
    assert pytests
    for words in pytests:
        paths = [ROOT / w for w in words if w.startswith("tests/")]
        assert paths and all(f.is_file() or f.is_dir() for f in paths), words
        files = [g for f in paths for g in (sorted(f.glob("test_*.py")) if f.is_dir() else [f])]
        if "-k" in words:
            names = re.findall(r"^def (test_\w+)", "".join(f.read_text() for f in files), re.M)
            assert any(words[words.index("-k") + 1] in n for n in names), words


ENTRY_POINTS = [["train.py"], ["train.py", "--model", "mamba"], ["tools.py"], *[["tools.py", c] for c in
                ("sample", "merge", "export", "score", "import-megatron", "export-megatron")], ["data.py"],
                ["data.py", "preprocess"]]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=" ".join)
def test_help_of_every_entry_point(entry, capsys):
    main = {"train.py": lambda a: train.main(a), "tools.py": tools.main, "data.py": data.main}[entry[0]]
    with pytest.raises(SystemExit, match="^0$"):
        main([*entry[1:], "--help"])
    assert capsys.readouterr().out.startswith("usage: ")


@pytest.mark.parametrize("script", sorted(p.stem for p in ROOT.glob("bench/*.py")))
def test_help_of_every_bench_script(script, capsys):
    with pytest.raises(SystemExit, match="^0$"):
        bench_module(script).parse_args(["--help"])
    assert capsys.readouterr().out.startswith(f"usage: bench/{script}.py")


def test_a_broken_documented_flag_is_caught(scratch):
    """Negative control: a documented command with a flag renamed (as a changed parser would break it) fails here."""
    command = next(c for c in COMMANDS if c.text.startswith("python train.py") and "--save" in c.text)
    broken = Command(command.text.replace("--save", "--save-dir"), command.where)
    with pytest.raises(SystemExit, match="^2$"):
        run(broken, scratch)


def test_covered_runs_name_one_command_each():
    """Each COVERED key is part of exactly one documented command (a stale key, or one that would match two, fails)."""
    for key in COVERED:
        assert sum(key in c.text + " " for c in COMMANDS) == 1, key


def test_a_twin_run_is_parsed_not_run_and_a_broken_twin_still_fails(scratch):
    """The signature tells runs apart by what changes their code path (a layout flag, a data format, a flag's
    choice), not by numbers or names; a twin of a run made already is parsed only, and a renamed flag in it fails."""
    sig = lambda *argv, nproc=1: signature(list(argv), tiny_train(list(argv), scratch), scratch, nproc)
    assert sig("--save", "runs/a", "--lr", "1e-3") == sig("--save", "runs/b", "--lr", "3e-4")
    assert sig("--save", "runs/a", "--train-iters", "500") == sig("--save", "runs/b")  # (the tiny size's value wins)
    assert sig("--save", "runs/a", nproc=2) != sig("--save", "runs/a", "--tensor-model-parallel-size", "2", nproc=2)
    assert sig("--data-path", "DESIGN.md") != sig("--data-path", "tests")
    assert sig("--optimizer", "adam") != sig("--optimizer", "muon")
    RAN.append((sig("--save", "runs/twin-a", "--optimizer", "adam", "--lr", "1e-3"), "here"))
    NOW[0] = Command("python train.py --save runs/twin-b --optimizer adam --lr 3e-4", "here")
    with pytest.raises(Skipped, match="the same code path as here's run"):
        run_train(["--save", "runs/twin-b", "--optimizer", "adam", "--lr", "3e-4"], scratch)
    with pytest.raises(config.ConfigError, match="--lr=-1.0 must be >= 0"):  # a twin, with a rate check_args refuses
        run_train(["--save", "runs/twin-b", "--optimizer", "adam", "--lr", "-1"], scratch)
    RAN.pop()
    assert not (scratch / "runs" / "twin-b").exists()  # nothing trained
