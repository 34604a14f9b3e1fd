"""train.py fails loudly, not silently: what each failure looks like.

  - a non-finite loss or gradient norm stops the run before the step, naming the iteration (exit 2, one line);
    the last good checkpoint stays `latest`; under torchrun every rank stops and none hangs;
  - fp16 stuck at --min-loss-scale stops; --skip-nonfinite-steps skips and counts instead; the check can be turned off;
  - every numeric flag's range, and `tools.py sample`'s arguments, are checked with one line before any work
    (under torchrun printed once, without argparse's usage); a model's own checks come before the data is built;
    `make train` and `make serve` at NPROC > 1 check in one process before torchrun (the error is the first line);
  - an empty validation split says so; every model's default flags take TP=2.
The NaN runs use --lr 1e6: the first step blows the weights up, a later iteration's gradient norm is NaN.
"""
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
import torch

import arguments
import config as contract
import harness
import tools
import train
from harness import ROOT, SNIPPET, metrics, tiny

NAN = ["--lr", "1e6", "--min-lr", "0", "--lr-warmup-iters", "1", "--save-interval", "1"]


def fails(argv, capsys, main=train.main, prog="train.py") -> str:
    """Run main(argv); it must exit with 2 and one stderr line `train.py: error: ...` (`prog`'s). Returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1] if err.strip() else ""
    assert e.value.code == 2 and "Traceback" not in err and "usage:" not in err, err
    assert line.startswith(f"{prog}: error: ") and err.count(f"{prog}: error") == 1, err
    return line


def torchrun(nproc, argv):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-port", str(port),
           str(ROOT / "train.py"), *argv]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120)


def check_stopped_before_saving(run, line):
    """The error names iteration n; n - 1 is the latest checkpoint, nothing of n was saved or logged."""
    n = int(re.search(r"iteration (\d+):", line).group(1))
    assert n >= 2
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == str(n - 1)
    assert not any(p.name.startswith(f"iter_{n:07d}") for p in run.iterdir())
    got, _ = metrics(run)
    assert sorted(got) == list(range(1, n)) and all(got[i]["loss"] == got[i]["loss"] for i in got)  # no NaN logged
    return n


# ------------------------------------------------------------------------------------------ non-finite values
def test_nan_stops_before_the_step_and_keeps_the_last_good_checkpoint(corpus, cache, tmp_path, capsys):
    run = tmp_path / "nan"
    line = fails(tiny(corpus, cache, run, *NAN), capsys)
    assert "is nan" in line and "first non-finite gradient on rank 0: " in line, line
    check_stopped_before_saving(run, line)


def test_nonfinite_gradient_with_a_finite_loss_stops_at_its_iteration(corpus, cache, tmp_path, capsys, monkeypatch):
    """The check looks at the gradient norm, not only the loss: at iteration K = 3 a hook on one weight's gradient
    returns inf (the loss of that iteration stays finite). The run must stop at K, naming that iteration, the
    gradient norm and the weight, before the step: the latest checkpoint is K - 1's, with finite weights, and nothing
    of K is saved. A check of the loss alone applies the step (AdamW turns the inf gradient into NaN weights), saves
    them at K and only stops at K + 1, on the NaN loss."""
    import checkpoint

    K, run, iteration, hooked = 3, tmp_path / "inf_grad", [0], []
    real = train.make_optimizer

    def make_optimizer(chunks, grid, args):  # train.py's optimizer; its zero_grad (once per iteration) counts them
        opt = real(chunks, grid, args)
        zero_grad = opt.zero_grad

        def counting_zero_grad(*a, **kw):
            iteration[0] += 1
            return zero_grad(*a, **kw)
        opt.zero_grad = counting_zero_grad
        name, p = next((n, p) for n, p in chunks[0].named_parameters() if p.requires_grad)
        p.register_hook(lambda g: torch.full_like(g, float("inf")) if iteration[0] == K else None)
        hooked.append(name)
        return opt
    monkeypatch.setattr(train, "make_optimizer", make_optimizer)
    line = fails(tiny(corpus, cache, run, "--save-interval", "1", iters=5), capsys)
    assert line.startswith(f"train.py: error: iteration {K}: the gradient norm is inf"), f"not stopped at {K}: {line}"
    assert f"first non-finite gradient on rank 0: {hooked[0]}" in line, line
    assert check_stopped_before_saving(run, line) == K
    saved = checkpoint.load_model(run)
    assert saved.ckpt.path.name == f"iter_{K - 1:07d}"
    assert all(bool(torch.isfinite(p).all()) for p in saved.model.parameters()), f"{saved.ckpt.path}: non-finite"


def test_nan_under_torchrun_stops_every_rank_and_says_it_once(corpus, cache, tmp_path):
    """TP=2 under the real torchrun (its report: exit code 2); DP=2 with the distributed optimizer on warm ranks
    (harness.launch), where no rank is stopped by torchrun: each must stop by itself, with 2, none left waiting."""
    run = tmp_path / "run"
    r = torchrun(2, tiny(corpus, cache, run, *NAN, "--tensor-model-parallel-size", "2"))
    lines = [ln for ln in r.stderr.splitlines() if "train.py: error" in ln]
    assert r.returncode != 0 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("train.py: error: iteration ") and "exitcode  : 2" in r.stderr, lines
    check_stopped_before_saving(run, lines[0])
    run = tmp_path / "distopt"
    ranks = harness.launch(2, tiny(corpus, cache, run, *NAN, "--use-distributed-optimizer"), timeout=120, fails=True)
    lines = [ln for _, text in ranks.values() for ln in text.splitlines() if "train.py: error" in ln]
    assert [code for code, _ in ranks.values()] == [2, 2] and len(lines) == 1, ranks
    assert lines[0].startswith("train.py: error: iteration "), lines
    check_stopped_before_saving(run, lines[0])


def test_skip_nonfinite_steps_skips_and_counts_and_the_check_can_be_turned_off(corpus, cache, tmp_path):
    train.main(tiny(corpus, cache, tmp_path / "skip", *NAN, "--skip-nonfinite-steps", iters=5))
    got, _ = metrics(tmp_path / "skip")
    skipped = [got[i]["skipped"] for i in sorted(got)]
    assert sorted(got) == [1, 2, 3, 4, 5] and skipped[0] == 0 and sum(skipped) >= 1, skipped
    assert (tmp_path / "skip" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert all(got[i]["loss"] < 7 for i in got if got[i]["skipped"] == 0)  # a skipped step's loss is not averaged in
    train.main(tiny(corpus, cache, tmp_path / "off", *NAN, "--no-check-for-nan-in-loss-and-grad", iters=5))
    got, _ = metrics(tmp_path / "off")  # the old behaviour, on request: NaN steps applied, nothing skipped
    assert sorted(got) == [1, 2, 3, 4, 5] and all(got[i]["skipped"] == 0 for i in got)
    assert any(got[i]["grad_norm"] != got[i]["grad_norm"] for i in got)


def test_fp16_stuck_at_the_minimum_scale_stops(corpus, cache, tmp_path, capsys):
    """2^40 overflows at every step: 2^40 -> 2^39 -> 2^38 (the minimum), then 2 skipped steps there (the window)."""
    run = tmp_path / "fp16"
    line = fails(tiny(corpus, cache, run, "--fp16", "--initial-loss-scale", str(2.0**40), "--min-loss-scale",
                      str(2.0**38), "--loss-scale-window", "2", "--save-interval", "1", iters=8), capsys)
    assert line.startswith("train.py: error: iteration 4: fp16: 2 steps in a row overflowed at --min-loss-scale="), line
    assert not (run / "latest_checkpointed_iteration.txt").exists() or check_stopped_before_saving(run, line)
    stopped = tmp_path / "stopped"  # the count of stuck steps survives a resume: the same iteration stops
    fp16 = ["--fp16", "--initial-loss-scale", str(2.0**40), "--min-loss-scale", str(2.0**38), "--loss-scale-window", "2"]
    train.main(tiny(corpus, cache, stopped, *fp16, "--exit-interval", "3", iters=8))
    assert fails(tiny(corpus, cache, stopped, *fp16, "--load", str(stopped), iters=8), capsys).startswith(
        "train.py: error: iteration 4: fp16: 2 steps in a row overflowed"), "the stuck count was not restored"


# ------------------------------------------------------------------------------------------ bad flags, one line
@pytest.mark.parametrize("extra, expect", [
    (["--lr", "-0.001"], "--lr=-0.001 must be >= 0"),
    (["--lr", "nan"], "--lr=nan must be >= 0"),
    (["--lr", "inf"], "--lr=inf must be finite"),
    (["--min-lr", "-1"], "--min-lr=-1.0 must be >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay=-0.1 must be >= 0"),
    (["--adam-beta1", "1"], "--adam-beta1=1.0 must be in [0, 1)"),
    (["--adam-beta2", "-0.5"], "--adam-beta2=-0.5 must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps=0.0 must be > 0"),
    (["--clip-grad", "-1"], "--clip-grad=-1.0 must be >= 0"),
    (["--save-interval", "-1"], "--save-interval=-1 must be >= 0"),
    (["--eval-interval", "-1"], "--eval-interval=-1 must be >= 0"),
    (["--eval-iters", "-1"], "--eval-iters=-1 must be >= 0"),
    (["--log-interval", "0"], "--log-interval=0 must be >= 1"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters=-1 must be >= 0"),
    (["--initial-loss-scale", "0"], "--initial-loss-scale=0.0 must be > 0"),
    (["--min-loss-scale", "-1"], "--min-loss-scale=-1.0 must be > 0"),
    (["--loss-scale-window", "0"], "--loss-scale-window=0 must be >= 1"),
    (["--exit-interval", "0"], "--exit-interval=0 must be >= 1"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins=0.0 must be > 0"),
    (["--fp8-margin", "-1"], "--fp8-margin=-1 must be >= 0"),
    (["--fp8-amax-history-len", "0"], "--fp8-amax-history-len=0 must be >= 1"),
    (["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff=-1.0 must be >= 0"),
    (["--moe-z-loss-coeff", "-1"], "--moe-z-loss-coeff=-1.0 must be >= 0"),
    (["--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor=0.0 must be > 0"),
    (["--moe-router-topk", "0"], "--moe-router-topk=0 must be >= 1"),
    (["--skip-nonfinite-steps", "--no-check-for-nan-in-loss-and-grad"], "--skip-nonfinite-steps acts on what"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--train-iters", "x"], "argument --train-iters: invalid int value: 'x'"),
    (["--train-iter", "1"], "unrecognized arguments: --train-iter 1"),  # no abbreviations, as Megatron's parser
    (["--lr", "-1e-3"], "--lr=-0.001 must be >= 0"),  # a negative number is read as one, then range-checked
    (["--lr", "-inf"], "--lr=-inf must be >= 0"),
    (["--mamba-num-groups", "2"], "unrecognized arguments: --mamba-num-groups 2"),  # another model's flag
    (["--global-batch-size", "6", "--micro-batch-size", "4"],
     "--global-batch-size=6 is not divisible by --micro-batch-size x data-parallel size = 4 x 1 = 4"),
])
def test_bad_flag_range_gives_one_line_before_any_work(corpus, cache, tmp_path, capsys, monkeypatch, extra, expect):
    monkeypatch.setattr(train.data, "build_data", lambda *a, **k: pytest.fail("the data was built before the check"))
    line = fails(tiny(corpus, cache, tmp_path / "run", iters=1) + extra, capsys)
    assert expect in line, line


def test_model_checks_come_before_the_data(corpus, cache, tmp_path, capsys, monkeypatch):
    """Retro's database is built with the data: --num-layers 4 is refused before it."""
    monkeypatch.setattr(train.data, "build_data", lambda *a, **k: pytest.fail("the data was built before the check"))
    line = fails(tiny(corpus, cache, tmp_path / "run", "--model", "retro", "--num-layers", "4", iters=1), capsys)
    assert "num_layers=4: Retro's first chunked cross-attention layer is layer 6" in line, line


