"""train.py fails loudly, not silently: what each failure looks like.

  - a non-finite loss or gradient norm stops the run before the step, naming the iteration (exit 2, one line);
    the last good checkpoint stays `latest`; under torchrun every rank stops and none hangs;
  - fp16 stuck at --min-loss-scale stops; --skip-nonfinite-steps skips and counts instead; the check can be turned off;
  - every numeric flag's range, and `tools.py sample`'s arguments, are checked with one line before any work
    (under torchrun printed once, without argparse's usage); a model's own checks come before the data is built;
  - an empty validation split says so; every model's default flags take TP=2.
The NaN runs use --lr 1e6: the first step blows the weights up, a later iteration's gradient norm is NaN.
"""
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

import arguments
import config as contract
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


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], ["--use-distributed-optimizer"]],
                         ids=["tp2", "dp2-distopt"])
def test_nan_under_torchrun_stops_every_rank_and_says_it_once(corpus, cache, tmp_path, layout):
    run = tmp_path / "run"
    r = torchrun(2, tiny(corpus, cache, run, *NAN, *layout))  # a rank left waiting in a collective: the timeout
    lines = [ln for ln in r.stderr.splitlines() if "train.py: error" in ln]
    assert r.returncode != 0 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("train.py: error: iteration ") and "exitcode  : 2" in r.stderr, lines
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
    r = torchrun(2, tiny(corpus, cache, tmp_path / "run", "--lr", "-1"))
    ours = [ln for ln in r.stderr.splitlines() if "train.py" in ln and "error" in ln]
    assert r.returncode != 0 and ours == ["train.py: error: --lr=-1.0 must be >= 0"], r.stderr[-3000:]
    assert "usage:" not in r.stderr and "exitcode  : 2" in r.stderr, r.stderr[-3000:]  # (the report is torchrun's)


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
