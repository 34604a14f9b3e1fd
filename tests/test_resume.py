"""Stop + resume with the distributed optimizer (ZeRO-1) equals the uninterrupted run, exactly.

torchrun DP=2 with --use-distributed-optimizer (gpt's default optimizer, Muon for the hidden matrices and AdamW for
the rest: parallel.DistributedMuon, its state sliced like AdamW's; small overlapped buckets, so each rank holds slices
of several buckets; dropout on, so the per-rank RNG streams matter too): a run stopped at iteration 3
(--exit-interval) and resumed (--load) logs the same losses, grad norms and validation losses as the run that never
stopped, and its final checkpoint holds the same parameters, moments and steps, and RNG states. Tolerance: none
(bit-equal): the resumed run repeats the same operations on the same values; what a checkpoint fails to restore (the optimizer's
slices, checkpoint.load_checkpoint -> DistributedOptimizer.load_full_state) changes the next update.
The helpers are harness.py's (shared, so the test files build their runs alike).
"""
from pathlib import Path

import torch

import checkpoint
from harness import metrics, tiny, torchrun

ZERO1 = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint directory (model, optimizer), read whole in this process."""
    meta = checkpoint.dcp().FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items() if hasattr(m, "size")}
    with checkpoint._quiet_dcp():
        checkpoint.dcp().load(state, checkpoint_id=str(ckpt))
    return state


def test_distributed_optimizer_resume_equals_uninterrupted(corpus, tmp_path):
    cache, straight, stopped = tmp_path / "cache", tmp_path / "straight", tmp_path / "stopped"
    torchrun(2, tiny(corpus, cache, straight, *ZERO1))
    torchrun(2, tiny(corpus, cache, stopped, *ZERO1, "--exit-interval", "3"))
    assert (stopped / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    torchrun(2, tiny(corpus, cache, stopped, *ZERO1, "--load", str(stopped)))
    (a, a_val), (b, b_val) = metrics(straight), metrics(stopped)
    assert sorted(a) == sorted(b) == list(range(1, 7)) and sorted(a_val) == sorted(b_val) == [3, 6]
    for i in range(4, 7):
        for key in ("loss", "grad_norm"):
            assert b[i][key] == a[i][key], f"resumed {key} at iteration {i}: {b[i][key]!r} != {a[i][key]!r}"
    assert b_val == a_val, f"resumed validation losses {b_val} != {a_val}"
    # the final checkpoints: parameters, Adam moments and steps, every rank's RNG streams
    want, got = checkpoint_tensors(straight / "iter_0000006"), checkpoint_tensors(stopped / "iter_0000006")
    assert sorted(got) == sorted(want)
    moments = [k for k in want if k.startswith("optimizer.") and k.endswith(".exp_avg")]  # (Muon's: its momentum)
    assert moments and all(want[k].abs().max() > 0 for k in moments), "the checkpoint holds no moments"
    for k in want:
        assert torch.equal(got[k], want[k]), (f"final checkpoint {k}: resumed run differs by "
                                              f"{(got[k].double() - want[k].double()).abs().max():.3e}")
    for rank in (0, 1):
        x, y = (torch.load(d / "iter_0000006" / f"rng_rank{rank}.pt", weights_only=False) for d in (stopped, straight))
        assert torch.equal(x["torch"], y["torch"]), f"rank {rank}: default RNG stream differs"
        assert [sorted(s) for s in x["tracker"]] == [sorted(s) for s in y["tracker"]]
        assert all(torch.equal(s[k], t[k]) for s, t in zip(x["tracker"], y["tracker"]) for k in s), rank
