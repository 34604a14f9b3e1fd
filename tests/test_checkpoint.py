"""Checkpoint safety (checkpoint.py, train.py's setup): what a damaged, tampered or misnamed run directory does.

  - every file of a checkpoint is in its manifest.json (size, SHA-256 of the whole file): a byte flipped (past the
    first MiB too), a file truncated, deleted or added, a garbled latest_checkpointed_iteration.txt: one line
    `train.py: error: ...` naming the file;
  - RNG files hold tensors only and are read with weights_only=True: a pickle payload in one never runs;
  - a --load that does not exist is an error, and --save never overwrites another run without --overwrite-save;
  - partial iter_*.tmp/ of interrupted saves are removed at start; checkpoints saved before manifests still load.
The resume tests (resume == uninterrupted, resharding, kill during save) are in test_train.py.
"""
import json
import os
import shutil

import pytest
import torch

import checkpoint
import train
from arguments import ConfigError
from harness import metrics, tiny


@pytest.fixture(scope="module")
def run(corpus, cache, tmp_path_factory):
    """A finished run: 4 iterations, checkpoints at 2 and 4."""
    d = tmp_path_factory.mktemp("ckpt") / "run"
    train.main(tiny(corpus, cache, d, "--save-interval", "2", iters=4))
    return d


def copy(run, dst):
    shutil.copytree(run, dst)
    return dst


def one_line_error(argv, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit, match="^2$"):
        train.main(argv)
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


