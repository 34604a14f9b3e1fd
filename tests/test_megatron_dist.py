"""Megatron-core's own distributed checkpoints (dist_checkpointing, the torch_dist format) in and out.

A tiny Megatron-core 0.15.3 GPTModel (2 layers, SwiGLU, GQA, RMSNorm, RoPE, untied; local spec, float64, CPU) with
seeded weights is saved by `dist_checkpointing.save(model.sharded_state_dict(), DIR)`: its layers stacked into
[L, ...] tensors, its norms under Transformer Engine's names, its SwiGLU fc1 as two shards. Then:
  (a) convert.megatron_dist_state + megatron_state (no Megatron-core needed) give a model whose logits and per-token
      loss equal Megatron's in float64: relative error <= 1e-10 (RTOL; the same weights, only the order of
      floating-point reductions differs, measured ~1e-15); `tools.py import-megatron` saves exactly those weights
      (cast to the run's float32, compared with zero tolerance);
  (b) train.py starts from the imported run (--pretrained-checkpoint) and trains;
  (c) `tools.py export-megatron` of that run is loaded by Megatron-core's own `dist_checkpointing.load` into a fresh
      GPTModel: every parameter equals the run's (exactly) and its logits equal ours from those weights (RTOL);
  (d) negative controls: a checkpoint with a tensor removed, or with a shape that does not fit, fails with one line
      naming the key; layers un-stacked in reverse order fail the logits comparison.
An MoE model (dense layer 0, MoE layer 1 with 4 SequentialMLP experts: per-layer keys, experts stacked [E, ...])
round-trips the same way, compared tensor by tensor (exactly) against Megatron's own state_dict.

Megatron-core runs in one child process (its world of one gloo rank; harness.in_fresh_process), not in the test pool:
dist_checkpointing.save forks writer processes, which a pool rank (a daemon process) may not. Shims there, none of them
project code: the parity tests' CPU shims (megatron_on_cpu), torch.cuda.synchronize as a no-op, filesystem_async's
memory probe (it needs psutil, not installed; only logged) and its results queue (a spawned multiprocessing Manager's,
here an in-process queue: the save runs synchronously in this process).
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib.util
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import arguments
import checkpoint
import harness
import tools
import train
from equivalence import rel_err
from harness import SNIPPET, free_port
from interop import convert, tokenizer_files

HERE = Path(__file__).resolve().parent
RTOL = 1e-10  # float64: the same weights, only the order of reductions differs (measured ~1e-15)
SEED = 7
FLAGS = ["--model", "gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "48", "--swiglu", "--disable-bias-linear",
         "--normalization", "RMSNorm", "--rotary-base", "500", "--untie-embeddings-and-output-weights",
         "--seq-length", "16", "--max-position-embeddings", "16", "--no-qk-layernorm"]
MOE_FLAGS = FLAGS + ["--num-experts", "4", "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size", "24",
                     "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather"]


def config64(flags, tok_file):
    """Our Config of the flags (as import-megatron builds it), in float64 without dropout: Megatron's model is built
    from it (test_megatron_parity.megatron_transformer_config)."""
    args = arguments.check_args(arguments.parse_args(flags + ["--tokenizer-file", str(tok_file)]), 1)
    tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(tok_file))
    c = arguments.model_config(checkpoint.model_file("gpt"), args, tok.get_vocab_size(), tok)
    return dataclasses.replace(c, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)


def batch(c):
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, c.vocab_size, (2, 13), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def ours64(c, full):
    """Our model in float64 with the weights of `full` (our names)."""
    import gpt

    model = gpt.Model(c)
    model.load_state_dict({k: v.double() for k, v in full.items()})
    return model.eval()


def our_outputs(model, c):
    inputs, labels = batch(c)
    with torch.no_grad():
        return model(inputs), model(inputs, labels=labels)


# ---------------------------------------------------------------------------------------------- the Megatron side
def megatron_outputs(mc, c):
    from test_megatron_parity import causal_mask

    inputs, labels = batch(c)
    s = inputs.shape[1]
    pos = torch.arange(s).expand(*inputs.shape)
    with torch.no_grad():
        logits = mc(inputs, pos, causal_mask(s))[..., : c.vocab_size]  # (ours returns the real vocabulary's only)
        return logits, mc(inputs, pos, causal_mask(s), labels=labels)


def megatron_side(work: str, port: int):
    """In a child process: save Megatron's models, import and export them through tools.py, load the exports back
    into fresh Megatron models. Writes work/megatron.pt (what the parent compares)."""
    import queue

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from test_megatron_parity import load_into_megatron, megatron_gpt, megatron_on_cpu, seeded_full_state
    from test_megatron_parity_retro_moe import megatron_env, megatron_moe, patched

    work = Path(work)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    shims = [(torch.cuda, "synchronize", lambda *a, **k: None), (filesystem_async, "_process_memory", lambda: 0),
             (filesystem_async, "_results_queue", queue.Queue())]
    tok = work / "tokenizer.json"
    out = {}
    with megatron_env(), megatron_on_cpu(1, SEED), patched(*shims):
        for case, flags, build in (("dense", FLAGS, megatron_gpt), ("moe", MOE_FLAGS, megatron_moe)):
            c = config64(flags, tok)
            mc = build(c, 1)
            load_into_megatron(mc, seeded_full_state(mc, 1, SEED), 1, gated=True)
            (work / case / "mcore").mkdir(parents=True)
            dist_checkpointing.save(mc.sharded_state_dict(), str(work / case / "mcore"))
            (work / case / "singleton").mkdir()  # the layout Megatron writes with singleton_local_shards
            dist_checkpointing.save(mc.sharded_state_dict(metadata={"singleton_local_shards": True}),
                                    str(work / case / "singleton"))
            out[case] = {"state": {k: v.clone() for k, v in mc.state_dict().items() if not k.endswith("_extra_state")}}
            if case == "dense":
                out[case]["logits"], out[case]["loss"] = megatron_outputs(mc, c)
            tools.main(["import-megatron", "--load", str(work / case / "mcore"), "--save", str(work / case / "run"),
                        *flags, "--tokenizer-file", str(tok)])
            tools.main(["export-megatron", "--load", str(work / case / "run"), "--save", str(work / case / "export")])
            fresh = build(c, 1)  # its own random initialization, replaced by the load
            fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(work / case / "export")))
            out[case]["reloaded"] = {k: v.clone() for k, v in fresh.state_dict().items()
                                     if not k.endswith("_extra_state")}
            if case == "dense":
                out[case]["reloaded_logits"], out[case]["reloaded_loss"] = megatron_outputs(fresh, c)
    torch.save(out, work / "megatron.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The child's results: work/{dense,moe}/{mcore,run,export}/ and work/megatron.pt."""
    if importlib.util.find_spec("megatron") is None:  # (not imported here: the parent reads without it)
        pytest.skip("megatron-core is not installed (requirements-test.txt)")
    d = tmp_path_factory.mktemp("mcore")
    tok = tokenizer_files.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], None, vocab_size=384)
    tok.save(str(d / "tokenizer.json"))
    harness.in_fresh_process(megatron_side, str(d), free_port())
    return d


