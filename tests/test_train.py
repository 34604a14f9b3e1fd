"""Tests for train.py on a tiny model and a synthetic corpus (fast): what its command line promises.

  - torchrun TP=2 (warm ranks) logs the same loss (and grad norm) at every iteration as one process (fp32, dropout 0);
  - stop + resume equals an uninterrupted run, dropout on (RNG restored); a TP=2 checkpoint loads at TP=1;
  - a save killed half-way leaves `latest` on the previous complete checkpoint, which loads;
  - bad input ends with one clear error line, no traceback; data formats (.jsonl, Megatron .bin/.idx); sampling.
Tolerance: float32 TP vs single process, 1e-5 relative (reduction order only; measured bit-equal here).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import arguments
import checkpoint
import data
import scheduler
import tools
import train
from harness import ROOT, SNIPPET, assert_close, metrics, tiny, torchrun  # noqa: F401 (shared)
from interop import tokenizer_files


# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single(corpus, cache, tmp_path_factory):
    """The reference: one process, 6 iterations, checkpoint at 3 and 6."""
    d = tmp_path_factory.mktemp("single")
    train.main(tiny(corpus, cache, d, "--save-interval", "3"))
    return d


def test_tp2_torchrun_matches_single_process_and_reshards_to_tp1(single, corpus, cache, tmp_path):
    tp2 = tmp_path / "tp2"
    torchrun(2, tiny(corpus, cache, tp2, "--tensor-model-parallel-size", "2", "--save-interval", "3"))
    (ref, ref_val), (got, got_val) = metrics(single), metrics(tp2)
    assert sorted(got) == sorted(ref) == list(range(1, 7)) and sorted(got_val) == sorted(ref_val) == [3, 6]
    for i in ref:
        assert_close(got[i]["loss"], ref[i]["loss"], 1e-5, f"loss at iteration {i}")
        assert_close(got[i]["grad_norm"], ref[i]["grad_norm"], 1e-5, f"grad norm at iteration {i}")
    for i in ref_val:
        assert_close(got_val[i], ref_val[i], 1e-5, f"validation loss at iteration {i}")
    assert ref[6]["loss"] < ref[1]["loss"]  # it learns
    # resharding: the TP=2 checkpoint of iteration 3, loaded by one process; the next losses match
    one = tmp_path / "tp2_to_1"
    train.main(tiny(corpus, cache, one, "--load", str(tp2), "--ckpt-step", "3"))
    res, _ = metrics(one)
    assert sorted(res) == [4, 5, 6]
    for i in res:
        assert_close(res[i]["loss"], ref[i]["loss"], 1e-5, f"loss after TP=2 -> TP=1 at iteration {i}")


def test_dp2_sequence_parallel_torchrun_matches_single_process(single, corpus, cache, tmp_path):
    """World 4 would be slow here; DP=2 (TP=1) and its checkpoint, loaded at TP=2 + SP: same losses."""
    dp2 = tmp_path / "dp2"
    torchrun(2, tiny(corpus, cache, dp2, "--train-iters", "3"))
    ref, _ = metrics(single)
    got, _ = metrics(dp2)
    assert sorted(got) == [1, 2, 3]
    for i in got:
        assert_close(got[i]["loss"], ref[i]["loss"], 1e-5, f"DP=2 loss at iteration {i}")
    tp2 = tmp_path / "tp2sp"
    torchrun(2, tiny(corpus, cache, tp2, "--load", str(single), "--ckpt-step", "3", "--tensor-model-parallel-size",
                     "2", "--sequence-parallel"))
    got, _ = metrics(tp2)
    assert sorted(got) == [4, 5, 6]
    for i in got:
        assert_close(got[i]["loss"], ref[i]["loss"], 1e-5, f"TP=2+SP after loading a TP=1 checkpoint, iteration {i}")


def test_pipeline_and_distributed_optimizer_match_single_process(corpus, cache, tmp_path):
    """4 layers: interleaved PP=2 (2 chunks per rank, tied embedding across stages) and DP=2 with the distributed
    optimizer and overlapped buckets log the same losses as one process; the PP checkpoint resumes in one process."""
    four = ("--num-layers", "4", "--save-interval", "2")
    single, pp2, dist2, one = (tmp_path / n for n in ("single", "pp2", "dist", "pp2_to_1"))
    train.main(tiny(corpus, cache, single, *four, iters=4))
    torchrun(2, tiny(corpus, cache, pp2, *four, "--pipeline-model-parallel-size", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1", iters=4))
    torchrun(2, tiny(corpus, cache, dist2, *four, "--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--ddp-bucket-size", "20000", iters=4))
    train.main(tiny(corpus, cache, one, *four, "--load", str(pp2), "--ckpt-step", "2", iters=4))
    (ref, ref_val) = metrics(single)
    for run, iters in [(pp2, [1, 2, 3, 4]), (dist2, [1, 2, 3, 4]), (one, [3, 4])]:
        got, got_val = metrics(run)
        assert sorted(got) == iters and sorted(got_val) == [3, 4], run.name
        for i in iters:
            assert_close(got[i]["loss"], ref[i]["loss"], 1e-5, f"{run.name} loss at iteration {i}")
            assert_close(got[i]["grad_norm"], ref[i]["grad_norm"], 1e-5, f"{run.name} grad norm at iteration {i}")
        for i in got_val:
            assert_close(got_val[i], ref_val[i], 1e-5, f"{run.name} validation loss at iteration {i}")


def test_mamba_trains_and_its_segmented_checkpoint_reshards(corpus, cache, tmp_path):
    """--model mamba: a TP=1 checkpoint (in_proj saved per segment z, x, B, C, dt) resumes at TP=2, same losses."""
    m = ("--model", "mamba", "--hybrid-layer-pattern", "M*-M", "--num-layers", "4", "--mamba-chunk-size", "16",
         "--mamba-num-groups", "2", "--save-interval", "2")
    one, two = tmp_path / "one", tmp_path / "two"
    train.main(tiny(corpus, cache, one, *m, iters=4))
    torchrun(2, tiny(corpus, cache, two, *m, "--load", str(one), "--ckpt-step", "2", "--tensor-model-parallel-size",
                     "2", iters=4))
    (ref, _), (got, _) = metrics(one), metrics(two)
    assert sorted(got) == [3, 4] and ref[4]["loss"] < ref[1]["loss"]
    for i in got:
        assert_close(got[i]["loss"], ref[i]["loss"], 1e-5, f"mamba TP=1 -> TP=2 loss at iteration {i}")
    assert tools.main(["sample", "--load", str(one), "--prompt", "def ", "--max-new-tokens", "4"]).startswith("def ")


@pytest.mark.parametrize("fp8", [["--optimizer", "adam"], ["--fp8"], []], ids=["adam", "fp8-delayed", "muon"])
def test_resume_equals_uninterrupted_with_dropout(corpus, cache, tmp_path, fp8, capsys):
    """Bit-equal losses, grad norms and validation after a resume: the RNG streams, (with --fp8) the delayed
    recipe's amax histories and scales, and (gpt's default, --optimizer muon) Muon's momentum buffers are part of the
    checkpoint."""
    drop = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", *fp8]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train.main(tiny(corpus, cache, straight, *drop))
    train.main(tiny(corpus, cache, stopped, *drop, "--exit-interval", "3"))
    assert (stopped / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    train.main(tiny(corpus, cache, stopped, *drop, "--load", str(stopped)))
    (a, a_val), (b, b_val) = metrics(straight), metrics(stopped)
    assert sorted(a) == sorted(b) == list(range(1, 7)) and sorted(a_val) == [3, 6]
    assert [a[i]["loss"] for i in a] == [b[i]["loss"] for i in a], "resumed losses differ"
    assert [a[i]["grad_norm"] for i in a] == [b[i]["grad_norm"] for i in a]
    assert a_val == b_val
    assert (stopped / "loss.png").stat().st_size > 0 and list((stopped / "tensorboard").iterdir())
    if not fp8:  # Muon's momentum is not AdamW's moments: another optimizer is refused
        with pytest.raises(SystemExit, match="^2$"):
            train.main(tiny(corpus, cache, stopped, *drop, "--optimizer", "adam", "--load", str(stopped), iters=8))
        assert "its optimizer state is --optimizer muon's, not adam's" in capsys.readouterr().err


def fp8_state(ckpt) -> dict:
    """The 'fp8' entries of a DCP checkpoint directory, read in this process."""
    meta = checkpoint.dcp().FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state = {k: torch.zeros(tuple(m.size)) for k, m in meta.items() if k.startswith("fp8.")}
    with checkpoint._quiet_dcp():
        checkpoint.dcp().load(state, checkpoint_id=str(ckpt))
    return state


def test_fp8_scaling_state_is_checkpointed_layout_free(corpus, cache, tmp_path, capsys):
    """--fp8 checkpoints hold every FP8 linear's amax history and scale under the global weight name, so TP=2
    saves the keys TP=1 does, with the values it would have (amaxes reduced over TP), and a TP=2 checkpoint resumes
    at TP=1 with its scales (no "starts afresh" note). The first step's amaxes come from the same weights: float32
    summation drift only (1e-3; 1e-7 seen). After an update the two layouts train apart by whole FP8 steps: a drift of
    one float32 ulp flips a cast's rounding now and then, and Muon spreads the flipped gradient over the matrix (2.3 %
    seen at the third step, Xeon, 2026-12-07): the second step's values are held to 10 %. An unreduced shard's amax
    is off by up to the whole of the other half's (the negative control: _reduce_max as the identity fails here)."""
    one, two = tmp_path / "one", tmp_path / "two"
    train.main(tiny(corpus, cache, one, "--fp8", iters=2))
    torchrun(2, tiny(corpus, cache, two, "--fp8", "--tensor-model-parallel-size", "2", iters=2))
    a, b = fp8_state(one / "iter_0000002"), fp8_state(two / "iter_0000002")
    assert sorted(a) == sorted(b) and len(a) == 2 * 4 * 3 * 2  # layers x linears x (input, weight, grad) x 2
    for k in a:  # history[i]: the amax of i + 1 steps ago ([0] collects the next step's)
        assert a[k].abs().max() > 0 and torch.allclose(b[k], a[k], rtol=0.1, atol=0), k
        if k.endswith("amax_history"):
            assert a[k][2] > 0 and torch.allclose(b[k][2], a[k][2], rtol=1e-3, atol=0), k  # the first step's
    capsys.readouterr()
    train.main(tiny(corpus, cache, tmp_path / "resumed", "--fp8", "--load", str(two), iters=4))
    assert "starts afresh" not in capsys.readouterr().out
    train.main(tiny(corpus, cache, tmp_path / "other", "--fp8", "--fp8-amax-history-len", "16", "--load", str(two),
                    iters=4))
    assert "FP8 scaling starts afresh" in capsys.readouterr().out