@pytest.mark.parametrize("extra, expect", [
    (["--prompt", ""], "--prompt is empty"),
    (["--top-k", "0"], "--top-k=0 must be >= 1"),
    (["--temperature", "-1"], "--temperature=-1.0 must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_sample_bad_arguments_give_one_line(tmp_path, capsys, extra, expect):
    line = fails(["sample", "--load", str(tmp_path / "none"), *extra], capsys, tools.main, "tools.py")
    assert expect in line, line


def test_bad_flag_under_torchrun_is_one_line_once(corpus, cache, tmp_path):
    """On warm ranks (harness.launch: torchrun's environment); exit code 2 as torchrun reports it: the NaN test."""
    ranks = harness.launch(2, tiny(corpus, cache, tmp_path / "run", "--lr", "-1"), timeout=120, fails=True)
    ours = [ln for _, text in ranks.values() for ln in text.splitlines() if "train.py" in ln and "error" in ln]
    assert [code for code, _ in ranks.values()] == [2, 2], ranks
    assert ours == ["train.py: error: --lr=-1.0 must be >= 0"], ranks
    assert not any("usage:" in text for _, text in ranks.values()), ranks


# ------------------------------------------------------------------------------------------ quiet surprises
def test_empty_validation_split_is_announced(cache, tmp_path, capsys):
    (tmp_path / "one.txt").write_text("".join(SNIPPET.format(i=i) for i in range(40)))  # one document
    train.main(tiny(tmp_path / "one.txt", cache, tmp_path / "run", iters=1))
    assert "WARNING: the validation set is empty" in capsys.readouterr().out


@pytest.mark.parametrize("model", contract.model_files())
def test_every_models_defaults_take_tp2(model):
    """`make train MODEL=X NPROC=2 TP=2`: the model's default Config takes TP=2 (Mamba: 8 groups, as Megatron)."""
    a = arguments.check_args(arguments.parse_args(["--model", model, "--tensor-model-parallel-size", "2"]), 2)
    arguments.model_config(contract.model_file(model), a, vocab_size=8192).check_layout(2, 1, 1)


# ------------------------------------------------------------------------------------------ files, runs and launches
@pytest.fixture(scope="module")
def run(corpus, cache, tmp_path_factory):
    """A tiny pretraining run (seq 32, so its context is 32 positions), checkpoints at iterations 2 and 4."""
    d = tmp_path_factory.mktemp("failures") / "run"
    train.main(tiny(corpus, cache, d, "--save-interval", "2", iters=4))
    return d


def test_a_truncated_safetensors_file_is_named_before_any_tensor_is_read(tmp_path):
    from safetensors.torch import save_file

    from interop import hf
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.ones(64, 64)}, str(tmp_path / "model.safetensors"))
    hf.read_folder(tmp_path)  # whole: reads
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    with pytest.raises(contract.ConfigError, match=r"model\.safetensors: not a readable safetensors file \(truncated: "
                       r"5,000 bytes, its header describes 16,\d+\)"):
        hf.read_folder(tmp_path)


def test_a_run_is_refused_where_it_is_the_wrong_kind_and_a_reward_model_says_its_accuracy(run, corpus, cache,
                                                                                         tmp_path, capsys):
    """score needs a reward model; the server and sample need a model that generates (load_model's reward_model).
    A post-training task from random weights says so at the start and in its final line, with its accuracy."""
    line = fails(["score", "--load", str(run), "--data-path", str(tmp_path / "x.jsonl")], capsys, tools.main, "tools.py")
    assert line == f"tools.py: error: --load {run} is a --task pretrain run, not a reward model (--task rm)"
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(f'{{"prompt": "{i} + 1", "chosen": "{i + 1}", "rejected": "0"}}\n' for i in range(16)))
    capsys.readouterr()
    train.main(tiny(corpus, cache, tmp_path / "rm", "--task", "rm", "--data-path", str(prefs), iters=3))
    out = capsys.readouterr().out
    assert "note: --task rm starts from random weights" in out.splitlines()[0], out
    assert re.search(r"iteration 3: validation loss [\d.]+, accuracy [\d.]+", out), out
    done = next(ln for ln in out.splitlines() if ln.startswith("done: "))
    assert "; validation accuracy " in done and done.endswith("note: --task rm trained from random weights"), done
    port = str(harness.free_port())
    line = fails(["serve", "--load", str(tmp_path / "rm"), "--port", port], capsys, tools.main, "tools.py")
    assert line.endswith("is a reward model (--task rm): it scores text (tools.py score), it does not generate or "
                         "export as a causal LM"), line
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(f'{{"prompt": "{i} + 1", "response": "{i + 1}"}}\n' for i in range(4)))
    assert len(tools.main(["score", "--load", str(tmp_path / "rm"), "--data-path", str(answers)])) == 4