@pytest.fixture(scope="module")
def megatron(work):
    return torch.load(work / "megatron.pt", weights_only=False)


# ---------------------------------------------------------------------------------------------- (a) in
def test_layout_is_megatrons_stacked_one(work):
    """What the test reads is what Megatron-core writes: stacked layers, TE norm names, one [L, 2f, h] SwiGLU fc1."""
    md = convert._dist_reader(work / "dense" / "mcore").read_metadata().state_dict_metadata
    assert list(md["decoder.layers.mlp.linear_fc1.weight"].size) == [2, 96, 32]
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in md
    moe = convert._dist_reader(work / "moe" / "mcore").read_metadata().state_dict_metadata
    assert list(moe["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].size) == [4, 48, 32]


def test_import_matches_megatron_logits_and_loss(work, megatron):
    c = config64(FLAGS, work / "tokenizer.json")
    full = convert.megatron_state(convert.megatron_dist_state(work / "dense" / "mcore"), c)
    logits, loss = our_outputs(ours64(c, full), c)
    ref = megatron["dense"]
    assert logits.shape == ref["logits"].shape and loss.shape == ref["loss"].shape
    assert rel_err(logits, ref["logits"]) <= RTOL and rel_err(loss, ref["loss"]) <= RTOL
    run = checkpoint.load_model(work / "dense" / "run")  # tools.py import-megatron's run: the same weights, float32
    saved = run.model.state_dict()
    assert set(saved) == set(full)
    for k, t in full.items():
        assert torch.equal(saved[k], t.to(saved[k].dtype)), k
    assert run.ckpt.meta["iteration"] == 0 and run.ckpt.meta["weights_only"]


def test_moe_import_is_megatrons_state(work, megatron):
    """MoE: per-layer keys and expert-stacked tensors give exactly Megatron's own state_dict (renamed as
    from_megatron does)."""
    c = config64(MOE_FLAGS, work / "tokenizer.json")
    got = convert.megatron_state(convert.megatron_dist_state(work / "moe" / "mcore"), c)
    want = convert.megatron_state(megatron["moe"]["state"], c)
    assert set(got) == set(want) and "decoder.layers.1.mlp.experts.linear_fc1.weight3" in got
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_singleton_local_shards_layout_reads_the_same(work, case):
    """Megatron's other layout (sharded_state_dict(metadata={"singleton_local_shards": True})): per-layer keys,
    SwiGLU fc1 as KEY_w / KEY_v, one key per expert — the same tensors as the default layout's."""
    md = convert._dist_reader(work / case / "singleton").read_metadata().state_dict_metadata
    assert "decoder.layers.0.mlp.linear_fc1.weight_w" in md
    a = convert.megatron_dist_state(work / case / "mcore")
    b = convert.megatron_dist_state(work / case / "singleton")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_megatron_lm_run_directory_is_followed(work, tmp_path):
    """A Megatron-LM --save directory: latest_checkpointed_iteration.txt names iter_0000005/, the checkpoint read."""
    shutil.copytree(work / "dense" / "mcore", tmp_path / "iter_0000005")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    a, b = convert.megatron_dist_state(tmp_path), convert.megatron_dist_state(work / "dense" / "mcore")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6\n")  # names a checkpoint that is not there
    with pytest.raises(convert.MegatronDistError, match="iter_0000006: no metadata.json"):
        convert.megatron_dist_state(tmp_path)


def test_wrong_layer_order_is_caught(work, megatron):
    """Negative control: the stacked layers un-stacked in reverse (layer 0 <-> 1) fail the logits comparison."""
    c = config64(FLAGS, work / "tokenizer.json")
    swap = lambda k: k.replace("layers.0.", "layers.X.").replace("layers.1.", "layers.0.").replace("layers.X.", "layers.1.")
    state = {swap(k): v for k, v in convert.megatron_dist_state(work / "dense" / "mcore").items()}
    logits, _ = our_outputs(ours64(c, convert.megatron_state(state, c)), c)
    with pytest.raises(AssertionError):
        assert rel_err(logits, megatron["dense"]["logits"]) <= RTOL


class Backend(enum.Enum):  # stands for Megatron-LM's enums in its args (AttnBackend, ...): a class the reader lacks
    auto = 5


def megatron_lm_run(work, root: Path, **changes) -> Path:
    """A Megatron-LM --save directory: iter_0000003/ (the dense checkpoint) whose common.pt holds Megatron-LM's args
    for it, and latest_checkpointed_iteration.txt."""
    shutil.copytree(work / "dense" / "mcore", root / "iter_0000003")
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                              num_query_groups=2, ffn_hidden_size=48, swiglu=True, add_bias_linear=False,
                              normalization="RMSNorm", rotary_base=500, position_embedding_type="rope",
                              untie_embeddings_and_output_weights=True, max_position_embeddings=16, seq_length=16,
                              params_dtype=torch.bfloat16, attention_backend=Backend.auto, lr=3e-4)
    vars(args).update(changes)
    torch.save({"args": args, "iteration": 3, "checkpoint_version": 3.0}, root / "iter_0000003" / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")
    return root


def test_megatron_lm_args_give_the_architecture(work, tmp_path, capsys):
    """Without model flags, a Megatron-LM checkpoint's recorded args shape the model: the same run as the flags give
    (these args lack qk_layernorm: off, Megatron's meaning, where gpt's own default is on). Controls: args of another
    depth fail by name (so they are read), and a setting without a flag is refused."""
    run = megatron_lm_run(work, tmp_path / "lm")
    tools.main(["import-megatron", "--load", str(run), "--save", str(tmp_path / "run"), "--model", "gpt",
                "--tokenizer-file", str(work / "tokenizer.json")])
    a = checkpoint.load_model(work / "dense" / "run").model.state_dict()
    b = checkpoint.load_model(tmp_path / "run").model.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    deeper = megatron_lm_run(work, tmp_path / "lm3", num_layers=3)
    with pytest.raises(SystemExit, match="^2$"):
        tools.main(["import-megatron", "--load", str(deeper), "--save", str(tmp_path / "run3"), "--model", "gpt",
                    "--tokenizer-file", str(work / "tokenizer.json")])
    assert "lacks decoder.layers.2.input_layernorm.weight" in capsys.readouterr().err
    qkv_bias = megatron_lm_run(work, tmp_path / "lmb", add_qkv_bias=True)
    with pytest.raises(convert.MegatronDistError, match="add_qkv_bias=True has no train.py flag"):
        convert.megatron_lm_args(qkv_bias)


# ---------------------------------------------------------------------------------------------- (b) train from it
def test_train_starts_from_imported_run(work, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    code = train.main(["--pretrained-checkpoint", str(work / "dense" / "run"), "--save", str(tmp_path / "ft"),
                       "--data-path", str(corpus), "--data-cache-dir", str(tmp_path / "cache"), "--micro-batch-size",
                       "2", "--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "1", "--eval-interval",
                       "2", "--log-interval", "1", "--lr", "1e-4", "--seq-length", "16"])
    assert code == 0
    saved = checkpoint.load_model(tmp_path / "ft")
    assert saved.args.num_query_groups == 2 and saved.args.ffn_hidden_size == 48  # the import's architecture


# ---------------------------------------------------------------------------------------------- (c) out
def test_export_loads_into_megatron(work, megatron):
    run = checkpoint.load_model(work / "dense" / "run")
    c = dataclasses.replace(run.model.config, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
    ours = {k: v.double() for k, v in run.model.state_dict().items()}
    reloaded = convert.megatron_state(megatron["dense"]["reloaded"], c)
    assert set(reloaded) == set(ours)
    for k in ours:
        assert torch.equal(reloaded[k], ours[k]), k
    logits, loss = our_outputs(ours64(c, ours), c)
    assert rel_err(logits, megatron["dense"]["reloaded_logits"]) <= RTOL
    assert rel_err(loss, megatron["dense"]["reloaded_loss"]) <= RTOL


def test_export_then_import_is_exact(work, tmp_path):
    """Ours -> export-megatron -> import-megatron: every tensor of the run comes back bit for bit (padding rows too:
    the padded vocabulary sizes agree)."""
    tools.main(["export-megatron", "--load", str(work / "dense" / "run"), "--save", str(tmp_path / "mcore")])
    tools.main(["import-megatron", "--load", str(tmp_path / "mcore"), "--save", str(tmp_path / "back"), *FLAGS,
                "--tokenizer-file", str(work / "tokenizer.json")])
    a = checkpoint.load_model(work / "dense" / "run").model.state_dict()
    b = checkpoint.load_model(tmp_path / "back").model.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_export_pads_to_megatrons_vocabulary(work, tmp_path):
    """--padded-vocab-size: Megatron's rows (its padding depends on TP); the import cuts them back to ours."""
    tools.main(["export-megatron", "--load", str(work / "dense" / "run"), "--save", str(tmp_path / "mcore"),
                "--padded-vocab-size", "640"])
    rows = convert.megatron_dist_state(tmp_path / "mcore")["embedding.word_embeddings.weight"]
    run = checkpoint.load_model(work / "dense" / "run").model.state_dict()["embedding.word_embeddings.weight"]
    assert rows.shape[0] == 640 and torch.equal(rows[: run.shape[0]], run) and not rows[run.shape[0]:].any()


def test_export_refuses_what_it_does_not_map(work, tmp_path):
    c = config64(FLAGS, work / "tokenizer.json")
    with pytest.raises(convert.MegatronDistError, match="^export-megatron: mtp_num_layers=1 is not mapped"):
        convert.to_megatron_dist({}, dataclasses.replace(c, mtp_num_layers=1), tmp_path / "out")
    with pytest.raises(convert.MegatronDistError, match="^padded_vocab_size=8 is smaller than vocab_size="):
        convert.to_megatron_dist({}, c, tmp_path / "out", padded_vocab_size=8)
    with pytest.raises(convert.MegatronDistError, match="^export-megatron: decoder.layers.0.mixer.in_proj.weight is not"):
        convert.to_megatron_dist({"decoder.layers.0.mixer.in_proj.weight": torch.zeros(2)}, c, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def test_moe_export_loads_into_megatron(work, megatron):
    run = checkpoint.load_model(work / "moe" / "run")
    got = convert.megatron_state(megatron["moe"]["reloaded"], run.model.config)
    want = run.model.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k].to(want[k].dtype), want[k]), k


# ---------------------------------------------------------------------------------------------- (d) refusals
def rewrite(src: Path, dst: Path, edit):
    """A copy of torch_dist checkpoint `src` whose stored tensors {sharded key: tensor} went through `edit`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = convert._dist_reader(src)
    md = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items()
             if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)
    dst.mkdir()
    with warnings.catch_warnings():  # (DCP: "no process group, a single process": intended)
        warnings.simplefilter("ignore")
        dcp.save(edit(state), checkpoint_id=str(dst), no_dist=True)
    for name in ("metadata.json", "common.pt"):
        shutil.copy(src / name, dst / name)
    return dst


def import_fails(work, mcore, save, capsys) -> str:
    """tools.py import-megatron of `mcore` ends with one line `tools.py: error: ...` (returned)."""
    with pytest.raises(SystemExit, match="^2$"):
        tools.main(["import-megatron", "--load", str(mcore), "--save", str(save), *FLAGS, "--tokenizer-file",
                    str(work / "tokenizer.json")])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_missing_tensor_is_refused_by_name(work, tmp_path, capsys):
    bad = rewrite(work / "dense" / "mcore", work / "dense" / "no_fc2",
                  lambda s: {k: v for k, v in s.items() if k != "decoder.layers.mlp.linear_fc2.weight"})
    err = import_fails(work, bad, tmp_path / "run", capsys)
    assert "lacks decoder.layers.0.mlp.linear_fc2.weight" in err, err


def test_mismatched_shape_is_refused_by_name(work, tmp_path, capsys):
    def narrow(s):
        s["decoder.layers.self_attention.linear_proj.weight"] = s["decoder.layers.self_attention.linear_proj.weight"][..., :30]
        return s
    bad = rewrite(work / "dense" / "mcore", work / "dense" / "narrow_proj", narrow)
    err = import_fails(work, bad, tmp_path / "run", capsys)
    assert "decoder.layers.0.self_attention.linear_proj.weight has shape [32, 30]" in err, err


def test_not_a_megatron_checkpoint_is_refused(work, tmp_path, capsys):
    err = import_fails(work, work / "dense" / "run" / "iter_0000000", tmp_path / "run", capsys)
    assert "no metadata.json" in err, err