def test_kill_during_save_keeps_previous_checkpoint(corpus, cache, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real_save, calls = checkpoint.dcp().save, []

    def dying_save(state, checkpoint_id):  # the second save writes its shards, then the process "dies"
        calls.append(checkpoint_id)
        real_save(state, checkpoint_id=checkpoint_id)
        if len(calls) == 2:
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a file")
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(checkpoint.dcp(), "save", dying_save)
    with pytest.raises(SystemExit, match="^130$"):  # (main turns the KeyboardInterrupt into exit code 130)
        train.main(tiny(corpus, cache, run, "--save-interval", "2"))
    monkeypatch.setattr(checkpoint.dcp(), "save", real_save)
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (run / "iter_0000004").exists() and (run / "iter_0000004.tmp").exists()
    train.main(tiny(corpus, cache, run, "--load", str(run), "--save-interval", "2"))
    got, _ = metrics(run)
    assert sorted(got) == list(range(1, 7))  # lines past the checkpoint were dropped, then rewritten
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert not (run / "iter_0000004.tmp").exists()


def test_data_formats_and_sample(corpus, cache, tmp_path, capsys):
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"content": SNIPPET.format(i=i)}) + "\n" for i in range(30)))
    train.main(tiny(jl, cache, tmp_path / "j", "--json-keys", "content", iters=2))
    assert len(metrics(tmp_path / "j")[0]) == 2
    assert data.main(["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "mm"),
                      "--vocab-size", "384"]) == 0
    train.main(tiny(tmp_path / "mm", cache, tmp_path / "m", iters=2))
    assert len(metrics(tmp_path / "m")[0]) == 2
    capsys.readouterr()
    tools.main(["sample", "--load", str(tmp_path / "m"), "--prompt", "def ", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out) > len("def \n")


def test_fp16_overflow_skips_step_and_bf16_runs(corpus, cache, tmp_path):
    train.main(tiny(corpus, cache, tmp_path / "fp16", "--fp16", "--initial-loss-scale", str(2.0**40), iters=3))
    got, _ = metrics(tmp_path / "fp16")
    assert [got[i]["skipped"] for i in (1, 2, 3)] == [1, 1, 1]
    assert [got[i]["loss_scale"] for i in (1, 2, 3)] == [2.0**39, 2.0**38, 2.0**37]
    assert [got[i]["lr"] for i in (1, 2, 3)] == [0.0] * 3  # a skipped step does not advance the schedule (Megatron's)
    train.main(tiny(corpus, cache, tmp_path / "bf16", "--bf16", iters=3))
    got, _ = metrics(tmp_path / "bf16")
    assert sorted(got) == [1, 2, 3]
    assert all(got[i]["skipped"] == 0 and got[i]["loss"] < 7 for i in got)


def test_learning_rate_schedule():
    """Megatron's schedule, written out (tests/test_lr_schedule.py compares it with Megatron-core's scheduler): steps
    count samples (16 an iteration here); iteration i trains at the rate of the 16·i samples before it, so the first
    at --lr-warmup-init (0), the 11th at the peak; cosine to --min-lr at iteration 110, then --min-lr."""
    a = arguments.check_args(arguments.parse_args(["--lr", "1.0", "--min-lr", "0.1", "--lr-warmup-iters", "10",
                                                   "--train-iters", "110"]), 1)
    lr = [scheduler.learning_rate(16 * i, a) for i in range(120)]
    assert lr[0] == 0.0 and lr[1] == 0.1 and lr[9] == 0.9 and lr[10] == 1.0
    assert lr[60] == pytest.approx(0.1 + 0.9 * 0.5) and lr[110] == lr[119] == 0.1
    assert all(x >= y for x, y in zip(lr[10:], lr[11:]))


# ---------------------------------------------------------------------------------------------- bad input
def _bad_idx(tmp_path):
    data.write_indexed_dataset(str(tmp_path / "bad"), [[1, 2, 3]] * 5, 384)
    raw = bytearray((tmp_path / "bad.idx").read_bytes())
    raw[0:2] = b"XX"
    (tmp_path / "bad.idx").write_bytes(bytes(raw))
    (tmp_path / "bad.tokenizer.json").write_text("{}")
    return tmp_path / "bad"


def _empty(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("  \n\n")
    return tmp_path / "empty"


def _big_tokenizer(tmp_path, corpus):
    tok = tokenizer_files.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], None, vocab_size=512)
    tok.save(str(tmp_path / "tok.json"))
    return ["--tokenizer-file", str(tmp_path / "tok.json"), "--vocab-size", "384"]