FILES = {"distcp": "__0_0.distcp", "metadata": ".metadata", "rng": "rng_rank0.pt", "meta": "meta.json",
         "manifest": "manifest.json"}


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("kind", FILES)
def test_damaged_checkpoint_file_is_refused_naming_it(run, corpus, cache, tmp_path, capsys, kind, damage):
    c = copy(run, tmp_path / "c")
    f = c / "iter_0000004" / FILES[kind]
    raw = bytearray(f.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
        f.write_bytes(bytes(raw))
    elif damage == "truncate":
        f.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        f.unlink()
    err = one_line_error(tiny(corpus, cache, tmp_path / "new", "--load", str(c), iters=6), capsys)
    assert str(f) in err, err
    what = {"flip": "content differs", "truncate": "size differs", "delete": "is missing"}[damage]
    assert (what if kind != "manifest" or damage == "delete" else "is damaged") in err, err


def test_byte_flipped_past_the_first_mib_is_refused(run, corpus, cache, tmp_path, capsys):
    """The manifest's SHA-256 covers a whole file, not its first read block: the last byte of the checkpoint's largest
    file (over 1 MiB, so that byte lies past the first 1 MiB block) flipped is refused, naming the file. A hash of
    the first MiB only (the file read once instead of block by block) passes this file as intact."""
    c = copy(run, tmp_path / "c")
    f = max((c / "iter_0000004").iterdir(), key=lambda p: p.stat().st_size)
    raw = bytearray(f.read_bytes())
    assert len(raw) > (1 << 20) + 1, f"{f} has {len(raw)} bytes: the flipped byte would lie in the first MiB"
    raw[-1] ^= 0x01
    f.write_bytes(bytes(raw))
    try:
        checkpoint.verify_checkpoint(f.parent)
    except ConfigError:
        pass
    else:
        pytest.fail(f"{f} with its last byte flipped verifies against the manifest: its hash misses the file's end")
    err = one_line_error(tiny(corpus, cache, tmp_path / "new", "--load", str(c), iters=6), capsys)
    assert str(f) in err and "content differs" in err, err


def test_unexpected_file_and_garbled_pointer_are_refused(run, corpus, cache, tmp_path, capsys):
    c = copy(run, tmp_path / "c")
    (c / "iter_0000004" / "__1_0.distcp").write_bytes(b"stray")
    err = one_line_error(tiny(corpus, cache, tmp_path / "new", "--load", str(c)), capsys)
    assert str(c / "iter_0000004" / "__1_0.distcp") in err and "unexpected file" in err
    (c / "latest_checkpointed_iteration.txt").write_text("4\x00garbage\n")
    err = one_line_error(tiny(corpus, cache, tmp_path / "new", "--load", str(c)), capsys)
    assert str(c / "latest_checkpointed_iteration.txt") in err and "expected an iteration number" in err


def test_checkpoint_of_another_model_is_refused(run, corpus, cache, tmp_path, capsys):
    err = one_line_error(tiny(corpus, cache, tmp_path / "new", "--load", str(run), "--hidden-size", "32"), capsys)
    assert "the checkpoint's model differs: hidden_size=64 in the checkpoint, 32 now" in err


class Payload:  # unpickling this runs os.mkdir(marker)
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_rng_file_is_tensors_only_and_a_pickle_payload_never_runs(run, corpus, cache, tmp_path, capsys):
    c, marker = copy(run, tmp_path / "c"), tmp_path / "pwned"
    ckpt = c / "iter_0000004"
    torch.save({"torch": Payload(marker)}, ckpt / "rng_rank0.pt")
    err = one_line_error(tiny(corpus, cache, tmp_path / "new", "--load", str(c), iters=6), capsys)
    assert str(ckpt / "rng_rank0.pt") in err and not marker.exists()
    checkpoint.write_manifest(ckpt)  # an attacker who rewrites the manifest too: the restricted unpickler refuses
    err = one_line_error(tiny(corpus, cache, tmp_path / "new", "--load", str(c), iters=6), capsys)
    assert str(ckpt / "rng_rank0.pt") in err and "refusing to unpickle" in err and not marker.exists()
    rng = checkpoint.read_rng(run / "iter_0000004" / "rng_rank0.pt")  # what the project writes: weights_only reads it
    assert rng["torch"].dtype == torch.uint8 and len(rng["tracker"]) == 1  # (no dropout: no tracker stream drawn yet)


def test_checkpoint_saved_before_manifests_loads_with_a_warning(run, corpus, cache, tmp_path, capsys):
    """Format 1 (no manifest.json, meta.json without checkpoint_format; the RNG files were the same): loads
    unverified, with a warning, RNG restored: the resumed losses are the uninterrupted run's."""
    c = copy(run, tmp_path / "c")
    old = c / "iter_0000002"
    shutil.rmtree(c / "iter_0000004")
    (c / "latest_checkpointed_iteration.txt").write_text("2\n")
    (old / "manifest.json").unlink()
    meta = json.loads((old / "meta.json").read_text())
    del meta["checkpoint_format"]
    (old / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    train.main(tiny(corpus, cache, c, "--load", str(c), iters=4))
    assert f"WARNING: {old} has no manifest.json" in capsys.readouterr().err
    (ref, ref_val), (got, got_val) = metrics(run), metrics(c)
    assert sorted(got) == [1, 2, 3, 4] and [got[i]["loss"] for i in got] == [ref[i]["loss"] for i in got]
    assert got_val == ref_val


def test_typo_in_load_leaves_the_run_untouched(run, corpus, cache, tmp_path, capsys):
    c = copy(run, tmp_path / "c")
    before = [(c / n).read_text() for n in ("latest_checkpointed_iteration.txt", "metrics.jsonl")]
    err = one_line_error(tiny(corpus, cache, c, "--load", str(tmp_path / "c_typo"), iters=6), capsys)
    assert f"--load {tmp_path / 'c_typo'} does not exist" in err
    assert [(c / n).read_text() for n in ("latest_checkpointed_iteration.txt", "metrics.jsonl")] == before
    new = tmp_path / "new"  # --load = --save that does not exist yet: a first start, but not of a given step
    err = one_line_error(tiny(corpus, cache, new, "--load", str(new), "--ckpt-step", "2"), capsys)
    assert f"--ckpt-step 2: --load {new} has no checkpoint yet" in err


def test_save_over_another_run_is_refused_unless_overwrite_save(run, corpus, cache, tmp_path, capsys):
    c, older = copy(run, tmp_path / "c"), copy(run, tmp_path / "older")
    shutil.rmtree(older / "iter_0000004")
    (older / "latest_checkpointed_iteration.txt").write_text("2\n")
    before = (c / "metrics.jsonl").read_text()
    err = one_line_error(tiny(corpus, cache, c, iters=6), capsys)  # from scratch
    assert f"--save {c} holds a run (checkpoint at iteration 4) and this run starts from scratch" in err
    err = one_line_error(tiny(corpus, cache, c, "--load", str(older), iters=6), capsys)
    assert f"--save {c} holds a run" in err and f"starts from {older / 'iter_0000002'} (iteration 2)" in err
    assert (c / "metrics.jsonl").read_text() == before
    train.main(tiny(corpus, cache, c, "--overwrite-save", iters=2))  # explicit: a new run replaces it
    assert (c / "latest_checkpointed_iteration.txt").read_text() == "2\n" and sorted(metrics(c)[0]) == [1, 2]


def test_partial_saves_are_removed_at_start(run, corpus, cache, tmp_path, capsys):
    c = copy(run, tmp_path / "c")
    for name in ("iter_0000006.tmp", "iter_0000003.tmp"):
        (c / name).mkdir()
        (c / name / "__0_0.distcp").write_bytes(b"half")
    one_line_error(tiny(corpus, cache, c, iters=6), capsys)  # a refused run removes nothing
    assert (c / "iter_0000006.tmp").exists()
    train.main(tiny(corpus, cache, c, "--load", str(c), iters=4))
    out = capsys.readouterr().out
    assert not list(c.glob("*.tmp")) and f"removed {c / 'iter_0000003.tmp'}: a partial checkpoint" in out
    assert sorted(metrics(c)[0]) == [1, 2, 3, 4]  # resumed at 4: the log of the run it resumes is kept


def test_a_strided_weight_saves_in_one_shape_at_every_expert_tp():
    """SwiGLU expert fc1 ([gate; up] rows, stride 2) is saved as [2, f, h] whether its expert-TP is 1 (replicated)
    or more (sharded: a DTensor of that global shape), so a MoE checkpoint loads at any layout. Negative control:
    the replicated weight viewed along its last dim (the shape it had before) is not that shape."""
    import gpt
    c = gpt.Config(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=64,
                   num_experts=2, moe_ffn_hidden_size=24, gated_linear_unit=True, activation="silu")
    state = checkpoint.checkpoint_state([gpt.Model(c)], None, None)["model"]
    assert tuple(state["decoder.layers.0.mlp.experts.linear_fc1.weight0"].shape) == (2, 24, 32)
    assert tuple(torch.empty(48, 32).unflatten(-1, (2, -1)).shape) != (2, 24, 32)