def test_export_refuses_a_directory_that_is_not_empty(run, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    line = fails(["export", "--load", str(run), "--hf-out", str(tmp_path / "out")], capsys, tools.main, "tools.py")
    assert f"--hf-out {tmp_path / 'out'} is not an empty directory" in line and "--overwrite" in line, line
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]  # nothing written
    tools.main(["export", "--load", str(run), "--hf-out", str(tmp_path / "out"), "--overwrite"])
    said = capsys.readouterr().out
    assert f"exported {run} to {tmp_path / 'out'}" in said and "from_pretrained" in said, said  # what to run next
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine" and (tmp_path / "out" / "config.json").is_file()


def test_sample_stays_within_the_context(run, capsys):
    line = fails(["sample", "--load", str(run), "--max-new-tokens", "100000"], capsys, tools.main, "tools.py")
    assert "--max-new-tokens=100000 with a 2-token prompt: more than the model's context (--max-position-embeddings " \
           "32) leaves; at most 30" in line, line
    text = tools.main(["sample", "--load", str(run), "--temperature", "0"])  # the default: what the context leaves
    assert text.startswith("def ")


def test_the_command_line_says_what_it_wrote_and_exits_0(run, tmp_path):
    """`python tools.py export` (the shell's view: exit status 0, one line naming the folder and what to run next)."""
    r = subprocess.run([sys.executable, "tools.py", "export", "--load", str(run), "--hf-out", str(tmp_path / "hf")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith(f"exported {run} to {tmp_path / 'hf'} "), r.stdout


def test_resuming_with_another_tokenizer_is_refused(run, corpus, cache, tmp_path, capsys):
    import shutil

    from interop import tokenizer_files
    other = tokenizer_files.get_tokenizer(["hello world foo bar " * 50, "lorem ipsum dolor " * 40], None, 384)
    tokenizer_files.save_tokenizer(other, tmp_path / "other.json")
    shutil.copytree(run, tmp_path / "run")
    line = fails(tiny(corpus, cache, tmp_path / "run", "--load", str(tmp_path / "run"), "--tokenizer-file",
                      str(tmp_path / "other.json"), iters=5), capsys)
    assert line == (f"train.py: error: --tokenizer-file {tmp_path / 'other.json'} is not the tokenizer "
                    f"{tmp_path / 'run' / 'tokenizer.json'} the model was trained with (its ids would mean other "
                    "tokens): leave --tokenizer-file out")
    shutil.copy(run / "tokenizer.json", tmp_path / "same.json")  # the same tokenizer from another file: resumes
    train.main(tiny(corpus, cache, tmp_path / "run", "--load", str(tmp_path / "run"), "--tokenizer-file",
                    str(tmp_path / "same.json"), iters=5))
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"


@pytest.mark.parametrize("where, expect", [("file", "is a file, not a directory"),
                                           ("under a file", "cannot write there (Not a directory)")])
def test_a_save_directory_that_cannot_be_written_is_refused_before_training(corpus, cache, tmp_path, capsys, where,
                                                                           expect):
    (tmp_path / "file").write_text("mine")
    save = tmp_path / "file" if where == "file" else tmp_path / "file" / "run"
    line = fails(tiny(corpus, cache, save, iters=2), capsys)
    assert line == f"train.py: error: --save {save}: {expect}".replace(": is a file", " is a file"), line
    assert (tmp_path / "file").read_text() == "mine"


def test_a_failed_save_says_why_and_keeps_the_previous_checkpoint(corpus, cache, tmp_path, capsys, monkeypatch):
    """A full disk at the second save (torch.save raising ENOSPC, as a full file system does): one line naming the
    cause and the checkpoint kept; the partial directory gone; the run resumes from the kept one."""
    import checkpoint
    real = torch.save

    def full_disk(obj, f, *a, **k):
        if "iter_0000004" in str(f):  # (the RNG file, written after the shards)
            raise OSError(28, "No space left on device")
        return real(obj, f, *a, **k)
    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    line = fails(tiny(corpus, cache, tmp_path / "run", "--save-interval", "2", iters=4), capsys)
    assert line == (f"train.py: error: saving iteration 4 to {tmp_path / 'run'} failed (OSError: [Errno 28] No space "
                    f"left on device; {line.split('; ')[1].split(')')[0]}): the previous checkpoint "
                    f"{tmp_path / 'run' / 'iter_0000002'} is intact (latest_checkpointed_iteration.txt names it)"), line
    assert sorted(p.name for p in (tmp_path / "run").glob("iter_*")) == ["iter_0000002"]
    monkeypatch.setattr(checkpoint.torch, "save", real)
    assert checkpoint.find_checkpoint(tmp_path / "run").meta["iteration"] == 2  # verified against its manifest


def test_keep_last_checkpoints_deletes_the_older_ones_and_the_size_is_said(corpus, cache, tmp_path, capsys):
    train.main(tiny(corpus, cache, tmp_path / "run", "--save-interval", "1", "--keep-last-checkpoints", "2", iters=4))
    assert sorted(p.name for p in (tmp_path / "run").glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    done = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("done: ")]
    assert re.search(r"; checkpoints \d+\.\d MiB on disk$", done[0]), done


def test_make_train_checks_before_torchrun_starts(corpus, cache, tmp_path):
    """make train NPROC=2: a bad flag is the first line of the output, the whole output short (train.py --check-only
    in one process before torchrun); a good layout trains."""
    make = ["make", "--no-print-directory", "-o", ".venv/.stamp", "train", "NPROC=2", "TP=2", f"RUN={tmp_path / 'r'}"]
    r = subprocess.run(make + [f"ARGS={' '.join(tiny(corpus, cache, tmp_path / 'r', iters=1)[:-2])} "
                               "--num-attention-heads 3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and lines[0] == "train.py: error: hidden_size=64 is not divisible by num_attention_heads=3" \
        and len(lines) <= 5, lines


def make_lines(target: str, *assigns: str) -> list[list[str]]:
    """The command lines of `make TARGET ASSIGNS`'s recipe as make expands them (`make -n`: nothing runs), each as
    its words (a leading VAR=value kept)."""
    r = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.stamp", "-n", target, *assigns], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.replace("\\\n", " ").splitlines() if line.strip()]


def run_make_line(words: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """One `[VAR=value] .venv/bin/python tools.py ...` line of a make recipe, run in this process (its VAR=value set
    in the environment): its exit status and its output's lines (stdout's, then stderr's)."""
    words = list(words)
    while re.fullmatch(r"\w+=\S*", words[0]):
        monkeypatch.setenv(*words.pop(0).split("=", 1))
    assert words[:2] == [".venv/bin/python", "tools.py"], words
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        tools.main(words[2:])
    out = capsys.readouterr()
    return e.value.code, (out.out + out.err).strip().splitlines()


MAKE_SERVE_REAL = "tp vs heads"  # the case make itself runs (the others: the line make would run, run here)


@pytest.mark.parametrize("case", ["no run", "tp vs heads", "misspelled flag", "port in use"])
def test_make_serve_checks_before_torchrun_starts(run, tmp_path, case, monkeypatch, capsys):
    """make serve NPROC=2 TP=2: a directory that is no run, TP that does not divide the heads (NPROC=3 TP=3), a
    misspelled flag, a port in use: the error is the first line of the output, the whole output short, exit 2 (tools.py
    serve --check-only in one process before torchrun). MAKE_SERVE_REAL's case runs make itself (its exit status,
    torchrun never started); each other case runs the check line make's recipe expands to (`make -n`: the check,
    then torchrun's line) in this process, which spares a Python start (~4 s) and checks the same output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        make, expect = {
            "no run": (["NPROC=2", "TP=2", f"RUN={tmp_path}"],
                       f"--load {tmp_path}: no checkpoint there (no latest_checkpointed_iteration.txt)"),
            "tp vs heads": (["NPROC=3", "TP=3", f"RUN={run}"], "num_attention_heads=4 is not divisible by "
                            "tensor-model-parallel size 3"),
            "misspelled flag": (["NPROC=2", "TP=2", f"RUN={run}", "ARGS=--max-batchs 4"],
                                "unrecognized arguments: --max-batchs 4"),
            "port in use": (["NPROC=2", "TP=2", f"RUN={run}", f"ARGS=--port {port}"],
                            f"--host 127.0.0.1 --port {port}: cannot listen there (Address already in use): another "
                            "server on that port? pass --port N")}[case]
        if case == MAKE_SERVE_REAL:
            r = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.stamp", "serve", *make], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
            code, lines = r.returncode, (r.stdout + r.stderr).strip().splitlines()
        else:
            check, launch = make_lines("serve", *make)
            assert check[-1] == "--check-only" and "torch.distributed.run" in launch, (check, launch)
            code, lines = run_make_line(check, monkeypatch, capsys)
    assert code == 2 and lines[0] == f"tools.py: error: {expect}" and len(lines) <= 5, lines


def test_serve_check_only_reads_no_weights(run, monkeypatch):
    """--check-only on a good run and layout: exit status 0, no process group made, no weights read."""
    import checkpoint
    from serving import server
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(checkpoint.dcp(), "load", lambda *a, **k: pytest.fail("--check-only read the weights"))
    monkeypatch.setattr(server.dist, "init_process_group", lambda *a, **k: pytest.fail("a process group was made"))
    port = str(harness.free_port())
    assert server.main(["--load", str(run), "--tensor-model-parallel-size", "2", "--port", port, "--check-only"]) == 0


@pytest.mark.parametrize("make_args, expect", [
    (["PROMPT="], "tools.py: error: --prompt is empty: give the text to continue"),
    (["TP=2"], "make sample runs one process on a run saved at any layout: leave out NPROC=1 TP=2"),
])
def test_make_sample_refuses_an_empty_prompt_and_a_layout(run, make_args, expect, monkeypatch, capsys):
    """A layout is refused by make itself (its $(error): no Python starts); an empty PROMPT= reaches tools.py sample
    as an empty --prompt: the line make's recipe expands to (`make -n`) runs here, exit status 2 and the error."""
    if make_args == ["PROMPT="]:
        (line,) = make_lines("sample", f"RUN={run}", *make_args)
        assert line[line.index("--prompt") + 1] == "", line
        code, lines = run_make_line(line, monkeypatch, capsys)
        assert code == 2 and expect in lines, lines
        return
    r = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.stamp", "sample", f"RUN={run}", *make_args],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and expect in r.stderr, r.stderr


def test_a_port_in_use_is_refused_before_the_model_loads(run, capsys):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = fails(["serve", "--load", str(run), "--host", "127.0.0.1", "--port", str(port)], capsys, tools.main,
                     "tools.py")
    assert line == (f"tools.py: error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use): "
                    "another server on that port? pass --port N")


def test_a_run_without_save_writes_no_files(corpus, cache, tmp_path, capsys, monkeypatch):
    """No --save: no run directory appears (Megatron writes nothing without --save); the final line says so."""
    monkeypatch.chdir(tmp_path)
    train.main(tiny(corpus, cache, "unused", iters=1)[:-2])
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("no --save: no files written")


def test_writing_the_rl_tasks_sft_records_says_where_and_what_next(tmp_path, capsys):
    assert tools.main(["rl", "--sft-out", str(tmp_path / "b.jsonl")]) == 0
    out = capsys.readouterr().out.strip()
    n = len((tmp_path / "b.jsonl").read_text().splitlines())
    assert n > 0 and out.startswith(f"wrote {n} SFT records of the bracket task to {tmp_path / 'b.jsonl'}; train on "
                                    "them: make train ARGS="), out


def test_prefix_caching_is_refused_at_start_for_a_model_that_cannot_have_it(monkeypatch):
    """mamba.py declares prefix_caching unsupported (a cached prefix holds keys and values, not a recurrent state):
    the server refuses the flag before it serves, instead of failing at the first cache hit."""
    import types

    import checkpoint
    from serving import server
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: types.SimpleNamespace(
        model_file=contract.model_file("mamba")))
    port = str(harness.free_port())
    with pytest.raises(contract.ConfigError, match="^--model mamba with --enable-prefix-caching: a cached prefix holds "
                       "keys and values, not the recurrent state after it$"):
        server.main(["--load", "any", "--port", port, "--enable-prefix-caching"])