@pytest.mark.parametrize("case, expect", [
    ("missing", "does not exist"),
    ("empty", "no non-empty documents"),
    ("bad_idx", "bad magic"),
    ("tokenizer", "more than the model's --vocab-size=384"),
    ("gbs", "--global-batch-size=10 is not divisible by --micro-batch-size x data-parallel size = 4 x 1"),
    ("pp", "world size 1 is not divisible by tensor x pipeline parallel size 1 x 2"),
    ("vp", "--num-layers-per-virtual-pipeline-stage=1 needs pipeline parallelism"),
    ("heads", "num_attention_heads=4 is not divisible by tensor-model-parallel size 3"),
    ("model", "--model nosuchmodel: no model file nosuchmodel.py (this repository has bert, gpt, llava, mamba"),
    ("precision", "--bf16 and --fp16 are exclusive"),
])
def test_bad_input_gives_one_clear_error(corpus, cache, tmp_path, capsys, case, expect):
    argv = tiny(corpus, cache, tmp_path / "run", iters=1)
    extra = {"missing": ["--data-path", str(tmp_path / "nope")], "empty": ["--data-path", str(_empty(tmp_path))]
             if case == "empty" else [], "bad_idx": ["--data-path", str(_bad_idx(tmp_path))] if case == "bad_idx" else [],
             "tokenizer": _big_tokenizer(tmp_path, corpus) if case == "tokenizer" else [],
             "gbs": ["--global-batch-size", "10", "--micro-batch-size", "4"], "pp": ["--pipeline-model-parallel-size", "2"],
             "vp": ["--num-layers-per-virtual-pipeline-stage", "1"],
             "heads": ["--tensor-model-parallel-size", "3"], "model": ["--model", "nosuchmodel"],
             "precision": ["--bf16", "--fp16"]}[case]
    if case == "heads":
        os.environ["WORLD_SIZE"] = "3"  # as torchrun would set it; no process group is made before the check
    try:
        with pytest.raises(SystemExit, match="^2$") as e:
            train.main(argv + extra)
    finally:
        os.environ.pop("WORLD_SIZE", None)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.startswith("train.py: error: ") and expect in err, err


def test_t5_trains_and_samples_a_decoded_span(corpus, cache, tmp_path, capsys):
    """--model t5 end to end (span corruption) and `tools.py sample`, which fills the masked span greedily."""
    run = tmp_path / "t5"
    train.main(tiny(corpus, cache, run, "--model", "t5", iters=2))
    capsys.readouterr()
    text = tools.main(["sample", "--load", str(run), "--prompt", "def add_1(a, b):", "--max-new-tokens", "5"])
    assert text.startswith("def add_1(a, b):") and "--- decoded spans ---" in text


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_an_inner_pipeline_stage_computes_only_what_it_sends(packed):
    """train.stage_step with the default recipe (config.next_token_recipe; packed: --reset-position-ids,
    --reset-attention-mask, --eod-mask-loss) on an inner pipeline stage (post_process False) returns the very tensor
    the stage's model returned, and no torch operation runs after the model (a TorchFunctionMode records them all).
    Negative control: on a last stage the same recording shows the loss computed after the model."""
    import types

    from torch.overrides import TorchFunctionMode

    import config

    calls, hidden = [], torch.randn(7, 2, 8)

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class Stage(torch.nn.Module):
        def __init__(self, post_process):
            super().__init__()
            self.post_process = post_process

        def forward(self, input_ids, labels, **kw):
            calls.append("model")
            return hidden if not self.post_process else torch.ones(input_ids.shape)  # [s, b, h] / per-token losses

    flags = dict.fromkeys(["reset_position_ids", "reset_attention_mask", "eod_mask_loss"], packed)
    batch = torch.randint(1, 50, (2, 8))
    recipe, _ = config.next_token_recipe(batch, types.SimpleNamespace(**flags), types.SimpleNamespace(eod=0))
    for last in (False, True):
        calls.clear()
        with Record():
            out = train.stage_step(Stage(last), batch, recipe)
        after = calls[calls.index("model") + 1:]
        if not last:
            assert out is hidden and after == [], after
        else:
            assert "sum" in after and out.dim() == 0, after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_reuses_large_blocks():
    """train.keep_freed_memory: a freed 64 MiB block (the default run's [s, b, V] logits) is reused, not given back
    to the kernel and faulted in again page by page. Negative control: without it, glibc's mmap makes the second
    64 MiB buffer fault in every one of its 16,384 pages. One fresh process measures both, the control first (mallopt
    cannot be undone; one process, not two, saves a torch import)."""
    code = ("import resource, torch, train\n"
            "def touch(): torch.empty(16 << 20).fill_(1.0)\n"  # 64 MiB of float32, freed on return
            "def faults():\n"  # the page faults of the second of two touches
            "    touch(); f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; touch()\n"
            "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0\n"
            "off = faults(); train.keep_freed_memory(); faults()\n"  # (the first touch after mallopt faults them in)
            "print(off, faults())\n")
    count = lambda: dict(zip(("off", "on"), map(int, subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split())))
    # up to 3 tries: under a loaded test session the kernel occasionally faults the reused pages in again (seen here
    # once in a few full runs, never alone); without keep_freed_memory every run faults them all in
    faults = count()
    for _ in range(2):
        faults = faults if faults["on"] < 1_000 else count()
    assert faults["off"] > 10_000, faults  # 16,384 pages of 4 KiB
    assert faults["on"] < 1_000, faults
